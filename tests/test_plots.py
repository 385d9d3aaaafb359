"""tpuattn.viz: where figures go, how titles say where their numbers come from, one palette."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib", reason="the notebooks extra; the JAX 0.7.2 test env has none")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tpuattn.measure import runtime as platform  # noqa: E402
from tpuattn.viz import style as plots  # noqa: E402


def test_save_figure_honours_env_dir_and_writes_png(tmp_path, monkeypatch):
    monkeypatch.setenv("TPUATTN_FIGURES_DIR", str(tmp_path / "figs"))
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = plots.save_figure(fig, "01_test")
    plt.close(fig)
    assert path == tmp_path / "figs" / "01_test.png"
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"Software" not in data and b"matplotlib version" not in data


def test_figures_dir_defaults_to_the_ignored_out_folder(tmp_path, monkeypatch):
    # Running the notebooks must not modify the committed figures/: by default figures go to
    # out/figures (out/ is ignored), from notebooks/ as from the repository root.
    monkeypatch.delenv("TPUATTN_FIGURES_DIR", raising=False)
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")
    assert plots.figures_dir() == tmp_path / "out" / "figures"
    monkeypatch.chdir(tmp_path)
    assert plots.figures_dir() == tmp_path / "out" / "figures"
    assert (tmp_path / "out" / "figures").is_dir()
    assert not (tmp_path / "figures").exists()


def test_out_is_ignored_and_figures_is_not():
    # The default above is only clean if git ignores out/; the committed figures/ must stay tracked.
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    ignored = [line.strip() for line in (root / ".gitignore").read_text().splitlines()]
    assert "/out/" in ignored or "out/" in ignored
    assert not any(line.strip("/") == "figures" for line in ignored)


def test_labels_say_backend_and_measured_or_modelled():
    label = platform.info().label()
    assert plots.backend_label(measured=True) == f"{label}, measured"
    assert plots.backend_label(measured=False) == "modelled"
    assert plots.labelled("Peak memory", measured=True) == f"Peak memory\n({label}, measured)"
    assert plots.labelled("HBM", measured=False, chip="TPU v5e") == "HBM\n(modelled for TPU v5e)"
    if platform.info().backend == "cpu":
        assert plots.backend_label(measured=True, interpret=True) == "cpu (interpret), measured"


def test_block_map_uses_the_tile_palette():
    from matplotlib.colors import to_hex

    from tpuattn.spec import EMPTY, FULL, PARTIAL, MaskSpec
    from tpuattn.viz import tiles

    fig, ax = plt.subplots()
    tiles.draw_block_map(ax, MaskSpec(512, 512, causal=True).block_map(128, 128), title="causal")
    legend = {text.get_text(): to_hex(patch.get_facecolor())
              for text, patch in zip(ax.get_legend().get_texts(), ax.get_legend().get_patches(), strict=True)}
    plt.close(fig)
    assert legend == {plots.TILE_LABELS[code]: plots.TILE_COLOURS[code] for code in (EMPTY, PARTIAL, FULL)}
    assert "run 10 of 16 tiles (6 skipped)" in ax.get_title()


def test_memory_plot_colours_by_implementation_and_draws_guides():
    from tpuattn.viz import tiles

    fig, ax = plt.subplots()
    results = {("reference", "fwd"): [(1024, 40.0), (2048, 150.0)],
               ("blockwise", "fwd"): [(1024, 30.0), (2048, 55.0)]}
    tiles.plot_memory(ax, results, label="cpu", guides=(("reference", 2),))
    lines = {line.get_label(): line for line in ax.get_lines()}
    plt.close(fig)
    assert lines["reference, fwd"].get_color() == plots.impl_colour("reference")
    assert lines["blockwise, fwd"].get_color() == plots.impl_colour("blockwise")
    assert list(lines["~ length^2 (from reference at 1024)"].get_ydata()) == [40.0, 160.0]


def test_bench_figures_use_the_implementation_colours():
    from tpuattn.measure.bench import TIMING_COMPILED, BenchResults
    from tpuattn.viz import timings as bench_figures

    row = dict(mode="fwd", status="ok", timing_kind=TIMING_COMPILED, causal=False, dtype="float32")
    rows = [dict(row, impl=impl, seq_len=n, median_s=1e-3 * n)
            for impl in ("xla", "blockwise") for n in (256, 512)]
    fig, ax = plt.subplots()
    bench_figures.plot_time(BenchResults(rows, {"label": "cpu", "jax_version": "x"}), ax)
    colours = {line.get_label().split()[0]: line.get_color() for line in ax.get_lines()}
    plt.close(fig)
    assert colours == {impl: plots.impl_colour(impl) for impl in ("xla", "blockwise")}


def test_one_fixed_colour_per_implementation_and_stable_ones_for_new_names():
    names = ("reference", "xla", "blockwise", "pallas", "splash")
    built_in = {name: plots.impl_colour(name) for name in names}
    assert built_in == plots.IMPL_COLOURS and len(set(built_in.values())) == len(built_in)
    for name in ("ring", "sharded", "paged_decode", "mine"):
        colour = plots.impl_colour(name)
        assert colour in plots.EXTRA_IMPL_COLOURS and colour == plots.impl_colour(name)
        assert colour not in built_in.values()


def _rows_with_interpreted():
    from tpuattn.measure.bench import TIMING_COMPILED, TIMING_INTERPRET

    row = dict(status="ok", causal=True, dtype="float32")
    compiled = [dict(row, impl=impl, mode=mode, seq_len=n, median_s=1e-3 * n, tflops=0.01,
                     timing_kind=TIMING_COMPILED)
                for impl in ("xla", "reference") for mode in ("fwd", "fwd+bwd") for n in (256, 512, 1024)]
    interpreted = [dict(row, impl="pallas", mode=mode, seq_len=128, median_s=2.0, tflops=None,
                        timing_kind=TIMING_INTERPRET) for mode in ("fwd", "fwd+bwd")]
    return compiled + interpreted


def test_interpret_mode_rows_never_share_a_time_axis_with_compiled_ones():
    from tpuattn.measure.bench import BenchResults
    from tpuattn.viz import timings as bench_figures

    results = BenchResults(_rows_with_interpreted(), {"label": "cpu", "jax_version": "x"})
    fig, (compiled_ax, interpret_ax) = plt.subplots(1, 2)
    bench_figures.plot_time(results, compiled_ax)
    bench_figures.plot_time(results, interpret_ax, interpret=True)
    compiled_labels = [line.get_label() for line in compiled_ax.get_lines()]
    interpret_labels = [line.get_label() for line in interpret_ax.get_lines()]
    plt.close(fig)
    assert compiled_labels and not any("interpret" in label for label in compiled_labels)
    assert interpret_labels == ["pallas causal float32 (interpret)"]
    assert "NOT kernel speed" in interpret_ax.get_title()

    figure = bench_figures.figure(results, "time")  # one row of compiled panels, one of interpreted
    axes = figure.get_axes()
    assert len(axes) == 4
    for ax in axes:
        kinds = {"interpret" in line.get_label() for line in ax.get_lines()}
        assert len(kinds) == 1, ax.get_title()
    tflops = bench_figures.figure(results, "tflops")
    assert not any("interpret" in line.get_label() for ax in tflops.get_axes() for line in ax.get_lines())


def test_roofline_draws_measured_runs_in_their_implementation_colour_below_the_roof():
    from matplotlib.colors import to_hex

    from tpuattn.model import roofline
    from tpuattn.viz import timings as bench_figures

    chip = roofline.chip_spec("v5e")
    fig, ax = plt.subplots()
    bench_figures.plot_roofline(ax, chip, measured=[("splash fwd", 300.0, 100e12, "splash"),
                                                    ("xla fwd", 40.0, 20e12, "xla")])
    stars = {c.get_label(): to_hex(c.get_facecolor()[0]) for c in ax.collections if c.get_label().endswith(
        "(measured)")}
    gaps = [c for c in ax.collections if c.get_linestyle() and c.get_label().startswith("_")]
    title = ax.get_title()
    plt.close(fig)
    assert stars == {"splash fwd (measured)": plots.impl_colour("splash"),
                     "xla fwd (measured)": plots.impl_colour("xla")}
    assert len(gaps) == 2 and "measured runs" in title
