"""Counts of the Pallas kernel's block schedule: the tiles it computes and fetches, the grid walk, the
HBM bytes it moves and the matmuls per tile (the package's one counting module).

Everything here reads the schedule the kernel itself runs (:mod:`tpuattn.pallas.plan`): the same
``plan.schedule`` (its tables, or its rule evaluated), the same BlockSpec index maps, walked over the
same grid. Nothing re-derives which tiles a mask hides. (Pictures of it: :mod:`tpuattn.viz.grid`.)

* :func:`kv_schedule` -> :class:`ScheduleCounts` -- blocks computed and fetched per pass (forward,
  dQ, dK/dV), from the schedule and index maps the kernel runs (:func:`walk_grid` evaluates a map);
* :func:`matmuls_per_step` -- matmuls per visible tile of every kernel in a function, read from the
  kernels' jaxprs (nothing runs);
* :func:`grid_walk` -- the forward grid ``(q block, kv step)`` as the pipeline visits it:
  which kv block each step names, whether it computes, whether it issues a DMA;
* :func:`hbm_traffic` -- bytes the forward pass moves between HBM and VMEM under the
  schedule, against the minimum (Q, K, V read once, O written once).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np

from tpuattn._checks import round_up
from tpuattn.pallas import plan
from tpuattn.pallas.blocks import ForwardBlocks, blocks_for_spec
from tpuattn.pallas.layout import LANES, STAT_ROWS, Layout, padded_segment_ids
from tpuattn.spec import EMPTY, FULL, PARTIAL, AttentionSpec, spec_from_shapes

__all__ = ["GridWalk", "HbmTraffic", "ScheduleCounts", "describe_mask", "format_table", "grid_walk",
           "hbm_traffic", "kv_schedule", "matmuls_per_step", "spec_for", "walk_grid"]


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


# --------------------------------------------------------------------------- the schedule's counts
@dataclasses.dataclass(frozen=True)
class ScheduleCounts:
    """Blocks a pass computes and fetches, counted from the kernel's own schedule and index maps.

    ``computed`` counts score tiles, one per query head: ``[batch, num_q_heads, num_q_blocks]``
    (forward/dQ) or per kv block ``[batch, num_kv_heads, num_kv_blocks]`` (dK/dV, summed over the
    group). ``fetched`` counts the grid steps at which the streamed operand's block index differs
    from the previous step's (the pipeline issues a DMA exactly then), per head block of the grid:
    ``[batch, num_q_heads // q_heads, num_q_blocks]`` (forward/dQ: one K/V fetch serves the
    ``q_heads`` query heads of a step) or ``[batch, num_kv_heads, num_kv_blocks]`` (dK/dV).
    ``grid`` is the pass's grid; ``unmasked_*`` are the same counts for the same grid shape with no
    mask.
    """

    pass_name: str
    block_q: int
    block_kv: int
    q_heads: int  # query heads one grid step serves
    grid: tuple[int, ...]
    num_q_blocks: int
    num_kv_blocks: int
    steps: int
    computed: np.ndarray
    fetched: np.ndarray
    unmasked_computed: int
    unmasked_fetched: int
    visit_map: np.ndarray  # [batch rows, num_outer, num_inner] tile codes: EMPTY, PARTIAL or FULL

    @property
    def total_computed(self) -> int:
        return int(self.computed.sum())

    @property
    def total_fetched(self) -> int:
        return int(self.fetched.sum())

    @property
    def grid_steps(self) -> int:
        """Steps of the pass's grid (each one pipeline iteration, computing or idle)."""
        return int(np.prod(self.grid))

    @property
    def computed_fraction(self) -> float:
        return self.total_computed / self.unmasked_computed

    @property
    def fetched_fraction(self) -> float:
        return self.total_fetched / self.unmasked_fetched


def walk_grid(index_map, grid, prefetch) -> np.ndarray:
    """Evaluate ``index_map`` over ``grid`` in the pipeline's (row-major) order.

    Returns a bool array of the grid's shape: True where the block index differs from the
    previous grid step's (a DMA is issued; the very first step always fetches).
    """
    fetch = np.zeros(grid, bool)
    previous = None
    for point in np.ndindex(*grid):
        block = tuple(int(x) for x in index_map(*point, *prefetch))
        fetch[point] = block != previous
        previous = block
    return fetch


