"""An independent float64 NumPy oracle for the attention contract.

Written separately from ``tpuattn`` on purpose: positions and masks are built
straight from the contract's text, softmax and its backward are written out per
(batch, head) in float64, nothing is imported from the package.
"""

from __future__ import annotations

import numpy as np


def _allowed(b, q_len, kv_len, causal, window, segment_ids):
    """Boolean [q_len, kv_len]: may query i (at key position i + kv_len - q_len) see key j?"""
    pos = np.arange(q_len)[:, None] + (kv_len - q_len)
    j = np.arange(kv_len)[None, :]
    ok = np.ones((q_len, kv_len), bool)
    if causal:
        ok &= j <= pos
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        if left is not None:
            ok &= j >= pos - left
        if right is not None:
            ok &= j <= pos + right
    if segment_ids is not None:
        if isinstance(segment_ids, tuple | list):
            q_seg, kv_seg = (np.asarray(s) for s in segment_ids)
        else:
            q_seg = kv_seg = np.asarray(segment_ids)
        ok &= q_seg[b][:, None] == kv_seg[b][None, :]
    return ok


def _prepare(q, k, v, scale):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    return q, k, v, scale


def _probs(logits_raw, allowed, softcap, sink=None):
    """Softmax over allowed keys (rows with none -> all zeros) and d(logit)/d(raw logit).

    With ``sink`` (a float: this head's sink logit, after scale and softcap, never capped), every
    row's denominator also holds ``exp(sink)``, which weighs no value; the sink's own probability
    per row is returned third (zeros without a sink)."""
    if softcap is not None:
        t = np.tanh(logits_raw / softcap)
        logits, dcap = softcap * t, 1.0 - t * t
    else:
        logits, dcap = logits_raw, np.ones_like(logits_raw)
    masked = np.where(allowed, logits, -np.inf)
    row_max = masked.max(axis=-1, keepdims=True)
    if sink is not None:
        row_max = np.maximum(row_max, sink)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    w = np.where(allowed, np.exp(masked - row_max), 0.0)
    total = w.sum(axis=-1, keepdims=True)
    w_sink = np.zeros_like(total) if sink is None else np.exp(sink - row_max)
    total = total + w_sink
    w = w / np.where(total > 0, total, 1.0)
    p_sink = w_sink / np.where(total > 0, total, 1.0)
    return w, dcap, p_sink[:, 0]


def _sink(sinks, h):
    return None if sinks is None else float(np.asarray(sinks, np.float64)[h])


def oracle_attention(q, k, v, *, causal=False, scale=None, segment_ids=None, window=None, softcap=None,
                     sinks=None):
    """Float64 attention output [batch, q_len, q_heads, head_dim] (``sinks``: one logit per query head
    in the softmax denominator, no value)."""
    q, k, v, scale = _prepare(q, k, v, scale)
    batch, q_len, q_heads, _ = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    out = np.zeros(q.shape)
    for b in range(batch):
        allowed = _allowed(b, q_len, kv_len, causal, window, segment_ids)
        for h in range(q_heads):
            kvh = h // group
            w, _, _ = _probs(scale * q[b, :, h] @ k[b, :, kvh].T, allowed, softcap, _sink(sinks, h))
            out[b, :, h] = w @ v[b, :, kvh]
    return out


def oracle_grads(q, k, v, d_out, *, causal=False, scale=None, segment_ids=None, window=None, softcap=None,
                 sinks=None):
    """Float64 gradients of ``sum(attention(q, k, v) * d_out)`` with respect to q, k and v (and, with
    ``sinks``, a fourth: with respect to the sinks)."""
    q, k, v, scale = _prepare(q, k, v, scale)
    d_out = np.asarray(d_out, np.float64)
    batch, q_len, q_heads, _ = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    d_sinks = np.zeros(q_heads)
    for b in range(batch):
        allowed = _allowed(b, q_len, kv_len, causal, window, segment_ids)
        for h in range(q_heads):
            kvh = h // group
            w, dcap, p_sink = _probs(scale * q[b, :, h] @ k[b, :, kvh].T, allowed, softcap, _sink(sinks, h))
            g = d_out[b, :, h]  # [q_len, d]
            dv[b, :, kvh] += w.T @ g
            dw = g @ v[b, :, kvh].T  # [q_len, kv_len]
            # The softmax's Jacobian over the keys and the sink; the sink's own dw is 0 (no value).
            mean_dw = (w * dw).sum(axis=-1, keepdims=True)
            dlogits = w * (dw - mean_dw)
            d_sinks[h] += np.sum(p_sink * (0.0 - mean_dw[:, 0]))
            draw = dlogits * dcap * scale
            dq[b, :, h] += draw @ k[b, :, kvh]
            dk[b, :, kvh] += draw.T @ q[b, :, h]
    return (dq, dk, dv) if sinks is None else (dq, dk, dv, d_sinks)
