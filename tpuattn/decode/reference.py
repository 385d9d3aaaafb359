"""``impl="reference"``: dequantize, gather the pages into a contiguous cache, mask, materialised softmax
in float32."""

from __future__ import annotations

import jax.numpy as jnp

from tpuattn.decode.registry import register
from tpuattn.numerics import apply_softcap, matmul
from tpuattn.options import DecodeReferenceOptions


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


def reference_decode(q, k_cache, v_cache, lengths, page_table, spec, *, sinks=None, cu_q_lens=None,
                     num_seqs=None, k_scale=None, v_scale=None, **options):
    """Dequantize (``entry * scale`` in float32) and gather first, then one materialised softmax.

    A ragged batch is served as a dense one of ``total_tokens`` sequences of one query each: token
    ``t`` of sequence ``i``, at position ``p``, is a query of length ``p + 1`` over sequence ``i``'s
    cache (its own copy: memory ``total_tokens x capacity``, a reference's price for simplicity)."""
    DecodeReferenceOptions.parse(options)
    if k_scale is not None:
        k_cache, v_cache = dequantize(k_cache, k_scale), dequantize(v_cache, v_scale)
    if spec.paged:
        k_cache, v_cache = gather_cache(k_cache, page_table), gather_cache(v_cache, page_table)
    if not spec.ragged:
        return _dense(q, k_cache, v_cache, lengths, spec, sinks)
    seq, position, live = token_positions(cu_q_lens, lengths, q.shape[0])
    token_lengths = jnp.where(live, jnp.maximum(position + 1, 0), 0)
    out = _dense(q[:, None], k_cache[seq], v_cache[seq], token_lengths, spec, sinks)
    return out[:, 0]


def dequantize(cache, scale):
    """``cache [..., kv_heads, d]`` as float32 ``entry * scale[kv head]`` (``scale``: float32
    ``[kv_heads]``)."""
    return cache.astype(jnp.float32) * scale.astype(jnp.float32)[:, None]


def token_positions(cu_q_lens, lengths, total_tokens: int):
    """Per row of a ragged ``q``: its sequence, its position in that sequence (``lengths[i] - q_len[i]
    + t`` for its ``t``-th token; negative before position 0) and whether it is live (not padding)."""
    cu_q_lens, lengths = jnp.asarray(cu_q_lens), jnp.asarray(lengths)
    rows = jnp.arange(total_tokens)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, rows, side="right") - 1, 0, lengths.shape[0] - 1)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    position = lengths[seq] - q_lens[seq] + rows - cu_q_lens[seq]
    return seq, position, rows < cu_q_lens[-1]


def _dense(q, k_cache, v_cache, lengths, spec, sinks):
    """The dense form over contiguous caches ``[b, capacity, kv_heads, d]``."""
    b, tq, h, d = q.shape
    hk, g = spec.num_kv_heads, spec.group_size
    keep = visible(lengths, tq, k_cache.shape[1], spec.left)  # [b, tq, S]
    qg = q.reshape(b, tq, hk, g, d)
    if k_cache.dtype != q.dtype:  # dequantized: float32
        qg = qg.astype(jnp.float32)
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
         takes_ragged=True, takes_scales=True, options=DecodeReferenceOptions,
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
