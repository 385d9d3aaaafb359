"""Compile reports are reproducible: each committed report records the command, versions and problems
that made it, and ``python -m tpuattn.aot --reproduce`` diffs the rows (:mod:`tpuattn.measure.reports`,
here with a fake compile, so no TPU compiler is needed; tests/test_aot.py compiles committed reports
again for real)."""

from __future__ import annotations

import copy
import json
import shlex

import pytest

from tpuattn.measure import aot, reports
from tpuattn.measure import slices as slice_report
from tpuattn.pallas import blocks

COMMITTED = {"report": aot.REPORT, "blocks": blocks.COMPILED_TABLE,
             "blocks-paired": blocks.COMPILED_PAIRED_TABLE, "slices": slice_report.REPORT,
             "tokamax": aot.TOKAMAX_REPORT}
KINDS = {"tokamax": "report", "blocks-paired": "blocks"}  # a file's kind where it is not its name


@pytest.mark.parametrize("name", sorted(COMMITTED))
def test_every_committed_report_records_what_made_it(name):
    doc = json.loads(COMMITTED[name].read_text())
    kind = KINDS.get(name, name)
    assert doc["kind"] == kind and doc["created"][:2] == "20"
    assert doc["command"][:3] == ["python", "-m", "tpuattn.aot"] and "&&" not in doc["command"]
    assert set(doc["versions"]) == {"python", "jax", "jaxlib", "libtpu"}
    assert (doc["versions"]["jax"], doc["versions"]["libtpu"]) == (doc["jax_version"], doc["libtpu_version"])
    # One invocation of the recorded command compiles exactly the recorded problems, one job per row.
    assert reports.problems_from_command(doc["command"]) == (kind, doc["problems"])
    assert len(reports.jobs(kind, doc["problems"])) == len(doc["rows"])


def _replay(doc):
    """A fake compile: the recorded row of each job (the jobs come in row order)."""
    rows = {reports.describe_job(doc["kind"], job): row
            for job, row in zip(reports.jobs(doc["kind"], doc["problems"]), doc["rows"], strict=True)}
    return lambda kind, job: copy.deepcopy(rows[reports.describe_job(kind, job)])


def _write(tmp_path, doc):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_tampered_row_is_reported_as_a_difference(tmp_path):
    doc = json.loads(aot.REPORT.read_text())
    fake = _replay(doc)
    lines = []
    assert reports.reproduce(_write(tmp_path, doc), limit=5, run=fake, out=lines.append) == 0
    assert lines[-1] == "no difference" and sum(line.endswith(": same") for line in lines) == 5

    tampered = copy.deepcopy(doc)
    row = tampered["rows"][0]
    row["peak_hbm_bytes"] += 1  # an int: exact
    row["optimal_seconds"] *= 1.001  # a float beyond the tolerance
    row["new_field"] = 1
    del row["fusions"]
    row["compile_s"] = 1e9  # a timing: not compared
    lines = []
    assert reports.reproduce(_write(tmp_path, tampered), limit=5, run=fake, out=lines.append) == 1
    text = "\n".join(lines)
    assert "row 0 (v5e reference fwd T=2048): DIFFERENT" in text
    assert f"changed peak_hbm_bytes: {row['peak_hbm_bytes']} -> {row['peak_hbm_bytes'] - 1}" in text
    assert "changed optimal_seconds" in text
    assert "removed new_field" in text and "added fusions=" in text
    assert not any("compile_s" in line for line in lines if line.startswith("    "))
    assert lines[-1] == "1 difference(s)"


def test_floats_agree_within_the_stated_tolerance():
    row = {"flops": 1.0e12, "status": "ok", "compile_s": 3.0}
    close = {"flops": 1.0e12 * (1 + reports.RTOL / 2), "status": "ok", "compile_s": 9.0}
    assert reports.diff_rows(row, close) == []
    assert reports.diff_rows(row, {"flops": 1.0e12 * (1 + 2 * reports.RTOL), "status": "ok"}) != []
    assert reports.diff_rows({"n": 1}, {"n": True}) == ["changed n: 1 -> True"]
    assert reports.diff_rows({"window": [64, 16]}, {"window": (64, 16)}) == []  # as the JSON file holds it


def test_a_command_that_no_longer_makes_the_rows_is_a_difference(tmp_path):
    doc = json.loads(blocks.COMPILED_TABLE.read_text())
    moved = copy.deepcopy(doc)
    moved["command"] = shlex.split("python -m tpuattn.aot --blocks --chips v5e --head-dims 128")
    lines = []
    assert reports.reproduce(_write(tmp_path, moved), limit=1, run=_replay(doc), out=lines.append) >= 1
    assert lines[0].startswith("DIFFERENT: the recorded command no longer compiles the recorded problems")


def test_a_report_without_its_record_is_refused(tmp_path):
    path = _write(tmp_path, {"label": aot.LABEL, "rows": []})
    with pytest.raises(ValueError, match=r"^FILE: expected a report recording \['kind', 'command'"):
        reports.reproduce(path)


def test_limit_spreads_the_rows_and_keeps_both_ends():
    assert reports.pick(144, 2) == [0, 143] and reports.pick(144, None) == list(range(144))
    assert reports.pick(10, 4) == [0, 3, 6, 9] and reports.pick(3, 10) == [0, 1, 2]
    with pytest.raises(ValueError, match="^limit: expected a positive int"):
        reports.pick(10, 0)


def test_one_invocation_writes_one_whole_report(tmp_path):
    # The slice preset's four sweeps (once four commands joined by &&) are one report's problems: two
    # slices x four lengths x ring and all-gather, then two forward+backward rows and two on v5e:2x2.
    problems, _ = slice_report.parse(["--slices", "--preset", "notebook"])
    assert len(problems["sweeps"]) == 4 and len(slice_report.slice_jobs(problems)) == 2 * (4 + 4) + 2 + 2
    doc = aot.document("slices", [{"a": (1, 2)}], command=["python", "-m", "tpuattn.aot", "--slices"],
                       problems=problems, label=slice_report.LABEL)
    csv_path, json_path = aot.save(doc, tmp_path, ["a"])
    saved = json.loads(json_path.read_text())
    assert json_path.name == "slices.json" and saved["rows"] == [{"a": [1, 2]}]
    assert saved["versions"] == aot.versions() and saved["problems"] == problems
