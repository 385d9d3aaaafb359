"""An independent float64 NumPy oracle for decode over a KV cache (imports nothing from tpuattn).

Written from the contract's text: sequence ``b`` holds ``lengths[b]`` valid positions; position ``j`` is,
for a paged cache, row ``j % page_size`` of page ``page_table[b, j // page_size]``. Query ``t`` of
``q_len`` sits at position ``lengths[b] - q_len + t`` and sees the keys ``j`` with ``j < lengths[b]``,
``j <= position`` and, with a window ``(left, right)`` (an int ``w`` means ``(w, w)``),
``position - left <= j <= position + right``. Logits are ``scale * q.k`` (default ``1/sqrt(d)``), then
``softcap * tanh(s / softcap)``; a row that sees no key is zeros. Query head ``h`` reads kv head
``h // (heads // kv_heads)``.
"""

from __future__ import annotations

import numpy as np


def sequence_cache(cache, b, length, page_table=None):
    """Float64 ``[length, kv_heads, d]``: the first ``length`` positions of sequence ``b``."""
    cache = np.asarray(cache, np.float64)
    if page_table is None:
        return cache[b, :length]
    page_size = cache.shape[1]
    rows = [cache[int(page_table[b, j // page_size]), j % page_size] for j in range(length)]
    return np.stack(rows) if rows else np.zeros((0, *cache.shape[2:]))


def _allowed(length, q_len, window):
    pos = length - q_len + np.arange(q_len)[:, None]
    j = np.arange(length)[None, :]
    ok = j <= pos
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        if left is not None:
            ok &= j >= pos - left
        if right is not None:
            ok &= j <= pos + right
    return ok


def softmax_rows(logits, allowed, sink=None):
    """Softmax over the allowed entries of each row (float64); rows with none give zeros, and the
    logsumexp (``-inf`` for such rows). ``sink``: one more logit in every row's denominator, with
    no value (its mass is left out of the weights returned)."""
    masked = np.where(allowed, logits, -np.inf)
    if masked.shape[-1]:
        top = masked.max(axis=-1, keepdims=True)
    else:
        top = np.full(masked.shape[:-1] + (1,), -np.inf)
    if sink is not None:
        top = np.maximum(top, sink)
    top_safe = np.where(np.isfinite(top), top, 0.0)
    w = np.where(allowed, np.exp(masked - top_safe), 0.0)
    total = w.sum(axis=-1, keepdims=True)
    if sink is not None:
        total = total + np.exp(sink - top_safe)
    with np.errstate(divide="ignore"):
        lse = (top_safe + np.log(total))[..., 0]
    return w / np.where(total > 0, total, 1.0), lse


def oracle_decode(q, k_cache, v_cache, lengths, *, page_table=None, scale=None, window=None, softcap=None,
                  sinks=None):
    """Float64 output ``[batch, q_len, heads, d]`` (``sinks``: one logit per query head, no value)."""
    q = np.asarray(q, np.float64)
    batch, q_len, heads, d = q.shape
    kv_heads = np.asarray(k_cache).shape[2]
    group = heads // kv_heads
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    out = np.zeros(q.shape)
    for b in range(batch):
        length = int(lengths[b])
        k = sequence_cache(k_cache, b, length, page_table)
        v = sequence_cache(v_cache, b, length, page_table)
        allowed = _allowed(length, q_len, window)
        for h in range(heads):
            s = scale * q[b, :, h] @ k[:, h // group].T
            if softcap is not None:
                s = softcap * np.tanh(s / softcap)
            w, _ = softmax_rows(s, allowed, None if sinks is None else float(sinks[h]))
            out[b, :, h] = w @ v[:, h // group]
    return out


def oracle_partial(q_rows, k_rows, v_rows, allowed, scale):
    """One chunk's ``(softmax-normalised output, logsumexp)`` for rows ``q_rows [r, d]`` against
    ``k_rows, v_rows [n, d]`` with ``allowed [r, n]`` (float64)."""
    w, lse = softmax_rows(scale * np.asarray(q_rows, np.float64) @ np.asarray(k_rows, np.float64).T, allowed)
    return w @ np.asarray(v_rows, np.float64), lse


def dequantized(cache, scale=None):
    """Float64 ``cache * scale`` with ``scale`` a scalar or one per kv head (axis -2); as is if None."""
    cache = np.asarray(cache).astype(np.float64)
    if scale is None:
        return cache
    scale = np.asarray(scale, np.float64).reshape(-1)
    return cache * (scale[:, None] if scale.size > 1 else scale[0])


def oracle_ragged_decode(q, k_cache, v_cache, lengths, cu_q_lens, *, num_seqs=None, page_table=None,
                         k_scale=None, v_scale=None, scale=None, window=None, softcap=None, sinks=None):
    """Float64 output ``[total_tokens, heads, d]`` of a ragged batch, sequence by sequence.

    Sequence ``i < num_seqs`` (default: all) owns rows ``cu_q_lens[i] .. cu_q_lens[i + 1] - 1`` of ``q``:
    its ``n`` new queries are the last ``n`` of its ``lengths[i]`` positions (the dense oracle above with
    one sequence and ``q_len = n``). Every other row is zeros. The caches are dequantized first
    (``entry * scale`` of the entry's kv head)."""
    q = np.asarray(q, np.float64)
    k, v = dequantized(k_cache, k_scale), dequantized(v_cache, v_scale)
    cu = [int(x) for x in np.asarray(cu_q_lens)]
    live = len(cu) - 1 if num_seqs is None else int(np.asarray(num_seqs).reshape(-1)[0])
    out = np.zeros(q.shape)
    for i in range(live):
        start, stop = cu[i], cu[i + 1]
        if stop == start:
            continue
        if page_table is None:
            ki, vi, table = k[i:i + 1], v[i:i + 1], None
        else:
            ki, vi, table = k, v, np.asarray(page_table)[i:i + 1]
        out[start:stop] = oracle_decode(q[None, start:stop], ki, vi, [int(lengths[i])], page_table=table,
                                        scale=scale, window=window, softcap=softcap, sinks=sinks)[0]
    return out
