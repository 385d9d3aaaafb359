"""Pictures and byte counts of the Pallas kernel's block schedule (notebook 03).

Everything here reads the schedule the kernel itself runs (:mod:`tpuattn.pallas.schedule`):
the same ``build_schedule`` arrays, the same BlockSpec index maps, walked over the same grid.
Nothing re-derives which tiles a mask hides.

* :func:`grid_walk` -- the forward grid ``(q block, kv step)`` as the pipeline visits it:
  which kv block each step names, whether it computes, whether it issues a DMA;
* :func:`draw_grid` -- that walk drawn with matplotlib (two panels: tiles and grid steps);
* :func:`hbm_traffic` -- bytes the forward pass moves between HBM and VMEM under the
  schedule, against the minimum (Q, K, V read once, O written once);
* :func:`grid_widget` -- sliders (block sizes, lengths, window, causal) that redraw the grid.

matplotlib and ipywidgets are imported inside the functions that need them, so the counting
functions work with numpy alone (the unit tests run them on JAX 0.7.2 without matplotlib).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tpuattn.api import AttentionSpec
from tpuattn.pallas import plan as _schedule
from tpuattn.pallas.blocks import LANES, ForwardBlocks, as_block_sizes
from tpuattn.spec import MaskSpec

# Tile / step categories used by the drawing (and returned by grid_walk).
SKIPPED, MASKED, FULL_TILE = 0, 1, 2
_TILE_COLOURS = {SKIPPED: "#eeeeee", MASKED: "#f4a259", FULL_TILE: "#3d7ab8"}
_STEP_COLOURS = {"fetch": "#6a4c93", "resident": "#8cc084", "idle": "#ffffff", "fetch_idle": "#d9534f"}


# --------------------------------------------------------------------------- specs
def spec_for(q_len: int, kv_len: int | None = None, *, causal: bool = False, window=None, batch: int = 1,
             num_q_heads: int = 1, num_kv_heads: int = 1, head_dim: int = 128, dtype="bfloat16",
             softcap: float | None = None) -> AttentionSpec:
    """An :class:`~tpuattn.AttentionSpec` from sizes alone (no arrays), for counting and drawing.

    ``window`` as in :func:`tpuattn.attention`: an int ``w`` means ``(w, w)``.
    """
    import jax.numpy as jnp

    kv_len = q_len if kv_len is None else kv_len
    for name, n in (("q_len", q_len), ("kv_len", kv_len), ("batch", batch), ("num_q_heads", num_q_heads),
                    ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
            raise ValueError(f"{name}: expected a positive int, got {n!r}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads: expected a multiple of num_kv_heads={num_kv_heads}, "
                         f"got {num_q_heads}")
    if isinstance(window, int | np.integer) and not isinstance(window, bool):
        window = (int(window), int(window))
    if window is not None:
        window = tuple(window)
    mask = MaskSpec(q_len=int(q_len), kv_len=int(kv_len), causal=bool(causal), window=window)
    return AttentionSpec(batch=int(batch), q_len=int(q_len), kv_len=int(kv_len), num_q_heads=int(num_q_heads),
                         num_kv_heads=int(num_kv_heads), head_dim=int(head_dim), dtype=jnp.dtype(dtype),
                         scale=float(head_dim) ** -0.5, softcap=softcap, mask=mask)


def _forward_blocks(spec: AttentionSpec, block_sizes) -> ForwardBlocks:
    """The forward blocks the kernel uses for ``spec`` (``block_sizes`` as the kernel option,
    or a ``(block_q, block_kv)`` pair), clamped to the sequences as the kernel clamps them."""
    if isinstance(block_sizes, tuple) and len(block_sizes) == 2:
        block_sizes = ForwardBlocks(*block_sizes)
    blocks = as_block_sizes(block_sizes, spec.head_dim, spec.dtype)
    return blocks.forward.clamp(spec.q_len, spec.kv_len)


def _normalise_block_sizes(block_sizes):
    if isinstance(block_sizes, tuple) and len(block_sizes) == 2:
        return ForwardBlocks(*block_sizes)
    return block_sizes


# --------------------------------------------------------------------------- the walk
@dataclasses.dataclass(frozen=True)
class GridWalk:
    """The forward grid of one (batch, head) as the pipeline visits it.

    ``kv_index[i, s]``: kv block named by the K/V index map at grid step ``(i, s)``;
    ``computed[i, s]``: the kernel body runs (``s < count[i]``);
    ``fetched[i, s]``: the block index differs from the previous grid step's, so a DMA is issued;
    ``tiles[i, j]``: SKIPPED, MASKED (computed with the element mask) or FULL_TILE (no mask needed).
    ``counts`` is :func:`tpuattn.pallas.schedule.kv_schedule`'s answer for the whole problem.
    """

    spec: AttentionSpec
    block_q: int
    block_kv: int
    kv_index: np.ndarray
    computed: np.ndarray
    fetched: np.ndarray
    tiles: np.ndarray
    counts: _schedule.ScheduleCounts

    @property
    def num_q_blocks(self) -> int:
        return self.tiles.shape[0]

    @property
    def num_kv_blocks(self) -> int:
        return self.tiles.shape[1]

    @property
    def steps(self) -> int:
        return self.kv_index.shape[1]


def grid_walk(spec: AttentionSpec, block_sizes=None) -> GridWalk:
    """Walk the forward grid of one (batch, head) with the kernel's schedule and index maps.

    Position masks only (causal, window, lengths); segment ids are data and are not drawn.
    The per-step arrays are checked against :func:`~tpuattn.pallas.schedule.kv_schedule`'s
    counts for the same problem, so the picture and the counts cannot disagree.
    """
    if spec.has_segments:
        raise ValueError("spec: expected a position-only mask (segment ids are data; not drawn), "
                         "got has_segments=True")
    block_sizes = _normalise_block_sizes(block_sizes)
    fb = _forward_blocks(spec, block_sizes)
    bq, bk = fb.block_q, fb.block_kv
    tq, tk = -(-spec.q_len // bq) * bq, -(-spec.kv_len // bk) * bk
    sched = _schedule.build_schedule(_schedule.position_map(spec.mask, bq, bk, tq, tk))
    prefetch = tuple(np.asarray(a) for a in sched.arrays())
    maps = _schedule.forward_index_maps(sched, 1)
    grid = (1, 1, sched.num_outer, sched.steps)
    fetched = _schedule.walk_grid(maps["kv"], grid, prefetch)[0, 0]
    index = prefetch[0].reshape(sched.num_outer, sched.steps)
    count = prefetch[2].reshape(sched.num_outer)
    computed = np.arange(sched.steps)[None, :] < count[:, None]
    one = dataclasses.replace(spec, batch=1, num_q_heads=1, num_kv_heads=1)
    counts = _schedule.kv_schedule(one, fb)  # a ForwardBlocks pins the forward blocks
    if counts.total_computed != int(computed.sum()) or counts.total_fetched != int(fetched.sum()):
        raise RuntimeError(  # pragma: no cover - a drift between this module and the schedule
            f"grid_walk: the walk (computed {int(computed.sum())}, fetched {int(fetched.sum())}) disagrees "
            f"with kv_schedule (computed {counts.total_computed}, fetched {counts.total_fetched})")
    tiles = np.asarray(counts.visit_map[0], np.int8)
    return GridWalk(spec=spec, block_q=bq, block_kv=bk, kv_index=index, computed=computed, fetched=fetched,
                    tiles=tiles, counts=counts)


# --------------------------------------------------------------------------- HBM bytes
@dataclasses.dataclass(frozen=True)
class HbmTraffic:
    """Bytes the forward kernel moves between HBM and VMEM, by operand (a model; see hbm_traffic)."""

    block_q: int
    block_kv: int
    q_read: int
    k_read: int
    v_read: int
    o_written: int
    lse_written: int
    segments_read: int
    minimum: int
    kv_blocks_computed: int
    kv_blocks_fetched: int
    unmasked_kv_blocks: int
    unmasked_kv_fetched: int
    unmasked_total: int

    @property
    def total(self) -> int:
        return (self.q_read + self.k_read + self.v_read + self.o_written + self.lse_written
                + self.segments_read)

    @property
    def ratio(self) -> float:
        """``total / minimum``: how many times the unavoidable traffic the schedule moves."""
        return self.total / self.minimum

    @property
    def computed_fraction(self) -> float:
        return self.kv_blocks_computed / self.unmasked_kv_blocks

    @property
    def fetched_fraction(self) -> float:
        return self.kv_blocks_fetched / self.unmasked_kv_fetched

    def as_row(self) -> dict:
        mib = 1024 * 1024
        return {"block": f"{self.block_q}x{self.block_kv}",
                "kv computed": f"{self.kv_blocks_computed}/{self.unmasked_kv_blocks} "
                               f"({100 * self.computed_fraction:.1f}%)",
                "kv fetched": f"{self.kv_blocks_fetched}/{self.unmasked_kv_fetched} "
                              f"({100 * self.fetched_fraction:.1f}%)",
                "Q MiB": self.q_read / mib, "K+V MiB": (self.k_read + self.v_read) / mib,
                "O MiB": self.o_written / mib, "lse MiB": self.lse_written / mib,
                "total MiB": self.total / mib, "minimum MiB": self.minimum / mib,
                "x minimum": self.ratio, "unmasked x minimum": self.unmasked_total / self.minimum}


def hbm_traffic(spec: AttentionSpec, block_sizes=None, *, segment_ids=None,
                lse_lanes: int = LANES) -> HbmTraffic:
    """Count the HBM bytes the forward kernel's block schedule moves.

    The model (the forward pass only; every array in the kernel's padded layout
    ``[batch, heads, seq_padded, head_dim_padded]``, head_dim padded to 128 lanes):

    * **Q**: each query block is read once per (batch, query head): its index map ignores the
      kv step, so consecutive steps name the same block and the pipeline does not re-fetch it;
    * **K, V**: one ``block_kv x head_dim`` block each time the K/V index map names a block
      different from the previous grid step's -- exactly :func:`kv_schedule`'s ``fetched``
      count. K/V are re-read for every query block (and every query head of a GQA group);
      skipped steps name the resident block and cost nothing;
    * **O**: written once, ``[batch, q_heads, q_len_padded, head_dim_padded]``;
    * **lse**: the float32 logsumexp saved for the backward pass, stored as one ``lse_lanes``
      = 128-lane row per query (the kernel's layout; lanes 0 and 1 hold ``m`` and ``log l``);
    * **segment ids** (if any): a ``block_q x 128`` int32 column per query block and an
      ``8 x block_kv`` int32 row per K/V fetch;
    * **minimum**: Q, K, V read once and O written once at their unpadded sizes.

    Not counted: the scalar-prefetch schedule (a few KiB of SMEM), VMEM-to-register traffic,
    the wrapper's padding/transposes (XLA ops outside the kernel).
    """
    block_sizes = _normalise_block_sizes(block_sizes)
    counts = _schedule.kv_schedule(spec, block_sizes, segment_ids=segment_ids)
    bq, bk = counts.block_q, counts.block_kv
    itemsize = np.dtype(spec.dtype).itemsize
    d = -(-spec.head_dim // LANES) * LANES
    tq = counts.num_q_blocks * bq
    b, hq, hkv = spec.batch, spec.num_q_heads, spec.num_kv_heads
    q_read = b * hq * tq * d * itemsize
    o_written = q_read
    lse_written = b * hq * tq * lse_lanes * 4
    kv_block_bytes = bk * d * itemsize

    def segment_bytes(fetches: int) -> int:
        if not spec.has_segments:
            return 0
        return b * hq * counts.num_q_blocks * bq * LANES * 4 + fetches * 8 * bk * 4

    k_read = v_read = counts.total_fetched * kv_block_bytes
    minimum = (2 * b * hq * spec.q_len + 2 * b * hkv * spec.kv_len) * spec.head_dim * itemsize
    unmasked_total = (q_read + o_written + lse_written + 2 * counts.unmasked_fetched * kv_block_bytes
                      + segment_bytes(counts.unmasked_fetched))
    return HbmTraffic(block_q=bq, block_kv=bk, q_read=q_read, k_read=k_read, v_read=v_read,
                      o_written=o_written, lse_written=lse_written,
                      segments_read=segment_bytes(counts.total_fetched), minimum=minimum,
                      kv_blocks_computed=counts.total_computed, kv_blocks_fetched=counts.total_fetched,
                      unmasked_kv_blocks=counts.unmasked_computed,
                      unmasked_kv_fetched=counts.unmasked_fetched, unmasked_total=unmasked_total)


def format_table(rows: list[dict], *, floatfmt: str = ".2f") -> str:
    """A plain-text table of dicts with the same keys (no pandas needed)."""
    if not rows:
        return ""
    keys = list(rows[0])
    cells = [[k for k in keys]] + [[format(r[k], floatfmt) if isinstance(r[k], float) else str(r[k])
                                    for k in keys] for r in rows]
    widths = [max(len(row[c]) for row in cells) for c in range(len(keys))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# --------------------------------------------------------------------------- drawing
def describe_mask(spec: AttentionSpec) -> str:
    """``"causal, window (384, 0)"`` or ``"no mask"`` (position masks only)."""
    mask = spec.mask
    words = []
    if mask.causal:
        words.append("causal")
    if mask.window is not None:
        words.append(f"window {mask.window}")
    return ", ".join(words) or "no mask"


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

    tile_cmap = ListedColormap([_TILE_COLOURS[k] for k in (SKIPPED, MASKED, FULL_TILE)])
    ax_tiles.imshow(walk.tiles, cmap=tile_cmap, vmin=-0.5, vmax=2.5, interpolation="nearest", aspect="auto")
    counts = walk.counts
    ax_tiles.set_title(f"tiles (q block, kv block):\n{counts.total_computed} of {counts.unmasked_computed} "
                       f"computed ({100 * counts.computed_fraction:.1f}%)")
    ax_tiles.set_xlabel(f"kv block j ({walk.block_kv} keys)")
    ax_tiles.set_ylabel(f"q block i ({walk.block_q} queries)")

    category = np.where(walk.computed, np.where(walk.fetched, 0, 1), np.where(walk.fetched, 3, 2))
    step_cmap = ListedColormap([_STEP_COLOURS[k] for k in ("fetch", "resident", "idle", "fetch_idle")])
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
    handles = [Patch(color=_TILE_COLOURS[FULL_TILE], label="computed, no mask"),
               Patch(color=_TILE_COLOURS[MASKED], label="computed with mask"),
               Patch(facecolor=_TILE_COLOURS[SKIPPED], edgecolor="#999999", label="skipped"),
               Patch(color=_STEP_COLOURS["fetch"], label="step fetches a new kv block"),
               Patch(color=_STEP_COLOURS["resident"], label="step reuses the resident block"),
               Patch(facecolor=_STEP_COLOURS["idle"], edgecolor="#999999", label="idle step (no DMA)")]
    if (category == 3).any():
        handles.append(Patch(color=_STEP_COLOURS["fetch_idle"], label="fetch, no compute"))
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    if title is None:
        title = (f"Forward grid, q_len={spec.q_len}, kv_len={spec.kv_len}, {describe_mask(spec)}, "
                 f"blocks {walk.block_q}x{walk.block_kv}\n"
                 "(schedule of tpuattn.pallas; modelled, not measured)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


# --------------------------------------------------------------------------- widget
def grid_widget(q_len: int = 1024, kv_len: int = 1024, block_q: int = 128, block_kv: int = 128,
                causal: bool = True, window: int | None = None, max_len: int = 4096):
    """Sliders that redraw :func:`draw_grid`; returns an ipywidgets ``VBox`` (display it).

    Uses only widgets and calls present in ipywidgets 7.7.1 (Colab) and 8.x: ``IntSlider``,
    ``SelectionSlider``, ``Checkbox``, ``Output``, ``HBox``/``VBox`` and ``observe``.
    """
    import ipywidgets as widgets
    import matplotlib.pyplot as plt
    from IPython.display import clear_output, display

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
    out = widgets.Output()

    def redraw(_change=None):
        spec = spec_for(w_q_len.value, w_kv_len.value, causal=w_causal.value,
                        window=(w_window.value, None) if w_use_window.value else None)
        with out:
            clear_output(wait=True)
            try:
                fig = draw_grid(spec, (w_block_q.value, w_block_kv.value))
            except ValueError as error:  # e.g. a block size the kernel rejects
                print(f"cannot draw: {error}")
                return
            display(fig)
            plt.close(fig)

    controls = (w_q_len, w_kv_len, w_block_q, w_block_kv, w_causal, w_use_window, w_window)
    for control in controls:
        control.observe(redraw, names="value")
    redraw()
    return widgets.VBox([widgets.HBox([w_q_len, w_kv_len, w_block_q, w_block_kv]),
                         widgets.HBox([w_causal, w_use_window, w_window]), out])


__all__ = ["FULL_TILE", "MASKED", "SKIPPED", "GridWalk", "HbmTraffic", "describe_mask", "draw_grid",
           "format_table", "grid_walk", "grid_widget", "hbm_traffic", "spec_for"]
