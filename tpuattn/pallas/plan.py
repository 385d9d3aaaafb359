"""The block schedule: which key/value blocks each query block visits, and in what order.

A kernel's grid has a fixed number of steps along its reduction axis, but a mask hides
whole tiles. For every outer block (a query block in the forward and dQ passes, a key/value
block in the dK/dV pass) the schedule lists the inner blocks that may hold a visible score,
in increasing order, then pads the list to the grid length by repeating its last entry:

    causal, 4 x 4 blocks           index (step ->)      count   needs_mask
    q block 0: kv 0                 0 0 0 0              1       1 . . .
    q block 1: kv 0 1               0 1 1 1              2       0 1 . .
    q block 2: kv 0 1 2             0 1 2 2              3       0 0 1 .
    q block 3: kv 0 1 2 3           0 1 2 3              4       0 0 0 1

The arrays go to the kernel as scalar prefetch (SMEM). The BlockSpec index maps read
``index`` so a padded step names the block already resident in VMEM -- the pipeline only
issues a DMA when the block index changes, so nothing is fetched -- and the kernel body
runs under ``pl.when(step < count)`` so nothing is computed. ``needs_mask`` is 0 for tiles
every row sees entirely (no iota/compare/select needed). The grid length is the largest
count, so a sliding window also shortens the grid itself.

Positions alone need no arrays at all: the visited blocks of an outer block are a contiguous range
and a FULL tile is an interval test, so :class:`IntervalRule` computes ``index``, ``needs_mask`` and
``count`` from the block indices inside the index maps and the kernel (:func:`schedule` picks it), and
the tables above are what its arithmetic evaluates to (``MaskSpec.block_map`` gives the same at trace
time; a test holds the two equal). Tables of (queries / block) x (keys / block) entries would not fit
SMEM at half a million tokens. Segment ids are data:
the per-block minimum and maximum segment id are computed in JAX before the kernel and a
tile is kept only if the query block's [min, max] range meets the key block's; the grid
length stays the position-only one and the schedule arrays become per-batch.

This module holds only what the kernels run. The counts of what they compute and fetch
(:func:`tpuattn.model.counts.kv_schedule`) evaluate these same functions and index maps over the
grid, and :func:`tpuattn.model.counts.matmuls_per_step` reads the kernels' jaxprs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from tpuattn import chips
from tpuattn.pallas import compat
from tpuattn.pallas.blocks import (
    backward_vmem_bytes,
    dq_vmem_bytes,
    fit_q_heads,
    forward_vmem_bytes,
    vmem_limit_bytes,
)
from tpuattn.pallas.layout import Layout, padded_head_dim
from tpuattn.sharding import varying_axes
from tpuattn.spec import EMPTY, FULL


# --------------------------------------------------------------------------- building
@dataclasses.dataclass(frozen=True)
class Schedule:
    """Scalar-prefetch arrays of one pass (flattened to 1-D for SMEM).

    ``index[(b * num_outer + o) * steps + s]``: inner block visited at step ``s`` of outer block
    ``o`` (batch row ``b``; ``b`` is always 0 unless ``per_batch``); ``needs_mask`` likewise;
    ``count[b * num_outer + o]``: how many steps compute.
    """

    index: jax.Array
    needs_mask: jax.Array
    count: jax.Array
    num_outer: int
    num_inner: int
    steps: int
    per_batch: bool
    rule: IntervalRule | None = None  # the tables as arithmetic (positions only): see IntervalRule

    def arrays(self):
        """What the kernel gets as scalar prefetch (one-element placeholders for a rule's schedule)."""
        return self.index, self.needs_mask, self.count

    def tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(index, needs_mask, count)`` as NumPy arrays, flattened as in SMEM (a rule's evaluated)."""
        if self.rule is None:
            return tuple(np.asarray(a) for a in self.arrays())
        return self.rule.tables(self.steps)

    def row(self, b):
        """The schedule row used by batch element ``b`` (a Python int or a traced program id)."""
        return b if self.per_batch else 0


def position_map(mask, block_q: int, block_kv: int, q_len_padded: int, kv_len_padded: int,
                 *, transpose: bool = False) -> np.ndarray:
    """``MaskSpec.block_map`` on the padded grid; transposed (kv-major) for the dK/dV pass."""
    bmap = mask.block_map(block_q, block_kv, q_len_padded, kv_len_padded)
    return bmap.T if transpose else bmap


def segment_overlap(q_segment_ids, kv_segment_ids, block_q: int, block_kv: int, *, transpose: bool = False):
    """Bool ``[batch, num_q_blocks, num_kv_blocks]``: may some row of the q block share a segment
    with some key of the kv block? Compares per-block [min, max] ranges (exact for sorted ids,
    conservative otherwise). Inputs are already padded to the block multiples (edge values)."""
    b = q_segment_ids.shape[0]
    qs = q_segment_ids.reshape(b, -1, block_q)
    ks = kv_segment_ids.reshape(b, -1, block_kv)
    q_lo, q_hi = qs.min(-1), qs.max(-1)
    k_lo, k_hi = ks.min(-1), ks.max(-1)
    overlap = (q_lo[:, :, None] <= k_hi[:, None, :]) & (k_lo[:, None, :] <= q_hi[:, :, None])
    return jnp.swapaxes(overlap, 1, 2) if transpose else overlap


def schedule_overlap(segs, block_q: int, block_kv: int, interpret, *, transpose: bool = False):
    """The segment overlap a pass's schedule skips by (:func:`segment_overlap`), or None (positions
    only: every tile is then masked by segment ids in the kernel, so the result is the same and only
    tiles of disjoint segments are computed rather than skipped).

    None for interpret mode inside ``shard_map`` when the ids vary over the mesh: JAX's interpreter
    reads the scalar-prefetch tables at grid indices that do not vary, and a table built from a
    device's own ids does (see :data:`tpuattn.pallas.compat.INTERPRETER_READS_VARYING_TABLES`). The
    compiled kernel keeps the skipping there too.
    """
    if segs is None:
        return None
    if interpret and not compat.INTERPRETER_READS_VARYING_TABLES and varying_axes(segs["q"], segs["kv"]):
        return None
    return segment_overlap(segs["q"], segs["kv"], block_q, block_kv, transpose=transpose)


def build_schedule(pos_map: np.ndarray, overlap=None) -> Schedule:
    """Compact each row of visible tiles to the front; pad with the last visited index.

    ``pos_map``: int8 ``[num_outer, num_inner]`` of EMPTY/PARTIAL/FULL (positions only, static);
    ``overlap``: optional bool ``[batch, num_outer, num_inner]`` (segments, traced).
    """
    num_outer, num_inner = pos_map.shape
    position_visible = pos_map != EMPTY
    steps = max(1, int(position_visible.sum(axis=1).max(initial=0)))
    visit = jnp.asarray(position_visible)[None]
    full = jnp.asarray(pos_map == FULL)[None]
    if overlap is not None:
        visit = visit & overlap
    rows = visit.shape[0]
    inner = jnp.arange(num_inner, dtype=jnp.int32)
    # Visible blocks first, in increasing order: sort keys j (visible) or num_inner + j (hidden).
    order = jnp.sort(jnp.where(visit, inner, num_inner + inner), axis=-1)[..., :steps] % num_inner
    count = visit.sum(-1).astype(jnp.int32)  # [rows, num_outer]
    last = jnp.take_along_axis(order, jnp.maximum(count - 1, 0)[..., None], axis=-1)[..., 0]
    # An outer block that visits nothing parks on the block the previous outer block ended
    # with (still resident), so it fetches nothing either.
    outer = jnp.arange(num_outer, dtype=jnp.int32)
    source = jax.lax.cummax(jnp.where(count > 0, outer[None], -1), axis=1)
    last = jnp.where(source >= 0, jnp.take_along_axis(last, jnp.maximum(source, 0), axis=1), 0)
    step = jnp.arange(steps, dtype=jnp.int32)
    index = jnp.where(step < count[..., None], order, last[..., None]).astype(jnp.int32)
    is_full = jnp.take_along_axis(jnp.broadcast_to(full, (rows, num_outer, num_inner)), index, axis=-1)
    needs_mask = jnp.where(is_full, 0, 1).astype(jnp.int32)
    return Schedule(index=index.reshape(-1), needs_mask=needs_mask.reshape(-1), count=count.reshape(-1),
                    num_outer=num_outer, num_inner=num_inner, steps=steps, per_batch=overlap is not None)


def _div(x, d: int, xp):
    """``x // d`` for ``x >= 0``: truncating ``lax.div`` on traced scalars (floor division lowers
    through ``sign`` in a kernel), ``//`` on NumPy arrays and Python ints."""
    if xp is np or isinstance(x, int | np.integer):
        return x // d
    return jax.lax.div(x, jnp.asarray(d, x.dtype))


@dataclasses.dataclass(frozen=True)
class IntervalRule:
    """A position-only schedule as arithmetic on the block indices, instead of tables in SMEM.

    The keys a query row sees form an interval that moves right with the row (``MaskSpec``: causal,
    windows, bottom-right alignment, a shift), so the inner blocks an outer block visits are a
    contiguous range ``[first, last]``, and a tile is FULL when every row of it sees every key of it.
    Both are a few integer operations on the block indices, so the index maps and the kernel body
    compute them from the grid position: no table grows with (queries / block) x (keys / block), which
    at 524,288 tokens overflowed SMEM. :meth:`tables` evaluates the same arithmetic with NumPy, so
    the counts (:func:`tpuattn.model.counts.kv_schedule`) and the tests see exactly what the kernel
    computes; they equal :func:`build_schedule`'s tables (``tests/test_pallas.py``).

    ``transpose``: the outer blocks are kv blocks (the dK/dV pass), the inner ones query blocks.
    """

    q_len: int
    kv_len: int
    offset: int
    left: int | None
    right: int | None
    block_q: int
    block_kv: int
    transpose: bool
    has_segments: bool
    num_outer: int
    num_inner: int
    first_outer: int  # the first outer block that visits something (num_outer if none does)
    park: int  # where an empty outer block after it parks: the last block the previous ones visited

    @classmethod
    def of(cls, mask, block_q: int, block_kv: int, q_len_padded: int, kv_len_padded: int, *,
           transpose: bool = False) -> IntervalRule:
        nq, nk = q_len_padded // block_q, kv_len_padded // block_kv
        rule = cls(q_len=mask.q_len, kv_len=mask.kv_len, offset=mask.offset, left=mask.left_reach,
                   right=mask.right_reach, block_q=block_q, block_kv=block_kv, transpose=transpose,
                   has_segments=mask.has_segments, num_outer=nk if transpose else nq,
                   num_inner=nq if transpose else nk, first_outer=0, park=0)
        _, last, count = np.broadcast_arrays(*rule.span(np.arange(rule.num_outer), np))
        visits = np.flatnonzero(count > 0)
        first_outer = int(visits[0]) if visits.size else rule.num_outer
        park = int(last[visits[-1]]) if visits.size else 0
        if visits.size and (visits[-1] - visits[0] + 1 != visits.size):
            raise AssertionError("outer blocks that visit something are not contiguous")  # monotone rows
        return dataclasses.replace(rule, first_outer=first_outer, park=park)

    def span(self, outer, xp):
        """``(first, last, count)`` of the inner blocks outer block ``outer`` visits."""
        mx, mn = xp.maximum, xp.minimum
        if not self.transpose:  # rows r0..r1 of q block `outer`; keys [lo, hi)
            r0 = outer * self.block_q
            r1 = mn(r0 + self.block_q, self.q_len) - 1
            lo = 0 if self.left is None else mx(r0 + self.offset - self.left, 0)
            hi = self.kv_len if self.right is None else mn(r1 + self.offset + self.right + 1, self.kv_len)
            visits = (r0 < self.q_len) & (lo < hi)
            first, last = _div(mx(lo, 0), self.block_kv, xp), _div(mx(hi - 1, 0), self.block_kv, xp)
        else:  # keys k0..k1 of kv block `outer`; the rows that see one of them: [lo, hi]
            k0 = outer * self.block_kv
            k1 = mn(k0 + self.block_kv, self.kv_len) - 1
            lo = 0 if self.right is None else mx(k0 - self.offset - self.right, 0)
            hi = self.q_len - 1 if self.left is None else mn(k1 + self.left - self.offset, self.q_len - 1)
            visits = (k0 < self.kv_len) & (lo <= hi)
            first, last = _div(mx(lo, 0), self.block_q, xp), _div(mx(hi, 0), self.block_q, xp)
        count = xp.where(visits, last - first + 1, 0)
        return first, last, count

    def full(self, outer, inner, xp):
        """Does every (valid) row of the tile see every key of it? (Never with segment ids.)"""
        i, j = (inner, outer) if self.transpose else (outer, inner)
        r0 = i * self.block_q
        r1 = xp.minimum(r0 + self.block_q, self.q_len) - 1
        lo = 0 if self.left is None else xp.maximum(r1 + self.offset - self.left, 0)
        hi = self.kv_len if self.right is None else xp.minimum(r0 + self.offset + self.right + 1, self.kv_len)
        whole = (lo <= j * self.block_kv) & ((j + 1) * self.block_kv <= hi)
        return whole & (not self.has_segments)

    def index(self, outer, step, xp):
        """The inner block step ``step`` of outer block ``outer`` names (parked when it visits none)."""
        first, last, count = self.span(outer, xp)
        park = xp.where(outer < self.first_outer, 0, self.park)
        return xp.where(count > 0, xp.minimum(first + step, last), park)

    def tables(self, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        outer, step = np.meshgrid(np.arange(self.num_outer), np.arange(steps), indexing="ij")
        index = self.index(outer, step, np).astype(np.int32)
        needs_mask = np.where(self.full(outer, index, np), 0, 1).astype(np.int32)
        count = self.span(np.arange(self.num_outer), np)[2].astype(np.int32)
        return index.reshape(-1), needs_mask.reshape(-1), count


def schedule(mask, block_q: int, block_kv: int, q_len_padded: int, kv_len_padded: int, overlap=None, *,
             transpose: bool = False) -> Schedule:
    """A pass's schedule: :class:`IntervalRule` arithmetic for positions alone (no table, whatever the
    length), :func:`build_schedule`'s tables where segment ids decide (``overlap``, per batch row)."""
    if overlap is not None:
        return build_schedule(position_map(mask, block_q, block_kv, q_len_padded, kv_len_padded,
                                           transpose=transpose), overlap)
    rule = IntervalRule.of(mask, block_q, block_kv, q_len_padded, kv_len_padded, transpose=transpose)
    steps = max(1, int(rule.span(np.arange(rule.num_outer), np)[2].max(initial=0)))
    placeholder = jnp.zeros((1,), jnp.int32)
    return Schedule(index=placeholder, needs_mask=placeholder, count=placeholder, num_outer=rule.num_outer,
                    num_inner=rule.num_inner, steps=steps, per_batch=False, rule=rule)


# --------------------------------------------------------------------------- inside a kernel
def _flat(sched: Schedule, b, outer, step):
    """Position of grid step ``step`` of outer block ``outer`` (batch ``b``) in the flat tables."""
    return (sched.row(b) * sched.num_outer + outer) * sched.steps + step


def visited_block(sched: Schedule, index_ref, b, outer, step):
    """The inner block grid step ``step`` of outer block ``outer`` names (read from SMEM, or computed by
    the schedule's rule): what every streamed operand's index map returns, and what the kernel body
    computes on."""
    if sched.rule is not None:
        return sched.rule.index(outer, step, np if isinstance(outer, int | np.integer) else jnp)
    return index_ref[_flat(sched, b, outer, step)]


def split_refs(refs, num_inputs: int, has_segments: bool):
    """A kernel's refs as ``(prefetch, inputs, (q_seg, kv_seg), outputs and scratch)``.

    The three scalar-prefetch tables come first, then ``num_inputs`` inputs, then the two
    segment-id refs when there are segments (``(None, None)`` otherwise), then the rest.
    """
    prefetch, inputs, rest = refs[:3], refs[3:3 + num_inputs], refs[3 + num_inputs:]
    if has_segments:
        return prefetch, inputs, tuple(rest[:2]), rest[2:]
    return prefetch, inputs, (None, None), rest


def scheduled_step(sched: Schedule, prefetch_refs, b, outer, step, update) -> None:
    """Run ``update(inner, apply_mask)`` at a grid step the schedule computes; skip the others.

    ``inner`` is the block this step visits, read from the scalar-prefetched index table (in SMEM).
    Steps past the outer block's count are idle: their index maps already name the resident block
    (no DMA) and ``pl.when`` skips the compute. PARTIAL and FULL tiles take separate branches, so a
    FULL tile pays no mask arithmetic.
    """
    index_ref, needs_mask_ref, count_ref = prefetch_refs
    if sched.rule is not None:
        _, _, count = sched.rule.span(outer, jnp)
        inner = sched.rule.index(outer, step, jnp)
        active = step < count
        needs_mask = jnp.logical_not(sched.rule.full(outer, inner, jnp))
    else:
        flat = _flat(sched, b, outer, step)
        active = step < count_ref[sched.row(b) * sched.num_outer + outer]
        needs_mask = needs_mask_ref[flat] != 0
        inner = index_ref[flat]
    pl.when(jnp.logical_and(active, needs_mask))(lambda: update(inner, True))
    pl.when(jnp.logical_and(active, jnp.logical_not(needs_mask)))(lambda: update(inner, False))


# --------------------------------------------------------------------------- head blocks
def head_units(spec) -> tuple[int, int, int]:
    """``(pack, group, units)``: the kv heads one K/V block holds (1, or a pair with paired heads:
    :class:`tpuattn.pallas.layout.Layout`), the query heads of such a block's kv heads, and how many
    such blocks (kv heads or kv head pairs) a batch row has. The grids step over these units as over
    kv heads."""
    pack = Layout.for_spec(spec).pack
    return pack, pack * spec.group_size, spec.num_kv_heads // pack


def q_heads_per_step(spec, pass_name: str, block_q: int, block_kv: int) -> int:
    """Query heads one grid step of the forward (``pass_name="forward"``), the dQ and row-sum passes
    (``"dq"``) or the dK/dV pass (``"dkv"``) serves: query heads of one GQA group (of a kv head pair's
    two groups with paired heads, a whole number of pairs), all of them unless the target chip's VMEM
    asks for fewer (:func:`tpuattn.pallas.blocks.fit_q_heads`). Their K/V block serves them all."""
    need = {"forward": forward_vmem_bytes, "dq": dq_vmem_bytes, "dkv": backward_vmem_bytes}[pass_name]
    d, itemsize = padded_head_dim(spec.head_dim), np.dtype(spec.dtype).itemsize
    pack, group, _ = head_units(spec)
    return fit_q_heads(group, lambda h: need(block_q, block_kv, d, itemsize, h), chips.target_chip(),
                       multiple_of=pack)


def step_kv_half(layout, group_size: int, q_heads: int):
    """:func:`kv_half` for the forward-grid kernels (forward, row sums, dQ): ``h -> `` the kv half of
    query head ``h`` of the step, whose head block (grid axis 1) starts ``first`` heads into its kv
    pair's query heads. Without paired heads, always 0 (nothing computed)."""
    if layout.pack == 1:
        return lambda h: 0
    blocks_per_pair = layout.pack * group_size // q_heads
    first = jax.lax.rem(pl.program_id(1), jnp.int32(blocks_per_pair)) * q_heads
    return functools.partial(kv_half, layout, group_size, first)


def kv_half(layout, group_size: int, first, h):
    """Which half of its kv pair's tile query head ``h`` of a grid step reads K/V from (0 without paired
    heads): ``first`` (traced) is the step's first query head counted within its kv pair's
    query heads, ``(first + h) // group_size`` its kv head within the pair."""
    if layout.pack == 1:
        return 0
    return _head_div(first + h, group_size)


def head_block_vmem_limit(spec, pass_name: str, block_q: int, block_kv: int, q_heads: int) -> int | None:
    """The ``vmem_limit_bytes`` a kernel serving ``q_heads`` query heads per step asks
    the target chip for (:func:`tpuattn.pallas.blocks.vmem_limit_bytes`; None: the default)."""
    need = {"forward": forward_vmem_bytes, "dq": dq_vmem_bytes, "dkv": backward_vmem_bytes}[pass_name]
    d, itemsize = padded_head_dim(spec.head_dim), np.dtype(spec.dtype).itemsize
    return vmem_limit_bytes(need(block_q, block_kv, d, itemsize, q_heads), q_heads, chips.target_chip())


def head_loop(q_heads: int, body) -> None:
    """Run ``body(h)`` for the ``q_heads`` query heads of a grid step, ``h`` a traced int32 (index a
    head block's refs with it: ``q_ref[h]``). A ``fori_loop`` unrolled when lowered, so the compiler
    may overlap one head's matmuls with another's softmax; in the jaxpr one ``scan`` whose body is one
    head's tile (what :func:`tpuattn.model.counts.matmuls_per_step` counts)."""
    jax.lax.fori_loop(0, q_heads, lambda h, carry: (body(h), carry)[1], 0, unroll=True)


# --------------------------------------------------------------------------- index maps
# The kernels' BlockSpec index maps. Grid of the forward and dQ passes: (batch, head_block,
# q_block, kv_step), a head block being ``q_heads`` query heads of one GQA group (leading-axis
# blocks ``(q_heads, block_q, head_dim)``); grid of the dK/dV pass: (batch, kv_head, kv_block,
# head_block, q_step), the head blocks of the kv head's group. The trailing arguments are the
# scalar-prefetch refs (index, needs_mask, count).
def _head_div(h, group_size: int):
    """``h // group_size`` for a non-negative head index: truncating division (``lax.div``)
    in a kernel, where floor division would lower through ``sign``; plain ``//`` on Python ints."""
    if isinstance(h, int | np.integer):
        return h // group_size
    return jax.lax.div(h, jnp.asarray(group_size, h.dtype))


def forward_index_maps(sched: Schedule, group_size: int, q_heads: int = 1):
    """Index maps of the forward/dQ grid ``(b, hb, i, s)`` over ``[batch, heads, seq, dim]`` arrays:
    head block ``hb`` holds query heads ``hb * q_heads ...`` (a divisor of ``group_size``)."""
    if group_size % q_heads:
        raise ValueError(f"q_heads: expected a divisor of the group size {group_size}, got {q_heads}")
    blocks_per_kv_head = group_size // q_heads

    def q_map(b, hb, i, s, index_ref, mask_ref, count_ref):  # block (q_heads, block_q, d)
        return (b, hb, i, 0)

    def q_row_map(b, hb, i, s, index_ref, mask_ref, count_ref):  # [batch, heads, 8, q_len] statistics
        return (b, hb, 0, i)

    def kv_map(b, hb, i, s, index_ref, mask_ref, count_ref):
        # GQA: a head block's query heads share one kv head; its K/V block serves them all, and
        # K/V are never repeated per query head.
        return (b, _head_div(hb, blocks_per_kv_head), visited_block(sched, index_ref, b, i, s), 0)

    def q_segment_map(b, hb, i, s, index_ref, mask_ref, count_ref):  # [batch, q_len, 128]
        return (b, i, 0)

    def kv_segment_map(b, hb, i, s, index_ref, mask_ref, count_ref):  # [batch, 8, kv_len]
        return (b, 0, visited_block(sched, index_ref, b, i, s))

    return {"q": q_map, "q_row": q_row_map, "kv": kv_map, "q_segment": q_segment_map,
            "kv_segment": kv_segment_map}


def dkv_index_maps(sched: Schedule, group_size: int, q_heads: int = 1):
    """Index maps of the dK/dV grid ``(b, kv_head, j, g, t)``: head block ``g`` of kv head ``kv_head``'s
    group, query heads ``kv_head * group + g * q_heads ...`` (blocks of ``q_heads``)."""
    if group_size % q_heads:
        raise ValueError(f"q_heads: expected a divisor of the group size {group_size}, got {q_heads}")
    blocks_per_kv_head = group_size // q_heads

    def q_map(b, kh, j, g, t, index_ref, mask_ref, count_ref):
        return (b, kh * blocks_per_kv_head + g, visited_block(sched, index_ref, b, j, t), 0)

    def q_row_map(b, kh, j, g, t, index_ref, mask_ref, count_ref):  # [batch, heads, 8, q_len] statistics
        return (b, kh * blocks_per_kv_head + g, 0, visited_block(sched, index_ref, b, j, t))

    def kv_map(b, kh, j, g, t, index_ref, mask_ref, count_ref):
        return (b, kh, j, 0)

    def q_segment_map(b, kh, j, g, t, index_ref, mask_ref, count_ref):  # [batch, 8, q_len]
        return (b, 0, visited_block(sched, index_ref, b, j, t))

    def kv_segment_map(b, kh, j, g, t, index_ref, mask_ref, count_ref):  # [batch, kv_len, 128]
        return (b, j, 0)

    return {"q": q_map, "q_row": q_row_map, "kv": kv_map, "q_segment": q_segment_map,
            "kv_segment": kv_segment_map}
