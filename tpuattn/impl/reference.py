"""Materialised attention: the teaching baseline.

It builds the whole ``[batch, heads, q_len, kv_len]`` score matrix, applies the
numerically stable softmax and multiplies by V. Memory grows with
``q_len * kv_len``; everything else in the package is measured against it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpuattn._checks import known_options
from tpuattn.impl.common import apply_softcap, matmul
from tpuattn.registry import register


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
    known_options("reference", options, ())
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


register("reference", reference_attention,
         description="materialised softmax over the full score matrix (the baseline)",
         # The last resort of impl="auto": it supports everything, at quadratic memory.
         auto_rank=lambda spec, backend: 9.0, schedule="materialised")
