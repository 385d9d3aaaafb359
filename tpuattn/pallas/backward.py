"""The backward kernels (FlashAttention-2 style), recomputing each tile from the saved logsumexp.

With ``P = exp(S - logsumexp)`` recomputed block by block:

    dV = P^T dO        dP = dO V^T        dS = P * (dP - delta)        delta = rowsum(P * dP)
    dQ = scale * dS' K                    dK = scale * dS'^T Q

where ``dS' = dS * (1 - tanh^2)`` with a softcap (the derivative of ``c tanh(x / c)``).

Three passes, so that every output block is owned by one grid cell and no atomics are needed
(a TPU kernel has none; FlashAttention-2 on a GPU instead adds dQ atomically from one kernel):

1. **row sums** -- the dQ grid, computing only ``delta = rowsum(P * dP)`` per query row;
2. **dQ** -- grid ``(batch, head_block, q_block, kv_step)`` with the forward's schedule (built for
   the backward block sizes) and head blocks (the query heads of a GQA group, looped inside a step
   against one K/V block: K/V fetched once per group): one query block of each head accumulates over
   its visible kv blocks (pass 1 runs on the same grid);
3. **dK/dV** -- grid ``(batch, kv_head, kv_block, head_block, q_step)``. Each cell owns one
   key/value block of one kv head and loops over the query heads of its GQA group (a step serves
   a head block of them, the whole group unless the chip's VMEM asks for fewer, looped inside the
   step; the head blocks are a grid axis) and the query blocks the schedule says can see it (the
   last two axes are the reduction: ``arbitrary``), summing into float32 VMEM scratch; so dK and dV
   come out already summed over the group and K/V are never repeated. It works on the transposed scores
   ``S^T = K Q^T`` ``[block_kv, block_q]`` so that logsumexp and delta, stored as rows
   ``[batch, heads, 8, q_len]`` (:data:`tpuattn.pallas.layout.STAT_ROWS`), broadcast along sublanes
   without a transpose. The q-major passes 1 and 2 need them as columns of their ``[block_q, ...]``
   tiles and transpose each head's ``(8, block_q)`` block in VMEM.

All skip hidden tiles exactly as the forward does (:func:`tpuattn.pallas.plan.scheduled_step`).

Which delta (the ``backward`` option, :mod:`tpuattn.pallas.vjp`). ``rowsum(dO * O)`` equals
``rowsum(P * dP)`` in exact arithmetic and costs no pass, but ``O`` is rounded, and for a row whose
softmax is nearly one-hot ``dP_ij - delta_i`` must cancel to a small number -- which only the sum of
the very ``P * dP`` tiles the kernels compute guarantees. From the bf16-rounded ``O``, bf16 dQ on such
rows was far less accurate than autodiff of the materialised reference. ``backward="fast"`` takes
``O`` from the forward's float32 accumulator instead (``delta`` given, pass 1 skipped: 7 matmuls per
visible tile), which holds the bf16 one-hot rows; but float32 dK at exact logits of ~1e3 still misses
the oracle suite's 1e-4 for some upstream gradients (``benchmarks/backward_accuracy.py``,
``tests/test_pallas_backward.py``), so ``"exact"`` (pass 1, 9 matmuls) is the default.

The price of pass 1: per visible tile it re-reads K and V and does two matmuls (``Q K^T`` and
``dO V^T``) on top of the seven of passes 2 and 3 (about 2/7 more backward FLOPs), and writes delta
as float32 rows ``[batch, heads, 8, q_len]`` (32 bytes a query row). Folding it into the dQ kernel as a
first sweep over the kv blocks would save that array and one launch, not the matmuls or the K/V
reads; a separate pass keeps each kernel one loop.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpuattn._checks import round_up
from tpuattn.numerics import matmul_precision, pad_to_multiple
from tpuattn.pallas import compat, plan
from tpuattn.pallas.layout import (
    LANES,
    NT_DIMS,
    STAT_ROWS,
    SUBLANES,
    Layout,
    segment_layouts,
    tile_visibility,
)


def _softcap_grad(s, scale, softcap):
    """The scaled (and capped) logits of the raw products ``s = q . k``, as the forward computed them
    (:func:`tpuattn.numerics.logits`), and d(capped)/d(scaled), ``1 - tanh^2`` (None without a cap)."""
    if softcap is None:
        return s * scale, None
    t = jnp.tanh(s * (scale / softcap))
    return softcap * t, 1.0 - t * t


# --------------------------------------------------------------------------- row sums and dQ
def _dq_kernel(*refs, sched, mask, scale, softcap, block_q, block_kv, q_heads, group_size, has_segments,
               precision, layout, row_sums_only):
    """Pass 1 (``row_sums_only``: writes rowsum(P * dP)) or pass 2 (reads it as delta, writes dQ)."""
    prefetch, inputs, (q_seg_ref, kv_seg_ref), (out_ref, acc_ref) = plan.split_refs(
        refs, 5 if row_sums_only else 6, has_segments)
    q_ref, k_ref, v_ref, do_ref, lse_ref = inputs[:5]
    delta_ref = None if row_sums_only else inputs[5]
    b, i, step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    kv_half = plan.step_kv_half(layout, group_size, q_heads)  # paired heads: each head's half of K/V

    @pl.when(step == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def update(kv_block, apply_mask: bool):
        k, v = k_ref[...], v_ref[...]  # one K/V block for every query head of the step
        keep = None
        if apply_mask:  # the same for every head: built once per step
            segments = (q_seg_ref[:, :1], kv_seg_ref[:1, :]) if has_segments else ()
            keep = tile_visibility(mask, (block_q, block_kv), i * block_q, kv_block * block_kv, *segments)

        def head(h):
            q, do = layout.load(q_ref, h, kv_half(h)), layout.load(do_ref, h, kv_half(h))
            lse = lse_ref[h].T  # rows (8, block_q) -> columns [block_q, 8]: 0 m, 1 log l
            s = jax.lax.dot_general(q, k, NT_DIMS, precision=precision, preferred_element_type=jnp.float32)
            s, dcap = _softcap_grad(s, scale, softcap)
            p = jnp.exp((s - lse[:, 0:1]) - lse[:, 1:2])  # logsumexp = m + log l
            if keep is not None:
                p = jnp.where(keep, p, 0.0)
            dp = jax.lax.dot_general(do, v, NT_DIMS, precision=precision, preferred_element_type=jnp.float32)
            if row_sums_only:  # the same sum in every lane: the output is delta, lane-replicated
                acc_ref[h] += jnp.sum(p * dp, axis=1, keepdims=True)
                return
            ds = p * (dp - delta_ref[h].T[:, 0:1])
            if dcap is not None:
                ds = ds * dcap
            # dS K: with paired heads right on the kv head's half (the other half unused until _finish)
            acc_ref[h] += scale * jnp.dot(ds.astype(k.dtype), k, precision=precision,
                                          preferred_element_type=jnp.float32)

        plan.head_loop(q_heads, head)

    plan.scheduled_step(sched, prefetch, b, i, step, update)

    @pl.when(step == sched.steps - 1)
    def _finish():
        if row_sums_only:  # delta: the scratch's lane-replicated column, written as rows (8, block_q)
            for h in range(q_heads):
                out_ref[h] = acc_ref[h].T[:STAT_ROWS]
            return

        def dq(h):  # head h's dQ, on its own half of its pair's tile with paired heads
            return layout.move(acc_ref[h], kv_half(h), layout.half(h))

        layout.store(out_ref, q_heads, dq)


# --------------------------------------------------------------------------- dK/dV
def _dkv_kernel(*refs, sched, mask, scale, softcap, block_q, block_kv, head_blocks, q_heads, group_size,
                has_segments, precision, layout):
    prefetch, inputs, (q_seg_ref, kv_seg_ref), (dk_ref, dv_ref, dk_acc, dv_acc) = plan.split_refs(
        refs, 6, has_segments)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = inputs
    b, j, member, step = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    # Paired heads: Q and dO of each query head moved onto its kv head's half of the K/V tile, so that
    # every product below sums one head's lanes and dK, dV land on that half.
    kv_half = functools.partial(plan.kv_half, layout, group_size, member * q_heads)

    @pl.when(jnp.logical_and(member == 0, step == 0))
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    def update(q_block, apply_mask: bool):
        k, v = k_ref[...], v_ref[...]
        keep = None
        if apply_mask:  # the same for every query head of the step: built once
            segments = (q_seg_ref[:1, :], kv_seg_ref[:, :1]) if has_segments else ()
            keep = tile_visibility(mask, (block_kv, block_q), q_block * block_q, j * block_kv, *segments,
                                   transposed=True)

        def head(h):
            q, do, lse = layout.load(q_ref, h, kv_half(h)), layout.load(do_ref, h, kv_half(h)), lse_ref[h]
            # Transposed scores [block_kv, block_q]: logsumexp and delta are rows [1, block_q].
            st = jax.lax.dot_general(k, q, NT_DIMS, precision=precision, preferred_element_type=jnp.float32)
            st, dcap = _softcap_grad(st, scale, softcap)
            pt = jnp.exp((st - lse[0:1, :]) - lse[1:2, :])  # rows: m, log l
            if keep is not None:
                pt = jnp.where(keep, pt, 0.0)
            dv_acc[...] += jnp.dot(pt.astype(do.dtype), do, precision=precision,
                                   preferred_element_type=jnp.float32)
            dpt = jax.lax.dot_general(v, do, NT_DIMS, precision=precision, preferred_element_type=jnp.float32)
            dst = pt * (dpt - delta_ref[h][0:1, :])
            if dcap is not None:
                dst = dst * dcap
            dk_acc[...] += scale * jnp.dot(dst.astype(q.dtype), q, precision=precision,
                                           preferred_element_type=jnp.float32)

        plan.head_loop(q_heads, head)

    plan.scheduled_step(sched, prefetch, b, j, step, update)

    @pl.when(jnp.logical_and(member == head_blocks - 1, step == sched.steps - 1))
    def _finish():
        dk_ref[...] = dk_acc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


# --------------------------------------------------------------------------- the passes
class _Problem:
    """What the three passes share: blocks, padded operands, segment layouts, the kernels' arguments."""

    def __init__(self, q, k, v, segment_ids, lse, d_out, spec, blocks, interpret):
        bb = blocks.clamp(spec.q_len, spec.kv_len)
        self.spec, self.interpret = spec, interpret
        self.bq, self.bk = bb.block_q, bb.block_kv
        self.tq, self.tk = round_up(spec.q_len, self.bq), round_up(spec.kv_len, self.bk)
        self.layout = Layout.for_spec(spec)
        self.d = self.layout.tile
        self.qp, self.kp, self.vp, self.dop = (self.layout.operand(x, block) for x, block in
                                               ((q, self.bq), (k, self.bk), (v, self.bk), (d_out, self.bq)))
        # Padded query rows: logsumexp 0 and dO 0, so their P is finite and their dS is 0.
        self.lse = pad_to_multiple(pad_to_multiple(lse, 2, STAT_ROWS), 3, self.bq)  # [b, h, 8, tq] rows
        self.segs = segment_layouts(segment_ids, self.bq, self.bk) if segment_ids is not None else None
        self.kernel_args = dict(mask=spec.mask, scale=spec.scale, softcap=spec.softcap, block_q=self.bq,
                                block_kv=self.bk, has_segments=self.segs is not None,
                                precision=matmul_precision(q.dtype), layout=self.layout,
                                group_size=spec.group_size)

    def overlap(self, transpose=False):
        return plan.schedule_overlap(self.segs, self.bq, self.bk, self.interpret, transpose=transpose)


