"""tpuattn.bench: the FLOP count, the interpret-mode label rule, files written, failures as rows.

No test asserts a timing: only that rows are produced, labelled and written correctly.
"""

import csv
import json
import sys

import jax
import pytest

from tpuattn import api, bench, registry
from tpuattn.errors import UnavailableImplementation, UnsupportedInput
from tpuattn.impl.reference import reference_attention

# ----------------------------------------------------------------------------- FLOPs


def test_flop_count_is_exact():
    kwargs = dict(batch=2, heads=3, q_len=5, kv_len=7, head_dim=11)
    assert bench.attention_flops(**kwargs) == 4 * 2 * 3 * 5 * 7 * 11 == 9240
    assert bench.attention_flops(**kwargs, causal=True) == 4620
    assert bench.attention_flops(**kwargs, mode="fwd+bwd") == 9240 * 3.5
    assert bench.attention_flops(**kwargs, causal=True, mode="fwd+bwd") == 4620 * 3.5
    # kv_len defaults to q_len (self-attention).
    assert bench.attention_flops(batch=1, heads=1, q_len=8, head_dim=2) == 4 * 8 * 8 * 2


def test_flop_count_bad_arguments():
    with pytest.raises(ValueError, match="heads: expected a positive int, got 0"):
        bench.attention_flops(batch=1, heads=0, q_len=8, head_dim=2)
    with pytest.raises(ValueError, match=r"mode: expected one of \('fwd', 'fwd\+bwd'\), got 'bwd'"):
        bench.attention_flops(batch=1, heads=1, q_len=8, head_dim=2, mode="bwd")


# ----------------------------------------------------------------------------- labels


def test_interpret_mode_label_rule():
    assert bench.runs_interpreted("pallas", "cpu")
    assert bench.runs_interpreted("splash", "gpu")
    assert not bench.runs_interpreted("pallas", "tpu")
    assert not bench.runs_interpreted("reference", "cpu")
    assert not bench.runs_interpreted("xla", "cpu")
    assert bench.runs_interpreted("reference", "tpu", {"interpret": True})
    assert bench.timing_kind("pallas", "cpu") == "measured (interpret mode — not kernel speed)"
    assert bench.timing_kind("pallas", "tpu") == "measured (compiled)"


@pytest.fixture
def fake_impls(monkeypatch):
    """Registers throwaway implementations (removed after the test)."""

    def add(name, fn=reference_attention, **kwargs):
        record = registry.Implementation(name=name, fn=fn, description="test", **kwargs)
        monkeypatch.setitem(registry._REGISTRY, name, record)
        return name

    api._load()
    return add


def test_interpreted_rows_have_no_tflops(fake_impls):
    kernel = fake_impls("fake_kernel", interpreted_off_tpu=True)
    assert bench.runs_interpreted(kernel, "cpu") and not bench.runs_interpreted(kernel, "tpu")
    results = bench.run([kernel, "reference"], bench.sweep([16]), repeats=1, progress=False)
    by_impl = {row["impl"]: row for row in results.rows}
    interp, compiled = by_impl[kernel], by_impl["reference"]
    assert interp["status"] == compiled["status"] == "ok"
    if jax.default_backend() != "tpu":
        assert interp["timing_kind"] == bench.TIMING_INTERPRET
        assert interp["tflops"] is None and interp["median_s"] > 0
        assert interp["device_label"].endswith("(interpret)")
    assert compiled["timing_kind"] == bench.TIMING_COMPILED
    assert compiled["tflops"] == pytest.approx(compiled["flops"] / compiled["median_s"] / 1e12)


