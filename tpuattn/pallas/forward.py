"""The forward kernel: online softmax over the scheduled key/value blocks.

Grid ``(batch, q_head, q_block, kv_step)``. The first three axes are independent
(``parallel``: Mosaic may split them across TensorCores); the kv axis is a reduction into
VMEM scratch that lives across its steps, so it must run in order on one core
(``arbitrary``) and be the last (fastest) axis.

Layout inside the kernels: ``[batch, heads, seq, head_dim]`` so that a block's last two
dimensions are (sequence, head_dim) -- the (sublane, lane) tile -- with head_dim padded to
a multiple of 128 lanes and the sequences padded to their block multiples.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tpuattn.impl.common import apply_softcap, matmul_precision
from tpuattn.pallas import compat
from tpuattn.pallas import plan as schedule
from tpuattn.pallas.blocks import LANES, SUBLANES

pl, pltpu = compat.pl, compat.pltpu

# Contract dims (..., d) of both operands: q @ k^T without materialising k^T.
NT_DIMS = (((1,), (1,)), ((), ()))


def pad_axis(x, axis: int, size: int, *, edge: bool = False):
    """Pad ``x`` along ``axis`` up to ``size`` (zeros, or repeating the last value)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, mode="edge" if edge else "constant")


def to_kernel_layout(x, seq_len_padded: int, head_dim_padded: int):
    """``[batch, seq, heads, d]`` -> ``[batch, heads, seq_padded, d_padded]`` (zeros in the padding)."""
    x = jnp.swapaxes(x, 1, 2)
    return pad_axis(pad_axis(x, 2, seq_len_padded), 3, head_dim_padded)


def segment_layouts(segment_ids, tq: int, tk: int):
    """Padded segment ids as lane columns ``[b, t, 128]`` and sublane rows ``[b, 8, t]``.

    A kernel compares a column of query ids with a row of key ids; both are kept as
    full (8, 128)-aligned tiles so the BlockSpecs obey the TPU tiling rule.
    """
    q_seg, kv_seg = (pad_axis(s, 1, n, edge=True) for s, n in zip(segment_ids, (tq, tk), strict=True))

    def column(s):
        return jnp.broadcast_to(s[:, :, None], (*s.shape, LANES))

    def row(s):
        return jnp.broadcast_to(s[:, None, :], (s.shape[0], SUBLANES, s.shape[1]))

    return {"q": q_seg, "kv": kv_seg, "q_col": column(q_seg), "q_row": row(q_seg),
            "kv_col": column(kv_seg), "kv_row": row(kv_seg)}


def tile_visibility(mask, shape, q_start, kv_start, q_seg=None, kv_seg=None, *, transposed=False):
    """Which elements of one score tile the mask keeps, from iotas inside the kernel.

    The tile is ``[block_q, block_kv]`` (queries on sublanes), or its transpose when
    ``transposed`` (keys on sublanes, as in the dK/dV kernel). ``q_seg``/``kv_seg`` are the
    tile's segment ids already laid out to broadcast against it.
    """
    q_axis, kv_axis = (1, 0) if transposed else (0, 1)
    q_idx = q_start + jax.lax.broadcasted_iota(jnp.int32, shape, q_axis)
    kv_idx = kv_start + jax.lax.broadcasted_iota(jnp.int32, shape, kv_axis)
    return mask.visible(q_idx, kv_idx, q_seg, kv_seg, xp=jnp)