def _q_major_pass(pb: _Problem, delta=None):
    """Passes 1 and 2 on the forward's grid: rowsum(P * dP) when ``delta`` is None, else dQ."""
    spec, bq, bk, layout = pb.spec, pb.bq, pb.bk, pb.layout
    row_sums_only = delta is None
    sched = plan.schedule(spec.mask, bq, bk, pb.tq, pb.tk, pb.overlap())
    hq = plan.q_heads_per_step(spec, "dq", bq, bk)
    maps = plan.forward_index_maps(sched, plan.head_units(spec)[1], hq)
    q_spec = pl.BlockSpec(layout.block(hq, bq), layout.index_map(maps["q"]))
    kv_spec = pl.BlockSpec(layout.block(None, bk), layout.index_map(maps["kv"]))
    rows_spec = pl.BlockSpec((None, hq, STAT_ROWS, bq), maps["q_row"])  # [b, h, 8, tq] statistics
    in_specs = [q_spec, kv_spec, kv_spec, q_spec, rows_spec]
    operands = [pb.qp, pb.kp, pb.vp, pb.dop, pb.lse]
    if not row_sums_only:
        in_specs.append(rows_spec)
        operands.append(delta)
    if pb.segs is not None:
        in_specs += [pl.BlockSpec((None, bq, LANES), maps["q_segment"]),
                     pl.BlockSpec((None, SUBLANES, bk), maps["kv_segment"])]
        operands += [pb.segs["q_col"], pb.segs["kv_row"]]
    if row_sums_only:  # delta, accumulated lane-replicated, written as rows
        out_spec, out_shape, width = rows_spec, (spec.batch, spec.num_q_heads, STAT_ROWS, pb.tq), LANES
    else:
        out_spec, out_shape, width = q_spec, layout.shape(spec.batch, spec.num_q_heads, pb.tq), pb.d
    vmem_limit = None if pb.interpret else plan.head_block_vmem_limit(spec, "dq", bq, bk, hq)
    return pl.pallas_call(
        functools.partial(_dq_kernel, sched=sched, row_sums_only=row_sums_only, q_heads=hq,
                          **pb.kernel_args),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(spec.batch, spec.num_q_heads // hq, pb.tq // bq, sched.steps),
            in_specs=in_specs,
            out_specs=out_spec,
            scratch_shapes=[pltpu.VMEM((hq, bq, width), jnp.float32)]),
        out_shape=compat.out_struct(out_shape, jnp.float32 if row_sums_only else pb.qp.dtype, pb.qp),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=vmem_limit),
        interpret=pb.interpret,
        name="tpuattn_flash_row_sums" if row_sums_only else "tpuattn_flash_dq",
    )(*sched.arrays(), *operands)


