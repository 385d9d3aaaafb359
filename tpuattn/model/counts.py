"""Counts of the Pallas kernel's block schedule: the grid walk and the HBM bytes it moves.

Everything here reads the schedule the kernel itself runs (:mod:`tpuattn.pallas.plan`): the same
``plan.schedule`` (its tables, or its rule evaluated), the same BlockSpec index maps, walked over the
same grid. Nothing re-derives which tiles a mask hides. (Pictures of it: :mod:`tpuattn.viz.grid`.)

* :func:`grid_walk` -- the forward grid ``(q block, kv step)`` as the pipeline visits it:
  which kv block each step names, whether it computes, whether it issues a DMA;
* :func:`hbm_traffic` -- bytes the forward pass moves between HBM and VMEM under the
  schedule, against the minimum (Q, K, V read once, O written once).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tpuattn._checks import round_up
from tpuattn.pallas import plan
from tpuattn.pallas.blocks import ForwardBlocks, blocks_for_spec
from tpuattn.pallas.layout import LANES, STAT_ROWS, Layout
from tpuattn.spec import AttentionSpec, spec_from_shapes

__all__ = ["GridWalk", "HbmTraffic", "describe_mask", "format_table", "grid_walk", "hbm_traffic", "spec_for"]


def spec_for(q_len: int, kv_len: int | None = None, *, causal: bool = False, window=None, batch: int = 1,
             num_q_heads: int = 1, num_kv_heads: int = 1, head_dim: int = 128, dtype="bfloat16",
             softcap: float | None = None) -> AttentionSpec:
    """:func:`tpuattn.spec.spec_from_shapes` with the defaults of the pictures (one bf16 head of 128)."""
    return spec_from_shapes(q_len, kv_len, batch=batch, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                            head_dim=head_dim, dtype=dtype, causal=causal, window=window, softcap=softcap)


def _block_sizes(block_sizes):
    """The kernel's ``block_sizes`` option, or a ``(block_q, block_kv)`` pair meaning forward blocks."""
    if isinstance(block_sizes, tuple) and len(block_sizes) == 2:
        return ForwardBlocks(*block_sizes)
    return block_sizes


# --------------------------------------------------------------------------- the walk
@dataclasses.dataclass(frozen=True)
class GridWalk:
    """The forward grid of one (batch, head block) as the pipeline visits it (a head block: the query
    heads of a GQA group one grid step serves, all on the same K/V blocks, so one walk draws them all).

    ``kv_index[i, s]``: kv block named by the K/V index map at grid step ``(i, s)``;
    ``computed[i, s]``: the kernel body runs (``s < count[i]``);
    ``fetched[i, s]``: the block index differs from the previous grid step's, so a DMA is issued;
    ``tiles[i, j]``: the tile codes of :mod:`tpuattn.spec`: EMPTY (skipped), PARTIAL (computed
    with the element mask) or FULL (no mask needed).
    ``counts`` is :func:`tpuattn.pallas.plan.kv_schedule`'s answer for the whole problem.
    """

    spec: AttentionSpec
    block_q: int
    block_kv: int
    kv_index: np.ndarray
    computed: np.ndarray
    fetched: np.ndarray
    tiles: np.ndarray
    counts: plan.ScheduleCounts

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
    """Walk the forward grid of one (batch, head block) with the kernel's schedule and index maps.

    Position masks only (causal, window, lengths); segment ids are data and are not drawn.
    The per-step arrays are checked against :func:`~tpuattn.pallas.plan.kv_schedule`'s
    counts for the same problem, so the picture and the counts cannot disagree.
    """
    if spec.has_segments:
        raise ValueError("spec: expected a position-only mask (segment ids are data; not drawn), "
                         "got has_segments=True")
    blocks = blocks_for_spec(_block_sizes(block_sizes), spec)
    fb = blocks.forward.clamp(spec.q_len, spec.kv_len)  # as the kernel clamps them
    bq, bk = fb.block_q, fb.block_kv
    tq, tk = round_up(spec.q_len, bq), round_up(spec.kv_len, bk)
    sched = plan.schedule(spec.mask, bq, bk, tq, tk)  # the kernel's own (positions only)
    prefetch = sched.tables()
    maps = plan.forward_index_maps(sched, 1)
    grid = (1, 1, sched.num_outer, sched.steps)
    fetched = plan.walk_grid(maps["kv"], grid, prefetch)[0, 0]
    index = prefetch[0].reshape(sched.num_outer, sched.steps)
    count = prefetch[2].reshape(sched.num_outer)
    computed = np.arange(sched.steps)[None, :] < count[:, None]
    one = dataclasses.replace(spec, batch=1, num_q_heads=1, num_kv_heads=1)
    counts = plan.kv_schedule(one, fb)  # a ForwardBlocks pins the forward blocks
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


