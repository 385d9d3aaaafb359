"""Compile reports made again: ``python -m tpuattn.aot --reproduce FILE [--limit N]``.

Every report file (:func:`tpuattn.measure.aot.document`: the chip report, the block table, the slice
report) records the command that made it, the versions that compiled it and its problems. Here the
problems are expanded into one job per row (:func:`jobs`, in the report's row order), compiled again
with the installed compiler (:func:`run_job`), and each new row compared with the recorded one
(:func:`diff_rows`): fields added, removed or changed. Floats agree within a relative :data:`RTOL`;
ints, strings, bools and None must be equal; timings (:data:`VOLATILE`) are not compared. The recorded
command must still describe the recorded problems (:func:`problems_from_command`). The exit status is
1 on any difference.
"""

from __future__ import annotations

import json
from pathlib import Path

from tpuattn.measure import aot, slices

VOLATILE = ("compile_s",)  # a timing: recorded, never compared
RTOL = 1e-6  # floats agree when |a - b| <= RTOL * max(|a|, |b|); ints, strings, bools and None exactly


def jobs(kind: str, problems: dict) -> list[tuple]:
    """One job per row of a ``kind`` report made from ``problems``, in row order."""
    if kind == "report":
        return aot.report_jobs(problems)
    if kind == "blocks":
        return aot.block_jobs(problems)
    if kind == "slices":
        return slices.slice_jobs(problems)
    raise ValueError(f"kind: expected one of {list(aot.KINDS)}, got {kind!r}")


def run_job(kind: str, job: tuple) -> dict:
    """Compile one job of :func:`jobs` with the installed compiler; return its row."""
    if kind == "report":
        return aot.compile_row(*job)
    if kind == "blocks":
        return aot.block_row(*job)
    topology, strategy, mode, seq_len, options = job
    return slices.slice_row(topology, strategy, mode, seq_len, **options)


def describe_job(kind: str, job: tuple) -> str:
    if kind == "report":
        chip, impl, mode, problem = job
        return f"{chip} {impl} {mode} T={problem.seq_len}"
    if kind == "blocks":
        chip, kernel, block_q, block_kv, head_dim, dtype = job
        return f"{chip} {kernel} d={head_dim} {dtype} {block_q}x{block_kv}"
    topology, strategy, mode, seq_len, options = job
    return f"{topology} {strategy} {options.get('layout', 'natural')} {mode} T={seq_len}"


def problems_from_command(command) -> tuple[str, dict]:
    """``(kind, problems)`` that a recorded ``command`` (argv, ``python -m tpuattn.aot ...``) compiles."""
    argv = list(command)
    if argv[:3] != ["python", "-m", "tpuattn.aot"]:
        raise ValueError(f"command: expected ['python', '-m', 'tpuattn.aot', ...], got {argv!r}")
    argv = argv[3:]
    if "--slices" in argv:
        return "slices", slices.parse(argv)[0]
    kind, problems, _ = aot.parse(argv)
    return kind, problems


def _same(a, b, rtol: float) -> bool:
    number = lambda x: isinstance(x, int | float) and not isinstance(x, bool)
    if number(a) and number(b):
        if isinstance(a, float) or isinstance(b, float):
            return abs(a - b) <= rtol * max(abs(a), abs(b))
        return a == b
    return a == b and type(a) is type(b)


def diff_rows(recorded: dict, again: dict, *, rtol: float = RTOL, ignore=VOLATILE) -> list[str]:
    """What differs between a recorded row and the same job compiled again: fields ``added`` (only in
    the new row), ``removed`` (only in the recorded one) and ``changed`` (floats within ``rtol``
    relative agree; everything else must be equal); ``ignore``'d fields are not compared."""
    again = aot._as_json(again)
    out = []
    for key in recorded.keys() | again.keys():
        if key in ignore:
            continue
        if key not in recorded:
            out.append(f"added {key}={again[key]!r}")
        elif key not in again:
            out.append(f"removed {key} (was {recorded[key]!r})")
        elif not _same(recorded[key], again[key], rtol):
            out.append(f"changed {key}: {recorded[key]!r} -> {again[key]!r}")
    return sorted(out)


def pick(n_rows: int, limit: int | None) -> list[int]:
    """Row indices to compile again: all, or ``limit`` of them spread evenly, first and last included."""
    if limit is None or limit >= n_rows:
        return list(range(n_rows))
    if limit < 1:
        raise ValueError(f"limit: expected a positive int, got {limit!r}")
    if limit == 1:
        return [0]
    return sorted({round(i * (n_rows - 1) / (limit - 1)) for i in range(limit)})


def reproduce(path, *, limit: int | None = None, run=None, out=print, rtol: float = RTOL) -> int:
    """Compile a report file's recorded problems again (``limit``: that many rows, spread evenly;
    ``run(kind, job) -> row``: the compile, :func:`run_job` by default) and print a row-by-row diff
    against the recorded rows. Returns the number of differences (rows that differ, or a recorded
    command that no longer describes the recorded problems)."""
    path = Path(path)
    doc = json.loads(path.read_text())
    missing = [key for key in ("kind", "command", "versions", "problems", "rows") if key not in doc]
    if missing:
        raise ValueError(f"FILE: expected a report recording {missing} ({path}); remake it with its command")
    kind, rows = doc["kind"], doc["rows"]
    run = run_job if run is None else run
    differences = 0
    command_kind, command_problems = problems_from_command(doc["command"])
    if (command_kind, aot._as_json(command_problems)) != (kind, doc["problems"]):
        out(f"DIFFERENT: the recorded command no longer compiles the recorded problems: {command_problems}")
        differences += 1
    todo = jobs(kind, doc["problems"])
    if len(todo) != len(rows):
        out(f"DIFFERENT: the problems make {len(todo)} rows, the report has {len(rows)}")
        return differences + 1
    picked = pick(len(rows), limit)
    installed = aot.versions()
    out(f"reproduce {path}: {len(picked)} of {len(rows)} rows ({kind}); recorded with {doc['versions']}, "
        f"compiling with {installed}")
    if any(doc["versions"].get(k) != installed[k] for k in ("jax", "libtpu")):
        out("  note: a different JAX or libtpu: differences may be the compiler's, not the code's")
    out(f"  floats agree within relative {rtol:g}; not compared: {', '.join(VOLATILE)} (timings)")
    for index in picked:
        job = todo[index]
        found = diff_rows(rows[index], run(kind, job), rtol=rtol)
        name = f"row {index} ({describe_job(kind, job)})"
        if found:
            differences += 1
            out(f"{name}: DIFFERENT")
            for line in found:
                out(f"    {line}")
        else:
            out(f"{name}: same")
    out(f"{differences} difference(s)" if differences else "no difference")
    return differences


def main(argv=None) -> None:
    """``python -m tpuattn.aot --reproduce FILE [--limit N]``: exits 0 when the rows agree, else 1."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m tpuattn.aot --reproduce",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--reproduce", metavar="FILE", required=True,
                        help="a report file (e.g. tpuattn/measure/compiled_report.json)")
    parser.add_argument("--limit", type=int, default=None,
                        help="compile only this many rows, spread evenly over the report (first and last)")
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    if not aot.tpu_available():
        parser.error('libtpu is not installed: pip install "jax[tpu]==<your JAX version>"')
    raise SystemExit(1 if reproduce(args.reproduce, limit=args.limit) else 0)