def _dkv_pass(pb: _Problem, delta):
    """Pass 3: dK, dV (kv-major schedule, the group's query heads looped inside)."""
    spec, bq, bk, d, layout = pb.spec, pb.bq, pb.bk, pb.d, pb.layout
    _, group, units = plan.head_units(spec)  # the grid steps over kv heads (or kv head pairs)
    sched = plan.schedule(spec.mask, bq, bk, pb.tq, pb.tk, pb.overlap(transpose=True), transpose=True)
    hq = plan.q_heads_per_step(spec, "dkv", bq, bk)
    maps = plan.dkv_index_maps(sched, group, hq)
    q_spec = pl.BlockSpec(layout.block(hq, bq), layout.index_map(maps["q"]))
    kv_block_spec = pl.BlockSpec(layout.block(None, bk), layout.index_map(maps["kv"]))
    in_specs = [q_spec, kv_block_spec, kv_block_spec, q_spec,
                pl.BlockSpec((None, hq, STAT_ROWS, bq), maps["q_row"]),
                pl.BlockSpec((None, hq, STAT_ROWS, bq), maps["q_row"])]
    operands = [pb.qp, pb.kp, pb.vp, pb.dop, pb.lse, delta]
    if pb.segs is not None:
        in_specs += [pl.BlockSpec((None, SUBLANES, bq), maps["q_segment"]),
                     pl.BlockSpec((None, bk, LANES), maps["kv_segment"])]
        operands += [pb.segs["q_row"], pb.segs["kv_col"]]
    vmem_limit = None if pb.interpret else plan.head_block_vmem_limit(spec, "dkv", bq, bk, hq)
    return pl.pallas_call(
        functools.partial(_dkv_kernel, sched=sched, head_blocks=group // hq, q_heads=hq, **pb.kernel_args),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(spec.batch, units, pb.tk // bk, group // hq, sched.steps),
            in_specs=in_specs, out_specs=[kv_block_spec, kv_block_spec],
            scratch_shapes=[pltpu.VMEM((bk, d), jnp.float32), pltpu.VMEM((bk, d), jnp.float32)]),
        out_shape=[compat.out_struct(pb.kp.shape, pb.kp.dtype, pb.kp),
                   compat.out_struct(pb.vp.shape, pb.vp.dtype, pb.vp)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=vmem_limit),
        interpret=pb.interpret,
        name="tpuattn_flash_dkv",
    )(*sched.arrays(), *operands)