# --------------------------------------------------------------------------- kernel
def _forward_kernel(index_ref, needs_mask_ref, count_ref, *refs, sched, mask, scale, softcap,
                    block_q, block_kv, has_segments, precision):
    if has_segments:
        q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref = refs
    else:
        q_ref, k_ref, v_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref = refs
        q_seg_ref = kv_seg_ref = None
    b, i, step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    row = b if sched.per_batch else 0
    flat = (row * sched.num_outer + i) * sched.steps + step

    # Running max m and sum l are kept lane-replicated ([block_q, 128]) and in float32: exp and
    # the long sum lose too much in bfloat16, and the scratch persists across the kv steps.
    @pl.when(step == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def update(apply_mask: bool):
        q, k, v = q_ref[...], k_ref[...], v_ref[...]
        s = jax.lax.dot_general(q, k, NT_DIMS, precision=precision, preferred_element_type=jnp.float32)
        s = apply_softcap(s * scale, softcap)
        if apply_mask:
            segments = (q_seg_ref[:, :1], kv_seg_ref[:1, :]) if has_segments else ()
            keep = tile_visibility(mask, s.shape, i * block_q, index_ref[flat] * block_kv, *segments)
            s = jnp.where(keep, s, -jnp.inf)
        m_prev, l_prev = m_ref[...], l_ref[...]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        # A row with no visible key so far keeps m = -inf; shift by 0 instead so that
        # exp(-inf - shift) = 0 rather than exp(-inf + inf) = NaN.
        shift = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        p = jnp.exp(s - shift[:, :1])
        alpha = jnp.exp(m_prev - shift)
        l_ref[...] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        m_ref[...] = m_next
        pv = jnp.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
        acc_ref[...] = acc_ref[...] * alpha[:, :1] + pv

    active = step < count_ref[row * sched.num_outer + i]
    needs_mask = needs_mask_ref[flat] != 0
    pl.when(jnp.logical_and(active, needs_mask))(lambda: update(True))
    pl.when(jnp.logical_and(active, jnp.logical_not(needs_mask)))(lambda: update(False))

    @pl.when(step == sched.steps - 1)
    def _finish():
        m, l_sum = m_ref[...], l_ref[...]
        seen = l_sum > 0  # rows that saw no key output zeros
        o_ref[...] = jnp.where(seen[:, :1], acc_ref[...] / jnp.where(seen, l_sum, 1.0)[:, :1],
                               0.0).astype(o_ref.dtype)
        # The logsumexp m + log(l) is saved as its two terms (lane 0: m, lane 1: log l): with
        # logits near 1e3 the float32 sum would carry an absolute error of ~1e-4, and the
        # backward's exp(s - m - log l) would inherit it; s - m is exact where s is.
        m = jnp.where(seen, m, 0.0)
        log_l = jnp.where(seen, jnp.log(jnp.where(seen, l_sum, 1.0)), 0.0)
        lane = jax.lax.broadcasted_iota(jnp.int32, m.shape, 1)
        lse_ref[...] = jnp.where(lane == 0, m, log_l)


def forward(q, k, v, segment_ids, spec, blocks, interpret):
    """Pallas forward. Returns ``(out [b, q_len, h, d], logsumexp [b, h, q_len, 2] float32)``.

    The logsumexp comes as its two terms ``(max, log(sum))``; their sum is the logsumexp
    (0 for a row that sees no key).

    ``blocks`` is a :class:`~tpuattn.pallas.blocks.ForwardBlocks`; ``interpret`` as for
    ``pallas_call`` (already resolved by the caller).
    """
    fb = blocks.clamp(spec.q_len, spec.kv_len)
    bq, bk = fb.block_q, fb.block_kv
    tq, tk = -(-spec.q_len // bq) * bq, -(-spec.kv_len // bk) * bk
    d = -(-spec.head_dim // LANES) * LANES
    nq = tq // bq
    qp, kp, vp = (to_kernel_layout(x, n, d) for x, n in ((q, tq), (k, tk), (v, tk)))

    overlap, segs = None, None
    if segment_ids is not None:
        segs = segment_layouts(segment_ids, tq, tk)
        overlap = schedule.segment_overlap(segs["q"], segs["kv"], bq, bk)
    sched = schedule.build_schedule(schedule.position_map(spec.mask, bq, bk, tq, tk), overlap)
    maps = schedule.forward_index_maps(sched, spec.group_size)

    in_specs = [pl.BlockSpec((None, None, bq, d), maps["q"]),
                pl.BlockSpec((None, None, bk, d), maps["kv"]),
                pl.BlockSpec((None, None, bk, d), maps["kv"])]
    operands = [qp, kp, vp]
    if segs is not None:
        in_specs += [pl.BlockSpec((None, bq, LANES), maps["q_segment"]),
                     pl.BlockSpec((None, SUBLANES, bk), maps["kv_segment"])]
        operands += [segs["q_col"], segs["kv_row"]]
    out_specs = [pl.BlockSpec((None, None, bq, d), maps["q"]),
                 pl.BlockSpec((None, None, bq, LANES), maps["q"])]
    out_shape = [jax.ShapeDtypeStruct((spec.batch, spec.num_q_heads, tq, d), q.dtype),
                 jax.ShapeDtypeStruct((spec.batch, spec.num_q_heads, tq, LANES), jnp.float32)]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(spec.batch, spec.num_q_heads, nq, sched.steps),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32),  # running max m
                        pltpu.VMEM((bq, LANES), jnp.float32),  # running sum l
                        pltpu.VMEM((bq, d), jnp.float32)],  # output accumulator
    )
    kernel = functools.partial(
        _forward_kernel, sched=sched, mask=spec.mask, scale=spec.scale, softcap=spec.softcap,
        block_q=bq, block_kv=bk, has_segments=segs is not None, precision=matmul_precision(q.dtype))
    itemsize = jnp.dtype(q.dtype).itemsize
    computed = spec.batch * spec.num_q_heads * sched.num_outer * sched.steps  # upper bound
    cost = pl.CostEstimate(flops=4 * computed * bq * bk * d, transcendentals=computed * bq * bk,
                           bytes_accessed=itemsize * (qp.size * 2 + kp.size + vp.size))
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=compat.compiler_params(("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        cost_estimate=cost,
        name="tpuattn_flash_forward",
    )(*sched.arrays(), *operands)
    out = jnp.swapaxes(out[:, :, : spec.q_len, : spec.head_dim], 1, 2)
    return out, lse[:, :, : spec.q_len, :2]


__all__ = ["forward", "pad_axis", "segment_layouts", "to_kernel_layout"]
