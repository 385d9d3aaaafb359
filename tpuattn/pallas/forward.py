"""The forward kernel: online softmax over the scheduled key/value blocks.

Grid ``(batch, head_block, q_block, kv_step)``. A head block is the query heads of one GQA group
(or a divisor of it, where the chip's VMEM asks: :func:`tpuattn.pallas.plan.q_heads_per_step`): a
step loops over them against one K/V block, so each K/V block is fetched once per group, not once
per query head, and a 16-query/2-kv-head problem takes the grid steps of a 2/2 one. Each head of a
block is a whole (sublane, lane) tile: lane columns of the view ``[batch, seq, heads * head_dim]``
(head_dim a multiple of 128), or a leading axis of the padded heads-first copy otherwise. The first
three axes are independent (``parallel``: Mosaic may split them across TensorCores); the kv axis is
a reduction into VMEM scratch that lives across its steps, so it must run in order on one core
(``arbitrary``) and be the last (fastest) axis.

The layout (:class:`tpuattn.pallas.layout.Layout`) is :mod:`tpuattn.pallas.layout`'s;
the schedule, index maps and step guard are :mod:`tpuattn.pallas.plan`'s.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpuattn._checks import round_up
from tpuattn.numerics import LOG2_E, logits, matmul_precision
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


# --------------------------------------------------------------------------- kernel
def _forward_kernel(*refs, sched, mask, scale, softcap, block_q, block_kv, q_heads, group_size,
                    has_segments, precision, layout, stat_rows):
    prefetch, (q_ref, k_ref, v_ref), (q_seg_ref, kv_seg_ref), rest = plan.split_refs(refs, 3, has_segments)
    o_ref, lse_ref, m_ref, l_ref, acc_ref = rest
    b, i, step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    kv_half = plan.step_kv_half(layout, group_size, q_heads)  # paired heads: each head's half of K/V
    # Without a softcap the kernel keeps the logits unscaled and folds the scale into the one multiply
    # before exp2: the max commutes with a positive scale, rounding included (rounding is monotone),
    # so m * scale is bitwise the max the backward's scaled logits reach. With a softcap the capped
    # logits are in natural units already.
    to_natural = scale if softcap is None else 1.0
    to_exp2 = to_natural * LOG2_E

    # Running max m (of the unscaled logits without a softcap) and sum l are kept lane-replicated
    # ([q_heads, block_q, 128]) and in float32: exp and the long sum lose too much in bfloat16, and the
    # scratch persists across the kv steps.
    @pl.when(step == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def update(kv_block, apply_mask: bool):
        k, v = k_ref[...], v_ref[...]  # one K/V block for every query head of the step
        keep = None
        if apply_mask:  # the mask is the same for every head: built once per step
            segments = (q_seg_ref[:, :1], kv_seg_ref[:1, :]) if has_segments else ()
            keep = tile_visibility(mask, (block_q, block_kv), i * block_q, kv_block * block_kv, *segments)

        def head(h):
            # Head h's Q tile; with paired heads its 64 lanes alone, on its kv head's half of K.
            s = jax.lax.dot_general(layout.load(q_ref, h, kv_half(h)), k, NT_DIMS, precision=precision,
                                    preferred_element_type=jnp.float32)
            s = logits(s, scale, softcap)  # unscaled without a softcap: see to_exp2
            if keep is not None:
                s = jnp.where(keep, s, -jnp.inf)
            m_prev, l_prev = m_ref[h], l_ref[h]
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            # A row with no visible key so far keeps m = -inf; shift by 0 instead so that
            # exp(-inf - shift) = 0 rather than exp(-inf + inf) = NaN.
            shift = jnp.where(m_next == -jnp.inf, 0.0, m_next)
            # exp(scale * (s - m)) as 2^((s - m) * to_exp2): the subtraction first (exact where the
            # logits are), then one multiply, where exp would multiply by log2(e) again itself.
            p = jnp.exp2((s - shift[:, :1]) * to_exp2)
            alpha = jnp.exp2((m_prev - shift) * to_exp2)
            l_ref[h] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
            m_ref[h] = m_next
            # With paired heads P V is right on the kv head's half (the other half is unused).
            pv = jnp.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
            acc_ref[h] = acc_ref[h] * alpha[:, :1] + pv

        plan.head_loop(q_heads, head)

    plan.scheduled_step(sched, prefetch, b, i, step, update)

    @pl.when(step == sched.steps - 1)
    def _finish():
        m, l_sum = m_ref[...], l_ref[...]
        # Rows that saw no key (l = 0) output zeros; a NaN l (a NaN among the row's keys) must
        # propagate, so the test is "l != 0", not "l > 0".
        seen = l_sum != 0
        # The logsumexp m + log(l) is saved as its two terms (0: m, 1: log l): with logits near
        # 1e3 the float32 sum would carry an absolute error of ~1e-4, and the backward's
        # exp(s - m - log l) would inherit it; s - m is exact where s is. 2: did the row see any
        # key (for a block of a larger problem, whose rows may see nothing here and something
        # elsewhere: (0, 0) alone cannot say).
        m = jnp.where(seen, m * to_natural, 0.0)  # the max of the scaled logits, as if scaled first
        log_l = jnp.where(seen, jnp.log(jnp.where(seen, l_sum, 1.0)), 0.0)
        lane = jax.lax.broadcasted_iota(jnp.int32, m.shape[1:], 1)

        def out(h):  # head h's output, on its own half of its pair's tile with paired heads
            o = jnp.where(seen[h, :, :1], acc_ref[h] / jnp.where(seen[h], l_sum[h], 1.0)[:, :1], 0.0)
            return layout.move(o, kv_half(h), layout.half(h))

        layout.store(o_ref, q_heads, out)
        for h in range(q_heads):
            stats = jnp.where(lane == 0, m[h], jnp.where(lane == 1, log_l[h], jnp.where(
                lane == 2, seen[h].astype(jnp.float32), 0.0)))  # [block_q, 128]: one statistic per lane
            # As rows (8, block_q), queries on lanes: 32 bytes a row in HBM, not 512.
            lse_ref[h] = stats.T[:STAT_ROWS] if stat_rows else stats


def forward(q, k, v, segment_ids, spec, blocks, interpret, seen=False, out_dtype=None):
    """Pallas forward. Returns ``(out [b, q_len, h, d], logsumexp [b, h, 2, q_len] float32)``.

    ``out`` is in ``out_dtype`` (default: q's dtype; float32 for a block of a larger problem, whose
    output is merged with others before it is rounded). The logsumexp comes as its two terms
    ``(max, log(sum))`` on axis 2; their sum is the logsumexp (0 for a row that sees no key). With
    ``seen`` a third row says whether the row saw any key (1.0) or none (0.0).

    ``blocks`` is a :class:`~tpuattn.pallas.blocks.ForwardBlocks`; ``interpret`` as for
    ``pallas_call`` (already resolved by the caller).
    """
    fb = blocks.clamp(spec.q_len, spec.kv_len)
    bq, bk = fb.block_q, fb.block_kv
    tq, tk = round_up(spec.q_len, bq), round_up(spec.kv_len, bk)
    layout = Layout.for_spec(spec)
    d = layout.tile
    nq = tq // bq
    qp, kp, vp = layout.operand(q, bq), layout.operand(k, bk), layout.operand(v, bk)

    overlap, segs = None, None
    if segment_ids is not None:
        segs = segment_layouts(segment_ids, bq, bk)
        overlap = plan.schedule_overlap(segs, bq, bk, interpret)
    sched = plan.schedule(spec.mask, bq, bk, tq, tk, overlap)
    hq = plan.q_heads_per_step(spec, "forward", bq, bk)
    maps = plan.forward_index_maps(sched, plan.head_units(spec)[1], hq)

    q_spec = pl.BlockSpec(layout.block(hq, bq), layout.index_map(maps["q"]))
    kv_spec = pl.BlockSpec(layout.block(None, bk), layout.index_map(maps["kv"]))
    in_specs = [q_spec, kv_spec, kv_spec]
    operands = [qp, kp, vp]
    if segs is not None:
        in_specs += [pl.BlockSpec((None, bq, LANES), maps["q_segment"]),
                     pl.BlockSpec((None, SUBLANES, bk), maps["kv_segment"])]
        operands += [segs["q_col"], segs["kv_row"]]
    # The statistics as rows [b, h, 8, tq] need block_q on lanes: a multiple of 128 or the whole
    # (padded) sequence. A forward block_q of a multiple of 8 only writes them as 128-lane columns,
    # transposed to rows outside the kernel.
    stat_rows = bq % LANES == 0 or bq == tq
    stats_spec = (pl.BlockSpec((None, hq, STAT_ROWS, bq), maps["q_row"]) if stat_rows
                  else pl.BlockSpec((None, hq, bq, LANES), maps["q"]))
    out_specs = [q_spec, stats_spec]
    out_dtype = q.dtype if out_dtype is None else out_dtype
    out_shape = [compat.out_struct(layout.shape(spec.batch, spec.num_q_heads, tq), out_dtype, qp),
                 compat.out_struct((spec.batch, spec.num_q_heads, STAT_ROWS, tq) if stat_rows
                                   else (spec.batch, spec.num_q_heads, tq, LANES), jnp.float32, qp)]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(spec.batch, spec.num_q_heads // hq, nq, sched.steps),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((hq, bq, LANES), jnp.float32),  # running max m, per head
                        pltpu.VMEM((hq, bq, LANES), jnp.float32),  # running sum l
                        pltpu.VMEM((hq, bq, d), jnp.float32)],  # output accumulators
    )
    kernel = functools.partial(
        _forward_kernel, sched=sched, mask=spec.mask, scale=spec.scale, softcap=spec.softcap,
        block_q=bq, block_kv=bk, q_heads=hq, group_size=spec.group_size, has_segments=segs is not None,
        precision=matmul_precision(q.dtype), layout=layout, stat_rows=stat_rows)
    itemsize = jnp.dtype(q.dtype).itemsize
    computed = spec.batch * spec.num_q_heads * sched.num_outer * sched.steps  # tiles, an upper bound
    cost = pl.CostEstimate(flops=4 * computed * bq * bk * d, transcendentals=computed * bq * bk,
                           bytes_accessed=itemsize * (qp.size * 2 + kp.size + vp.size))
    vmem_limit = None if interpret else plan.head_block_vmem_limit(spec, "forward", bq, bk, hq)
    out, stats = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=vmem_limit),
        interpret=interpret,
        cost_estimate=cost,
        name="tpuattn_flash_forward",
    )(*sched.arrays(), *operands)
    if not stat_rows:
        stats = jnp.swapaxes(stats[..., :STAT_ROWS], 2, 3)
    return layout.result(out, spec.q_len, spec.num_q_heads, spec.head_dim), stats[:, :, : 3 if seen else 2,
                                                                                   : spec.q_len]
