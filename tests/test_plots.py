"""tpuattn.plots: where figures go and how titles say where their numbers come from."""

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
