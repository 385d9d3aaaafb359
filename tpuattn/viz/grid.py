"""Pictures of the Pallas kernel's block schedule (notebook 03): the grid walk and a widget.

The numbers come from :mod:`tpuattn.model.counts` (the kernel's own schedule and index maps);
colours from :mod:`tpuattn.viz.style` (one per tile code, one per kind of grid step).
matplotlib and ipywidgets are imported inside the functions that need them.
"""

from __future__ import annotations

import numpy as np

from tpuattn.model.counts import describe_mask, grid_walk, spec_for
from tpuattn.spec import EMPTY, FULL, PARTIAL, AttentionSpec
from tpuattn.viz.style import STEP_COLOURS, TILE_COLOURS, TILE_LABELS

__all__ = ["draw_grid", "grid_widget"]


def draw_grid(spec: AttentionSpec, block_sizes=None, *, annotate: bool | None = None,
              title: str | None = None):
    """Draw the forward grid as the kernel's schedule visits it; returns the matplotlib Figure.

    Left: the ``[q blocks x kv blocks]`` tiles -- skipped, computed with the element mask,
    computed without it. Right: the grid as executed, ``[q blocks x kv steps]``; each cell
    names the kv block its index map returns and says whether that step fetches it from HBM
    (a new block), reuses the resident one, or idles (padded step: no compute, no DMA).
    """
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    walk = grid_walk(spec, block_sizes)
    nq, nk, steps = walk.num_q_blocks, walk.num_kv_blocks, walk.steps
    if annotate is None:
        annotate = nq * max(steps, nk) <= 256
    fig, (ax_tiles, ax_steps) = plt.subplots(
        1, 2, figsize=(10.0, 4.8), gridspec_kw={"width_ratios": [nk, max(steps, nk / 2)]})

    tile_cmap = ListedColormap([TILE_COLOURS[k] for k in (EMPTY, PARTIAL, FULL)])
    ax_tiles.imshow(walk.tiles, cmap=tile_cmap, vmin=-0.5, vmax=2.5, interpolation="nearest", aspect="auto")
    counts = walk.counts
    ax_tiles.set_title(f"tiles (q block, kv block):\n{counts.total_computed} of {counts.unmasked_computed} "
                       f"computed ({100 * counts.computed_fraction:.1f}%)")
    ax_tiles.set_xlabel(f"kv block j ({walk.block_kv} keys)")
    ax_tiles.set_ylabel(f"q block i ({walk.block_q} queries)")

    category = np.where(walk.computed, np.where(walk.fetched, 0, 1), np.where(walk.fetched, 3, 2))
    step_cmap = ListedColormap([STEP_COLOURS[k] for k in ("fetch", "resident", "idle", "fetch_idle")])
    ax_steps.imshow(category, cmap=step_cmap, vmin=-0.5, vmax=3.5, interpolation="nearest", aspect="auto")
    ax_steps.set_title(f"grid steps (q block, kv step):\n{counts.total_fetched} of {counts.unmasked_fetched} "
                       f"K/V fetches ({100 * counts.fetched_fraction:.1f}%)")
    ax_steps.set_xlabel("kv step s (grid axis 3, 'arbitrary')")
    ax_steps.set_ylabel("q block i")
    for ax, cols in ((ax_tiles, nk), (ax_steps, steps)):
        ax.grid(False)
        ax.set_xticks(np.arange(-0.5, cols, 1), minor=True)
        ax.set_yticks(np.arange(-0.5, nq, 1), minor=True)
        ax.grid(which="minor", color="white", linewidth=0.6 if cols * nq <= 1024 else 0.0)
        ax.tick_params(which="minor", length=0)
    if annotate:
        for i in range(nq):
            for s in range(steps):
                colour = "white" if category[i, s] in (0, 3) else "black"
                ax_steps.text(s, i, str(walk.kv_index[i, s]), ha="center", va="center", fontsize=7,
                              color=colour)
    handles = [Patch(facecolor=TILE_COLOURS[code], edgecolor="#999999", label=TILE_LABELS[code])
               for code in (FULL, PARTIAL, EMPTY)]
    handles += [
        Patch(color=STEP_COLOURS["fetch"], label="step fetches a new kv block"),
        Patch(color=STEP_COLOURS["resident"], label="step reuses the resident block"),
        Patch(facecolor=STEP_COLOURS["idle"], edgecolor="#999999", label="idle step (no DMA)")]
    if (category == 3).any():
        handles.append(Patch(color=STEP_COLOURS["fetch_idle"], label="fetch, no compute"))
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    if title is None:
        title = (f"Forward grid, q_len={spec.q_len}, kv_len={spec.kv_len}, {describe_mask(spec)}, "
                 f"blocks {walk.block_q}x{walk.block_kv}\n"
                 "(schedule of tpuattn.pallas; modelled, not measured)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


def grid_widget(q_len: int = 1024, kv_len: int = 1024, block_q: int = 128, block_kv: int = 128,
                causal: bool = True, window: int | None = None, max_len: int = 4096):
    """Sliders that redraw :func:`draw_grid`; returns an ipywidgets ``VBox`` (display it).

    The figure is a PNG in an ``Image`` widget whose ``value`` each redraw replaces: a widget state
    update, with no output capture. (An ``Output`` widget with ``clear_output(wait=True)`` and
    ``display(fig)`` inside it routes the figure through the frontend's output hooks; under papermill
    that stalled a headless run of notebook 03 for the whole 300 s cell timeout, twice, when other
    notebooks ran beside it.) A block size the kernel rejects shows its reason in an ``HTML`` line.

    Uses only widgets and calls present in ipywidgets 7.7.1 (Colab) and 8.x: ``IntSlider``,
    ``SelectionSlider``, ``Checkbox``, ``Image``, ``HTML``, ``HBox``/``VBox`` and ``observe``.
    """
    import html
    import io

    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    style = {"description_width": "initial"}
    lengths = dict(min=128, max=max_len, step=128, continuous_update=False, style=style)
    w_q_len = widgets.IntSlider(value=q_len, description="q_len", **lengths)
    w_kv_len = widgets.IntSlider(value=kv_len, description="kv_len", **lengths)
    w_block_q = widgets.SelectionSlider(options=[64, 128, 256, 512], value=block_q, description="block_q",
                                        continuous_update=False, style=style)
    w_block_kv = widgets.SelectionSlider(options=[128, 256, 512], value=block_kv, description="block_kv",
                                         continuous_update=False, style=style)
    w_causal = widgets.Checkbox(value=causal, description="causal")
    w_use_window = widgets.Checkbox(value=window is not None, description="window")
    w_window = widgets.IntSlider(value=window if window is not None else 256, min=0, max=max_len, step=64,
                                 description="window (left)", continuous_update=False, style=style)
    picture = widgets.Image(format="png")
    message = widgets.HTML(value="")

    def redraw(_change=None):
        spec = spec_for(w_q_len.value, w_kv_len.value, causal=w_causal.value,
                        window=(w_window.value, None) if w_use_window.value else None)
        try:
            fig = draw_grid(spec, (w_block_q.value, w_block_kv.value))
        except ValueError as error:  # e.g. a block size the kernel rejects
            message.value = f"<b>cannot draw:</b> {html.escape(str(error))}"
            return
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", bbox_inches="tight")
        plt.close(fig)
        message.value = ""
        picture.value = buffer.getvalue()

    controls = (w_q_len, w_kv_len, w_block_q, w_block_kv, w_causal, w_use_window, w_window)
    for control in controls:
        control.observe(redraw, names="value")
    redraw()
    return widgets.VBox([widgets.HBox([w_q_len, w_kv_len, w_block_q, w_block_kv]),
                         widgets.HBox([w_causal, w_use_window, w_window]), message, picture])