def test_failures_become_rows(fake_impls):
    def out_of_memory(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 123 bytes")

    def broken(*args, **kwargs):
        raise TypeError("something else")

    def refuses_inside(*args, **kwargs):
        raise UnsupportedInput("refused while tracing")

    names = [
        fake_impls("fake_oom", out_of_memory),
        fake_impls("fake_broken", broken),
        fake_impls("fake_unsupported",
                   supports=lambda spec, backend: "no causal masks" if spec.causal else None),
        fake_impls("fake_unavailable", available=lambda: False),
        fake_impls("fake_refuses_inside", refuses_inside),
    ]
    results = bench.run(names, bench.sweep([8], causal=(True,)), repeats=1, progress=False)
    status = {row["impl"]: (row["status"], row["error"]) for row in results.rows}
    assert status["fake_oom"] == ("oom", "RuntimeError: RESOURCE_EXHAUSTED: Out of memory allocating 123 "
                                         "bytes")
    assert status["fake_broken"] == ("error", "TypeError: something else")
    assert status["fake_unsupported"] == ("unsupported", "no causal masks")
    assert status["fake_unavailable"][0] == "unavailable"
    assert status["fake_refuses_inside"] == ("unsupported", "UnsupportedInput: refused while tracing")
    assert all(row["median_s"] is None and row["tflops"] is None for row in results.rows)


def test_classify_error_by_type():
    assert bench.classify_error(MemoryError()) == "oom"
    assert bench.classify_error(RuntimeError("RESOURCE_EXHAUSTED: 1 GiB")) == "oom"
    assert bench.classify_error(UnsupportedInput("impl: 'x' does not support: window")) == "unsupported"
    assert bench.classify_error(NotImplementedError()) == "unsupported"
    assert bench.classify_error(UnavailableImplementation("impl: 'x' is not available")) == "unavailable"
    # The type decides, not the words: a plain ValueError saying "does not support" is an error.
    assert bench.classify_error(ValueError("impl: 'x' does not support: window")) == "error"
    assert bench.classify_error(ValueError("q: expected rank 4")) == "error"


# ----------------------------------------------------------------------------- end to end


def test_tiny_sweep_writes_csv_and_json(tmp_path):
    shapes = bench.sweep([16], heads=2, head_dim=8, causal=(True,))
    results = bench.run(["reference"], shapes, modes=("fwd", "fwd+bwd"), warmup=1, repeats=2, progress=False)
    assert len(results.rows) == 2
    for row in results.rows:
        assert row["status"] == "ok", row["error"]
        assert row["flops"] == bench.attention_flops(batch=1, heads=2, q_len=row["seq_len"], head_dim=8,
                                                     causal=row["causal"], mode=row["mode"])
        assert row["min_s"] <= row["median_s"] <= row["max_s"] and row["repeats"] >= 2
        assert row["compile_s"] > 0 and row["tflops"] > 0
    csv_path, json_path = results.save(tmp_path / "out")

    with csv_path.open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and tuple(rows[0]) == bench.COLUMNS
    assert {r["jax_version"] for r in rows} == {jax.__version__}
    assert {r["backend"] for r in rows} == {jax.default_backend()}
    assert rows[0]["peak_mib"] == ""  # not measured: empty, not "None"

    data = json.loads(json_path.read_text(encoding="utf-8"))
    for key in ("jax_version", "jaxlib_version", "backend", "device_kind", "device_count", "timestamp_utc"):
        assert key in data["environment"], key
    assert data["environment"]["jax_version"] == jax.__version__
    again = bench.BenchResults.from_json(json_path)
    assert again.rows[1]["median_s"] == results.rows[1]["median_s"]
    assert "reference" in results.table()


def test_memory_only_row():
    results = bench.run(["reference"], bench.sweep([16], heads=1, head_dim=8), memory=True, timing=False,
                        progress=False)
    (row,) = results.rows
    assert row["status"] == "ok" and row["median_s"] is None
    assert row["peak_mib"] > 0 and row["memory_method"]


def test_cli_writes_files(tmp_path, capsys):
    try:
        import matplotlib  # noqa: F401 - the notebooks extra; the JAX 0.7.2 test env has none
        figures = ["--figures"]
    except ImportError:
        figures = []
    from tpuattn.viz import timings as bench_figures  # what `python -m tpuattn.bench` passes

    out = tmp_path / "bench"
    bench.main(["--impls", "reference", "--seq-lens", "16", "--heads", "1", "--head-dim", "8",
                "--repeats", "1", "--out", str(out), "--no-progress", *figures],
               save_figures=bench_figures.save_figures)
    assert (out / "bench.csv").exists() and (out / "bench.json").exists()
    printed = capsys.readouterr().out
    assert "measured (compiled)" in printed and "bench.json" in printed
    if figures:
        assert (out / "bench_time.png").stat().st_size > 0
        assert (out / "bench_tflops.png").stat().st_size > 0


def test_text_progress_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # import now raises ImportError
    bar = bench.progress_bar(2)
    assert isinstance(bar, bench._TextProgress)
    bar.set_description("reference fwd")
    bar.update()
    bar.close()
    assert "[1/2] reference fwd" in capsys.readouterr().err


# ----------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("call, message", [
    (lambda: bench.run(["nope"], bench.sweep([16])), "impls: expected names from"),
    (lambda: bench.run(["reference"], bench.sweep([16]), modes=["bwd"]), "mode: expected one of"),
    (lambda: bench.run(["reference"], []), "shapes: expected at least one Shape"),
    (lambda: bench.run(["reference"], [16]), "shapes: expected Shape objects"),
    (lambda: bench.run(["reference"], bench.sweep([16]), repeats=0), "repeats: expected a positive int"),
    (lambda: bench.run(["reference"], bench.sweep([16]), options={"blockwise": {}}),
     "options: expected keys among the benchmarked impls"),
    (lambda: bench.run(["reference"], bench.sweep([16]), timing=False), "timing, memory"),
    (lambda: bench.Shape(seq_len=0), "seq_len: expected a positive int, got 0"),
    (lambda: bench.Shape(seq_len=16, heads=6, kv_heads=4), "heads: expected a multiple of kv_heads=4, got 6"),
    (lambda: bench.Shape(seq_len=16, dtype="int8"), "dtype: expected one of"),
    (lambda: bench.Shape(seq_len=16, causal="yes"), "causal: expected a bool"),
    (lambda: bench.sweep([]), "seq_lens: expected at least one value"),
])
def test_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_cli_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--impls", "reference", "--modes", "bwd", "--no-progress"])
    assert exit_info.value.code == 2
    assert "mode: expected one of" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--seq-lens", "a,b"])
    capsys.readouterr()
    with pytest.raises(SystemExit):  # the measuring layer draws nothing itself
        bench.main(["--impls", "reference", "--figures", "--no-progress"])
    assert "--figures: draw with `python -m tpuattn.bench`" in capsys.readouterr().err


def test_module_cli_runs(tmp_path, monkeypatch, capsys):
    """``python -m tpuattn.bench`` (the kept path) runs the measuring layer's command line.

    Run as ``python -m`` runs it (``runpy`` executes the module as ``__main__``), in this process: a
    child Python would spend most of the test importing JAX again."""
    import runpy

    # As in a fresh interpreter: the kept path not yet imported (so it is not the alias object).
    monkeypatch.delitem(sys.modules, "tpuattn.bench", raising=False)
    monkeypatch.setattr(sys, "argv", ["tpuattn.bench", "--impls", "reference", "--seq-lens", "16", "--heads",
                                      "1", "--head-dim", "8", "--repeats", "1", "--warmup", "0",
                                      "--out", str(tmp_path), "--no-progress"])
    runpy.run_module("tpuattn.bench", run_name="__main__", alter_sys=True)
    assert (tmp_path / "bench.json").exists()
    assert "measured (compiled)" in capsys.readouterr().out
