"""Materialised attention: the teaching baseline.

It builds the whole ``[batch, heads, q_len, kv_len]`` score matrix, applies the
numerically stable softmax and multiplies by V. Memory grows with
``q_len * kv_len``; everything else in the package is measured against it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpuattn import softmax
from tpuattn.numerics import apply_softcap, matmul
from tpuattn.options import ReferenceOptions
from tpuattn.registry import PartialOps, register


def scores(q, k, spec):
    """Logits ``[batch, kv_heads, group, q_len, kv_len]`` in float32, softcap applied."""
    b, tq, h, d = q.shape
    qg = q.reshape(b, tq, spec.num_kv_heads, spec.group_size, d)
    s = matmul("bqhgd,bkhd->bhgqk", qg, k)
    return apply_softcap(s * spec.scale, spec.softcap)


def visibility(segment_ids, spec):
    """Boolean mask broadcastable to the scores: ``[batch or 1, 1, 1, q_len, kv_len]``."""
    keep = spec.mask.dense(*(segment_ids or (None, None)), xp=jnp)
    return keep[None, None, None] if segment_ids is None else keep[:, None, None]


def reference_attention(q, k, v, segment_ids, spec, **options):
    """Softmax over the full score matrix; rows that see no key return zeros."""
    ReferenceOptions.parse(options)
    s = scores(q, k, spec)
    keep = visibility(segment_ids, spec)
    s = jnp.where(keep, s, -jnp.inf)
    # The max only shifts the exponent: stop its gradient (softmax is invariant to it)
    # and replace -inf (a row that sees nothing) by 0 so exp(-inf - 0) = 0, not NaN.
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    # P in v's dtype for the second matmul, as the flash kernels do.
    out = matmul("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v)
    return out.reshape(q.shape).astype(q.dtype)


# ----------------------------------------------------------------------------- one block of many
def _block_probabilities(q, k, segment_ids, spec, m, log_l):
    """``P`` of this block under the whole row's stats ``(m, log_l)`` ``[b, H, Tq]``, and the softcap's
    derivative ``1 - tanh^2`` (None without one); shapes ``[b, hkv, g, Tq, Tk]``."""
    b, tq, hq, d = q.shape
    qg = q.reshape(b, tq, spec.num_kv_heads, spec.group_size, d)
    s = matmul("bqhgd,bkhd->bhgqk", qg, k) * spec.scale
    slope = None
    if spec.softcap is not None:
        t = jnp.tanh(s / spec.softcap)
        s, slope = spec.softcap * t, 1.0 - t * t
    rows = lambda x: x.reshape(b, spec.num_kv_heads, spec.group_size, tq)[..., None]
    # Only m = -inf means "saw nothing"; a NaN or +inf row max (a NaN key, a NaN or infinite sink)
    # makes the row's P NaN, as its output is, so the gradients are NaN too, never silently finite.
    keep = jnp.logical_and(visibility(segment_ids, spec), rows(m) != -jnp.inf)
    return jnp.where(keep, jnp.exp((s - jnp.where(keep, rows(m), 0.0)) - rows(log_l)), 0.0), slope


def _partial_forward(q, k, v, segment_ids, spec, **options):
    """This block's :class:`tpuattn.softmax.Partial` (a row that sees nothing: ``m = -inf``, zeros)."""
    ReferenceOptions.parse(options)
    b, tq, hq, _ = q.shape
    s = jnp.where(visibility(segment_ids, spec), scores(q, k, spec), -jnp.inf)
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)[..., None])
    denom = jnp.sum(p, axis=-1)
    out = matmul("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v) / jnp.where(denom > 0, denom, 1.0).transpose(
        0, 3, 1, 2)[..., None]
    rows = lambda x: x.reshape(b, hq, tq)
    return softmax.Partial(out.reshape(q.shape).astype(jnp.float32), rows(m),
                           rows(jnp.log(jnp.where(denom > 0, denom, 1.0))))


def _partial_row_sums(q, k, v, segment_ids, spec, m, log_l, d_out, **options):
    ReferenceOptions.parse(options)
    p, _ = _block_probabilities(q, k, segment_ids, spec, m, log_l)
    b, tq, hq, d = q.shape
    dp = matmul("bqhgd,bkhd->bhgqk", d_out.reshape(b, tq, spec.num_kv_heads, spec.group_size, d), v)
    return jnp.sum(p * dp, axis=-1).reshape(b, hq, tq)


def _partial_backward(q, k, v, segment_ids, spec, m, log_l, d_out, delta, **options):
    ReferenceOptions.parse(options)
    p, slope = _block_probabilities(q, k, segment_ids, spec, m, log_l)
    b, tq, hq, d = q.shape
    group = lambda x: x.reshape(b, tq, spec.num_kv_heads, spec.group_size, d)
    do = group(d_out)
    dv = matmul("bhgqk,bqhgd->bkhd", p.astype(q.dtype), do)
    dp = matmul("bqhgd,bkhd->bhgqk", do, v)
    ds = p * (dp - delta.reshape(b, spec.num_kv_heads, spec.group_size, tq)[..., None])
    if slope is not None:
        ds = ds * slope
    dq = matmul("bhgqk,bkhd->bqhgd", ds, k) * spec.scale
    dk = matmul("bhgqk,bqhgd->bkhd", ds, group(q)) * spec.scale
    return dq.reshape(q.shape), dk, dv


register("reference", reference_attention, partial=PartialOps(_partial_forward, _partial_row_sums,
                                                              _partial_backward),
         description="materialised softmax over the full score matrix (the baseline)",
         # The last resort of impl="auto": it supports everything, at quadratic memory.
         auto_rank=lambda spec, backend: 9.0, schedule="materialised", options=ReferenceOptions)
