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


def test_figures_dir_from_notebooks_folder_is_repo_figures(tmp_path, monkeypatch):
    monkeypatch.delenv("TPUATTN_FIGURES_DIR", raising=False)
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")
    assert plots.figures_dir() == tmp_path / "figures"
    monkeypatch.chdir(tmp_path)
    assert plots.figures_dir() == tmp_path / "figures"
    assert (tmp_path / "figures").is_dir()


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
    from tpuattn.viz import bench as bench_figures

    row = dict(mode="fwd", status="ok", timing_kind=TIMING_COMPILED, causal=False, dtype="float32")
    rows = [dict(row, impl=impl, seq_len=n, median_s=1e-3 * n)
            for impl in ("xla", "blockwise") for n in (256, 512)]
    fig, ax = plt.subplots()
    bench_figures.plot_time(BenchResults(rows, {"label": "cpu", "jax_version": "x"}), ax)
    colours = {line.get_label().split()[0]: line.get_color() for line in ax.get_lines()}
    plt.close(fig)
    assert colours == {impl: plots.impl_colour(impl) for impl in ("xla", "blockwise")}
