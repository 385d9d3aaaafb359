"""Quantized KV caches: one-byte entries with a float32 scale, and the paged write that stores them.

:func:`quantize` makes ``int8`` or ``float8_e4m3fn`` entries of new keys or values with a scale, and
:func:`write` stores them into a paged cache (what a server calls each step).

An entry ``e`` of a quantized cache stands for ``e * scale`` (float32) of its kv head: ``scale`` is one
float32 for the whole tensor or one per kv head (``[kv_heads]``), the ``k_scale`` / ``v_scale`` of
:func:`tpuattn.decode.attention`. Scales are fixed per cache (computed once, from calibration data or a
first prefill, by :func:`quantize` without ``scale``), so a write never rescales what is stored:

* ``int8``: ``e = clip(round(x / scale), -127, 127)`` (symmetric: -128 is not used); a scale from
  :func:`quantize` is ``max |x| / 127``, so the rounding error is at most ``scale / 2`` per entry;
* ``float8_e4m3fn``: ``e = clip(x / scale, -448, 448)`` rounded to nearest (3 mantissa bits: a relative
  error up to ``2**-4``); a scale from :func:`quantize` is ``max |x| / 448``.

A scale of 0 stores zeros. NaN stays NaN in fp8 and becomes 0 in int8 (which has none); an infinity
saturates to the largest entry.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from tpuattn.decode.spec import QUANTIZED_DTYPES
from tpuattn.errors import TpuattnError

# The largest entry of each quantized dtype (symmetric int8: 127).
QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


def _quantized_dtype(dtype, name: str) -> str:
    dtype = jnp.dtype(dtype).name
    if dtype not in QUANTIZED_DTYPES:
        raise TypeError(f"{name}: expected a quantized dtype in {list(QUANTIZED_DTYPES)}, got {dtype}")
    return dtype


def quantize(x, dtype, *, scale=None, per: str = "head"):
    """``(entries, scale)``: ``x [..., kv_heads, head_dim]`` as ``dtype`` entries and float32 scales.

    ``scale`` None: computed from ``x``, ``max |x| / QMAX[dtype]`` per kv head (``per="head"``, a
    ``[kv_heads]`` scale) or over the whole tensor (``per="tensor"``, a scalar); 1 where ``x`` is all
    zeros. Given (float32 ``[]`` or ``[kv_heads]``): used as it is (a cache's fixed scale).
    """
    dtype = _quantized_dtype(dtype, "dtype")
    x = jnp.asarray(x)
    if x.ndim < 2:
        raise TpuattnError(f"x: expected [..., kv_heads, head_dim], got shape {x.shape}")
    x32 = x.astype(jnp.float32)
    if scale is None:
        if per not in ("head", "tensor"):
            raise TpuattnError(f"per: expected 'head' or 'tensor', got {per!r}")
        finite = jnp.where(jnp.isfinite(x32), jnp.abs(x32), 0.0)
        axes = tuple(i for i in range(x.ndim) if i != x.ndim - 2) if per == "head" else None
        amax = jnp.max(finite, axis=axes)
        scale = jnp.where(amax > 0, amax / QMAX[dtype], 1.0).astype(jnp.float32)
    else:
        scale = jnp.asarray(scale, jnp.float32)
        if scale.shape not in ((), (1,), (x.shape[-2],)):
            raise TpuattnError(f"scale: expected shape () or ({x.shape[-2]},) (kv_heads), got {scale.shape}")
    return store(x32, scale, dtype), scale


def store(x, scale, dtype):
    """``x / scale`` (float32, ``scale`` broadcast over the kv-head axis) as ``dtype`` entries: rounded
    and clipped to ``[-QMAX, QMAX]``; zeros where the scale is 0."""
    dtype = jnp.dtype(dtype)
    scale = jnp.asarray(scale, jnp.float32)
    scale = scale[:, None] if scale.ndim == 1 else scale
    y = jnp.where(scale > 0, x.astype(jnp.float32) / jnp.where(scale > 0, scale, 1.0), 0.0)
    if dtype.name not in QMAX:  # a float cache: stored as it is
        return y.astype(dtype)
    y = jnp.clip(y, -QMAX[dtype.name], QMAX[dtype.name])  # an infinity saturates; NaN stays NaN
    if dtype.name == "int8":
        y = jnp.where(jnp.isnan(y), 0.0, jnp.round(y))
    return y.astype(dtype)


def write(pages, new, page_table, positions, *, seq=None, scale=None):
    """``pages`` with rows ``new [n, kv_heads, head_dim]`` stored at ``positions [n]`` of sequences
    ``seq [n]`` (default ``range(n)``: one row per sequence, a decode step), through ``page_table
    [batch, pages_per_sequence]``: position ``j`` of sequence ``b`` is row ``j % page_size`` of page
    ``page_table[b, j // page_size]``.

    ``pages [num_pages, page_size, kv_heads, head_dim]`` of a quantized dtype takes ``scale`` (the
    cache's fixed ``k_scale`` or ``v_scale``) and the rows are quantized (:func:`store`); a float cache
    takes the rows cast to its dtype (divided by ``scale`` when given). Rows at a position outside
    ``[0, capacity)`` are not written (padding tokens), so one call serves a ragged batch of new tokens.
    """
    pages, new = jnp.asarray(pages), jnp.asarray(new)
    if pages.ndim != 4:
        raise TpuattnError(f"pages: expected [num_pages, page_size, kv_heads, head_dim], got shape "
                           f"{pages.shape}")
    if new.ndim != 3 or new.shape[1:] != pages.shape[2:]:
        raise TpuattnError(f"new: expected [n, {pages.shape[2]}, {pages.shape[3]}] (rows of the pages' kv "
                           f"heads and head_dim), got shape {new.shape}")
    quantized = pages.dtype.name in QUANTIZED_DTYPES
    if quantized and scale is None:
        raise TpuattnError(f"scale: expected the cache's float32 scale ([] or [kv_heads]) for {pages.dtype} "
                           "pages, got None")
    n = new.shape[0]
    positions = jnp.asarray(positions)
    seq = jnp.arange(n) if seq is None else jnp.asarray(seq)
    for name, x in (("positions", positions), ("seq", seq)):
        if x.shape != (n,) or not np.issubdtype(np.dtype(x.dtype), np.integer):
            raise TpuattnError(f"{name}: expected integers of shape ({n},) (one per new row), got {x.dtype} "
                               f"of shape {x.shape}")
    page_table = jnp.asarray(page_table, jnp.int32)
    size = pages.shape[1]
    capacity = size * page_table.shape[1]
    ok = (positions >= 0) & (positions < capacity) & (seq >= 0) & (seq < page_table.shape[0])
    slot = jnp.clip(positions, 0, capacity - 1)
    page = jnp.where(ok, page_table[jnp.clip(seq, 0, page_table.shape[0] - 1), slot // size], pages.shape[0])
    rows = new if scale is None and not quantized else store(new, scale, pages.dtype)
    return pages.at[page, slot % size].set(rows.astype(pages.dtype), mode="drop")