def _pass_schedule(spec, pass_name, blocks, segment_ids):
    if pass_name == "forward":
        fb = blocks.forward.clamp(spec.q_len, spec.kv_len)
    elif pass_name in ("dq", "dkv"):
        fb = blocks.backward.clamp(spec.q_len, spec.kv_len)
    else:
        raise ValueError(f"pass_name: expected 'forward', 'dq' or 'dkv', got {pass_name!r}")
    bq, bk = fb.block_q, fb.block_kv
    tq, tk = round_up(spec.q_len, bq), round_up(spec.kv_len, bk)
    transpose = pass_name == "dkv"
    overlap = None
    if segment_ids is not None:
        q_seg, kv_seg = padded_segment_ids([jnp.asarray(s, jnp.int32) for s in segment_ids], bq, bk)
        overlap = plan.segment_overlap(q_seg, kv_seg, bq, bk, transpose=transpose)
    sched = plan.schedule(spec.mask, bq, bk, tq, tk, overlap, transpose=transpose)
    return sched, bq, bk, tq // bq, tk // bk


def kv_schedule(spec, block_sizes=None, segment_ids=None, pass_name: str = "forward") -> ScheduleCounts:
    """Count the blocks a pass computes and fetches, from the schedule and index maps it runs.

    Args:
      spec: an :class:`tpuattn.AttentionSpec` (e.g. from ``tpuattn.make_spec``).
      block_sizes: as the ``block_sizes`` option of ``impl="pallas"`` (None = defaults).
      segment_ids: ``(q_segment_ids, kv_segment_ids)`` when ``spec.has_segments``.
      pass_name: ``"forward"`` (K/V blocks per q block), ``"dq"`` (same, backward blocks) or
        ``"dkv"`` (q blocks per kv block).
    """
    if spec.has_segments and segment_ids is None:
        raise ValueError(
            "segment_ids: expected (q_segment_ids, kv_segment_ids) for a spec with segments, got None")
    blocks = blocks_for_spec(block_sizes, spec)
    sched, bq, bk, nq, nk = _pass_schedule(spec, pass_name, blocks, segment_ids)
    prefetch = sched.tables()
    count = prefetch[2].reshape(-1, sched.num_outer)
    rows = count.shape[0]
    index = prefetch[0].reshape(rows, sched.num_outer, sched.steps)
    needs = prefetch[1].reshape(rows, sched.num_outer, sched.steps)
    visit = np.full((rows, sched.num_outer, sched.num_inner), EMPTY, np.int8)
    for r, o, s in np.ndindex(rows, sched.num_outer, sched.steps):
        if s < count[r, o]:
            visit[r, o, index[r, o, s]] = PARTIAL if needs[r, o, s] else FULL
    _, group, units = plan.head_units(spec)
    if pass_name == "dkv":
        q_heads, heads = plan.q_heads_per_step(spec, "dkv", bq, bk), units
        maps = lambda s: plan.dkv_index_maps(s, group, q_heads)["q"]
        grid = (spec.batch, heads, sched.num_outer, group // q_heads, sched.steps)
        inner_per_outer = group * sched.num_inner
    else:
        q_heads = plan.q_heads_per_step(spec, "forward" if pass_name == "forward" else "dq", bq, bk)
        heads = spec.num_q_heads // q_heads  # head blocks
        maps = lambda s: plan.forward_index_maps(s, group, q_heads)["kv"]
        grid = (spec.batch, heads, sched.num_outer, sched.steps)
        inner_per_outer = q_heads * sched.num_inner
    fetch = walk_grid(maps(sched), grid, prefetch)
    fetched = fetch.reshape(spec.batch, heads, sched.num_outer, -1).sum(-1)
    per_row = count[[sched.row(b) for b in range(spec.batch)]]  # [batch, num_outer]
    tile_heads = spec.num_q_heads if pass_name != "dkv" else heads
    computed = np.broadcast_to(per_row[:, None, :], (spec.batch, tile_heads, sched.num_outer))
    if pass_name == "dkv":
        computed = computed * group
    unmasked = plan.build_schedule(np.full((sched.num_outer, sched.num_inner), FULL, np.int8))
    unmasked_grid = grid[:-1] + (unmasked.steps,)
    unmasked_fetched = int(walk_grid(maps(unmasked), unmasked_grid,
                                     tuple(np.asarray(a) for a in unmasked.arrays())).sum())
    return ScheduleCounts(
        pass_name=pass_name, block_q=bq, block_kv=bk, q_heads=q_heads, grid=grid, num_q_blocks=nq,
        num_kv_blocks=nk, steps=sched.steps, computed=np.array(computed), fetched=fetched,
        unmasked_computed=spec.batch * heads * sched.num_outer * inner_per_outer,
        unmasked_fetched=unmasked_fetched, visit_map=visit)


# --------------------------------------------------------------------------- matmuls per tile
def _sub_jaxprs(value):
    """The jaxprs held by one equation parameter (a Jaxpr, a ClosedJaxpr, or a sequence of them)."""
    if isinstance(value, jax_core.ClosedJaxpr):
        return [value.jaxpr]
    if isinstance(value, jax_core.Jaxpr):
        return [value]
    if isinstance(value, tuple | list):
        return [j for item in value for j in _sub_jaxprs(item)]
    return []


def _step_matmuls(jaxpr) -> int:
    """``dot_general`` equations one grid step runs in a kernel body ``jaxpr``.

    The kernels' ``pl.when`` blocks (``cond``) are alternatives: initialise, the masked tile, the
    unmasked tile (:func:`tpuattn.pallas.plan.scheduled_step` guards these two with exclusive
    conditions), finish. A step that computes a tile runs one of the two tile blocks, so the blocks that
    hold matmuls must hold the same number, which counts once; a ``cond`` with two live branches counts
    its costliest. A step serving several query heads loops over them
    (:func:`tpuattn.pallas.plan.head_loop`, a ``scan``, the only loop a kernel may hold): its body is one
    head's tile and counts once, so the count is per tile whatever the heads per step."""
    outside, alternatives = 0, set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            outside += 1
        elif eqn.primitive.name == "cond":
            n = max(_step_matmuls(branch) for branch in _sub_jaxprs(eqn.params["branches"]))
            if n:
                alternatives.add(n)
        elif eqn.primitive.name == "scan":  # the kernels' one loop: over a step's query heads
            outside += _step_matmuls(eqn.params["jaxpr"].jaxpr)
        elif eqn.primitive.name == "while":
            raise NotImplementedError(f"a loop ({eqn.primitive.name}) inside a kernel: count it by hand")
        else:
            outside += sum(_step_matmuls(sub) for value in eqn.params.values() for sub in _sub_jaxprs(value))
    if len(alternatives) > 1:
        raise ValueError(f"pl.when blocks with different matmul counts {sorted(alternatives)}: "
                         "not the masked/unmasked alternatives of one tile")
    return outside + max(alternatives, default=0)


def _kernel_name(params) -> str:
    name = params.get("name")  # JAX 0.10; 0.7 keeps pallas_call's name= in the kernel's debug info
    return name if isinstance(name, str) else params["jaxpr"].debug_info.func_name


def matmuls_per_step(fn, *args) -> dict[str, int]:
    """Matmuls per computed grid step (one visible tile) of every ``pallas_call`` in ``fn(*args)``:
    ``{kernel name: dot_general count}``, read from each kernel's own jaxpr (:func:`jax.make_jaxpr`,
    so nothing runs). A kernel called more than once must count the same each time."""
    counts: dict[str, int] = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                name, n = _kernel_name(eqn.params), _step_matmuls(eqn.params["jaxpr"])
                if counts.setdefault(name, n) != n:
                    raise AssertionError(f"kernel {name}: {counts[name]} and {n} matmuls in two calls")
                continue
            for value in eqn.params.values():
                for sub in _sub_jaxprs(value):
                    walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return counts


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
    ``counts`` is :func:`tpuattn.pallas.kv_schedule`'s answer for the whole problem.
    """

    spec: AttentionSpec
    block_q: int
    block_kv: int
    kv_index: np.ndarray
    computed: np.ndarray
    fetched: np.ndarray
    tiles: np.ndarray
    counts: ScheduleCounts

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
    The per-step arrays are checked against :func:`~tpuattn.pallas.kv_schedule`'s
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
    fetched = walk_grid(maps["kv"], grid, prefetch)[0, 0]
    index = prefetch[0].reshape(sched.num_outer, sched.steps)
    count = prefetch[2].reshape(sched.num_outer)
    computed = np.arange(sched.steps)[None, :] < count[:, None]
    one = dataclasses.replace(spec, batch=1, num_q_heads=1, num_kv_heads=1)
    counts = kv_schedule(one, fb)  # a ForwardBlocks pins the forward blocks
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
    counts = kv_schedule(spec, _block_sizes(block_sizes), segment_ids=segment_ids)
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