def hbm_traffic(spec: AttentionSpec, block_sizes=None, *, segment_ids=None) -> HbmTraffic:
    """Count the HBM bytes the forward kernel's block schedule moves.

    The model (the forward pass only; every array as the kernel's layout holds it,
    :class:`tpuattn.pallas.layout.Layout`: the sequence padded to the blocks, head_dim padded to 128
    lanes unless it is a multiple of 128 or paired, two heads of 64 to a lane tile):

    * **Q**: each query block is read once per (batch, query head): its index map ignores the
      kv step, so consecutive steps name the same block and the pipeline does not re-fetch it;
    * **K, V**: one ``block_kv x head_dim`` block (with paired heads a kv head pair's
      ``block_kv x 128`` tile, serving both kv heads' query heads) each time the K/V index map names a block
      different from the previous grid step's -- exactly :func:`kv_schedule`'s ``fetched``
      count. K/V are re-read for every query block, and once per head block: a grid step serves
      the query heads of a GQA group (``counts.q_heads`` of them) with one K/V block, so a group
      reads its kv head's K/V once; skipped steps name the resident block and cost nothing;
    * **O**: written once, ``[batch, q_heads, q_len_padded, head_dim_padded]``;
    * **lse**: the float32 logsumexp saved for the backward pass, as the kernel writes it: a column
      of 8 sublanes per query (``[batch, heads, 8, seq]``, :data:`tpuattn.pallas.layout.STAT_ROWS`;
      rows 0 and 1 hold ``m`` and ``log l``), 32 bytes a query;
    * **segment ids** (if any): a ``block_q x 128`` int32 column per query block of a head block
      and an ``8 x block_kv`` int32 row per K/V fetch;
    * **minimum**: Q, K, V read once and O written once at their unpadded sizes.

    Not counted: the scalar-prefetch schedule (a few KiB of SMEM), VMEM-to-register traffic,
    the wrapper's padding/transposes (XLA ops outside the kernel).
    """
    counts = plan.kv_schedule(spec, _block_sizes(block_sizes), segment_ids=segment_ids)
    bq, bk = counts.block_q, counts.block_kv
    itemsize = np.dtype(spec.dtype).itemsize
    layout = Layout.for_spec(spec)
    d = layout.head_dim  # a head's lanes: padded to 128 heads first, 64 with paired heads
    tq = counts.num_q_blocks * bq
    b, hq, hkv = spec.batch, spec.num_q_heads, spec.num_kv_heads
    q_read = b * hq * tq * d * itemsize
    o_written = q_read
    lse_written = b * hq * tq * STAT_ROWS * 4
    kv_block_bytes = bk * layout.tile * itemsize  # one kv head's block, or a kv head pair's tile

    def segment_bytes(fetches: int) -> int:
        if not spec.has_segments:
            return 0
        head_blocks = hq // counts.q_heads  # the q segment column is read once per head block's q block
        return b * head_blocks * counts.num_q_blocks * bq * LANES * 4 + fetches * 8 * bk * 4

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


def describe_mask(spec: AttentionSpec) -> str:
    """``"causal, window (384, 0)"`` or ``"no mask"`` (position masks only)."""
    mask = spec.mask
    words = []
    if mask.causal:
        words.append("causal")
    if mask.window is not None:
        words.append(f"window {mask.window}")
    return ", ".join(words) or "no mask"
