"""``impl="reference"``: gather the pages into a contiguous cache, mask, materialised softmax in float32."""

from __future__ import annotations

import jax.numpy as jnp

from tpuattn._checks import known_options
from tpuattn.decode.registry import register
from tpuattn.numerics import apply_softcap, matmul


def gather_cache(cache, page_table):
    """A paged cache ``[num_pages, page_size, kv_heads, d]`` as ``[batch, capacity, kv_heads, d]``."""
    pages = cache[page_table]  # [batch, pages_per_sequence, page_size, kv_heads, d]
    b, n, p, h, d = pages.shape
    return pages.reshape(b, n * p, h, d)


def visible(lengths, q_len: int, capacity: int, left: int | None):
    """Boolean ``[batch, q_len, capacity]``: may query ``t`` of sequence ``b`` see key ``j``?"""
    pos = lengths[:, None, None] - q_len + jnp.arange(q_len)[None, :, None]
    j = jnp.arange(capacity)[None, None, :]
    keep = (j < lengths[:, None, None]) & (j <= pos)
    if left is not None:
        keep &= j >= pos - left
    return keep


def reference_decode(q, k_cache, v_cache, lengths, page_table, spec, *, sinks=None, **options):
    known_options("reference", options, ())
    if spec.paged:
        k_cache, v_cache = gather_cache(k_cache, page_table), gather_cache(v_cache, page_table)
    b, tq, h, d = q.shape
    hk, g = spec.num_kv_heads, spec.group_size
    keep = visible(lengths, tq, spec.capacity, spec.left)  # [b, tq, S]
    qg = q.reshape(b, tq, hk, g, d)
    # Non-finite values reach exactly the rows that see them (the decode contract's rule): a logit
    # that is not finite (a NaN or Inf in k or q) becomes NaN before the mask and the soft-cap (which
    # would turn an Inf into a finite logit), so a row that sees it is NaN and a row that does not
    # replaces it; V is read without its non-finite entries and they are put back as NaN, per column,
    # in the rows that see them (p @ v would spread 0 * NaN to every row).
    s = matmul("btkgd,bskd->bkgts", qg, k_cache) * spec.scale
    s = apply_softcap(jnp.where(jnp.isfinite(s), s, jnp.nan), spec.softcap)
    mask = keep[:, None, None]
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:  # one more logit per head in the denominator, with no value
        z = jnp.asarray(sinks, jnp.float32).reshape(1, hk, g, 1, 1)
        m = jnp.maximum(m, z)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    total = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        total = total + jnp.exp(z - m)
    p = p / jnp.where(total == 0, 1.0, total)
    out = matmul("bkgts,bskd->btkgd", p, clean_values(v_cache))
    return poison_values(out, keep, v_cache).reshape(b, tq, h, d).astype(q.dtype)


def clean_values(v):
    """``v`` in float32 with its non-finite entries replaced by 0."""
    v = v.astype(jnp.float32)
    return jnp.where(jnp.isfinite(v), v, 0.0)


def poison_values(out, keep, v):
    """``out [b, tq, kv_heads, group, d]`` NaN where a row sees a non-finite ``v`` in that column:
    ``keep [b, tq, S]`` (float) times ``v``'s non-finite indicator ``[b, S, kv_heads, d]``."""
    bad = jnp.where(jnp.isfinite(v), 0.0, 1.0)
    hits = matmul("bts,bskd->btkd", jnp.where(keep, 1.0, 0.0), bad)
    return jnp.where(hits[:, :, :, None] > 0, jnp.nan, out)


register("reference", reference_decode,
         description="gather pages, mask, materialised float32 softmax (jax.numpy, XLA)", takes_sinks=True,
         auto_rank=lambda spec, backend: 0.0 if backend != "tpu" else 10.0)


def plain_decode(q, k_cache, v_cache, lengths):
    """The straightforward decode a benchmark compares against (not registered): ``q_len`` 1, a
    contiguous cache ``[B, S, Hk, D]``, every slot scored and masked by ``lengths``, softmax by
    ``jax.nn.softmax``; a sequence of length 0 gives zeros. No window, no softcap, scale 1/sqrt(D)."""
    import jax

    b, _, h, d = q.shape
    group = h // k_cache.shape[2]
    s = jnp.einsum("bkgd,bskd->bkgs", q[:, 0].reshape(b, -1, group, d), k_cache, precision="highest")
    s = s / jnp.sqrt(jnp.float32(d))
    valid = jnp.arange(k_cache.shape[1])[None, None, None] < lengths[:, None, None, None]
    p = jax.nn.softmax(jnp.where(valid, s, -jnp.inf), axis=-1)
    p = jnp.where(lengths[:, None, None, None] > 0, p, 0.0)
    return jnp.einsum("bkgs,bskd->bkgd", p, v_cache, precision="highest").reshape(b, 1, h, d)
