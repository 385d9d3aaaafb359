"""tpuattn.viz.grid: the drawing of the Pallas kernel's grid walk and its widget.

Runs where matplotlib (and, for the widget, ipywidgets) are installed; the JAX 0.7.2 test
environment has neither, so this module is skipped there.
"""

import pytest

pytest.importorskip("matplotlib")

from tpuattn.model import counts  # noqa: E402
from tpuattn.viz import grid  # noqa: E402


def test_draw_grid_returns_a_figure_with_both_panels(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    fig = grid.draw_grid(counts.spec_for(512, causal=True), (128, 128))
    assert len(fig.axes) == 2
    assert "10 of 16 computed" in fig.axes[0].get_title()
    assert "9 of 16 K/V fetches" in fig.axes[1].get_title()
    fig.savefig(tmp_path / "grid.png")
    assert (tmp_path / "grid.png").stat().st_size > 0


def test_grid_widget_redraws_on_change(monkeypatch):
    pytest.importorskip("ipywidgets")
    import matplotlib

    matplotlib.use("Agg")
    drawn = []
    original = grid.draw_grid

    def recording_draw_grid(spec, block_sizes=None, **kwargs):
        drawn.append((spec.q_len, spec.kv_len, spec.causal, spec.window, block_sizes))
        return original(spec, block_sizes, **kwargs)

    monkeypatch.setattr(grid, "draw_grid", recording_draw_grid)
    widget = grid.grid_widget(q_len=256, kv_len=256, causal=True)
    assert drawn == [(256, 256, True, None, (128, 128))]
    message, picture = widget.children[2:]
    first = picture.value
    assert first[:8] == b"\x89PNG\r\n\x1a\n" and message.value == ""
    q_len_slider, _, _, block_kv_slider = widget.children[0].children
    causal_box, window_box, window_slider = widget.children[1].children
    q_len_slider.value = 384
    block_kv_slider.value = 256
    window_slider.value = 128
    window_box.value = True
    causal_box.value = False
    assert drawn[1:] == [(384, 256, True, None, (128, 128)), (384, 256, True, None, (128, 256)),
                         (384, 256, True, None, (128, 256)), (384, 256, True, (128, None), (128, 256)),
                         (384, 256, False, (128, None), (128, 256))]
    assert picture.value != first and picture.value[:4] == b"\x89PNG"


def test_grid_widget_shows_why_it_cannot_draw(monkeypatch):
    pytest.importorskip("ipywidgets")
    import matplotlib

    matplotlib.use("Agg")
    widget = grid.grid_widget(q_len=256, kv_len=256, causal=True)
    message, picture = widget.children[2:]
    before = picture.value

    def refusing_draw_grid(spec, block_sizes=None, **kwargs):
        raise ValueError("block_q must divide q_len <b>")

    monkeypatch.setattr(grid, "draw_grid", refusing_draw_grid)
    widget.children[0].children[0].value = 384
    assert "cannot draw" in message.value and "&lt;b&gt;" in message.value
    assert picture.value == before