def row_sums(q, k, v, segment_ids, lse, d_out, spec, blocks, interpret):
    """Pass 1 alone: ``rowsum(P * dP)`` ``[b, h, q_len]`` float32 (for a block of a larger problem,
    its share of the row's sum: ``lse`` is then the whole row's)."""
    pb = _Problem(q, k, v, segment_ids, lse, d_out, spec, blocks, interpret)
    return _q_major_pass(pb)[:, :, 0, : spec.q_len]


def backward(q, k, v, segment_ids, lse, d_out, spec, blocks, interpret, delta=None):
    """dQ, dK, dV (contract layout, input dtypes) from the forward's logsumexp.

    ``lse`` is the forward's ``[b, h, 2, q_len]`` pair (max, log sum); ``blocks`` a
    :class:`~tpuattn.pallas.blocks.BackwardBlocks` shared by the three passes. ``delta``
    ``[b, h, q_len]`` (the whole row's ``rowsum(P * dP)``, for a block of a larger problem)
    replaces pass 1 when given.
    """
    pb = _Problem(q, k, v, segment_ids, lse, d_out, spec, blocks, interpret)
    if delta is None:
        delta = _q_major_pass(pb)  # rowsum(P * dP): [b, h, 8, tq] float32 rows (row 0)
    else:
        delta = pad_to_multiple(delta.astype(jnp.float32), 2, pb.bq)[:, :, None, :]
        delta = jnp.broadcast_to(delta, (*delta.shape[:2], STAT_ROWS, delta.shape[3]))
    dq = _q_major_pass(pb, delta=delta)
    dk, dv = _dkv_pass(pb, delta=delta)
    layout = pb.layout
    return (layout.result(dq, spec.q_len, spec.num_q_heads, spec.head_dim),
            layout.result(dk, spec.kv_len, spec.num_kv_heads, spec.head_dim),
            layout.result(dv, spec.kv_len, spec.num_kv_heads, spec.head_dim))
