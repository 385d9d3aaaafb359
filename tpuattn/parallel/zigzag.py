"""The zigzag sequence layout: permute once at data loading, shard contiguously, balanced causal work.

With ``n`` devices the sequence is cut into ``2n`` equal chunks and reordered
``0, 2n-1, 1, 2n-2, ..., n-1, n``, so that a contiguous split gives device ``d`` the chunks ``d``
and ``2n-1-d``: one early and one late chunk each, whose causal work adds up to the same on every
device (the load balancing of Llama 3's context parallelism; Striped Attention, Brandon et al.
2023, stripes single tokens instead).
"""

from __future__ import annotations

import numpy as np

from tpuattn._checks import positive_int


def zigzag_order(n: int) -> np.ndarray:
    """Chunk ids in zigzag order for ``n`` devices (``2n`` chunks)."""
    n = positive_int("n", n)
    return np.stack([np.arange(n), 2 * n - 1 - np.arange(n)], axis=1).reshape(-1)


def _permute_chunks(x, n: int, axis: int, order: np.ndarray, name: str):
    length = x.shape[axis]
    if length % (2 * n):
        raise ValueError(f"{name}: expected a length divisible by 2 * n = {2 * n} along axis {axis} "
                         f"(two chunks per device), got {length}")
    chunk = length // (2 * n)
    index = (order[:, None] * chunk + np.arange(chunk)[None, :]).reshape(-1)
    import jax.numpy as jnp

    xp = np if isinstance(x, np.ndarray) else jnp
    return xp.take(x, index, axis=axis)


def to_zigzag(x, n: int, axis: int = 1):
    """``x`` (natural order along ``axis``) in zigzag order for ``n`` devices: shard it contiguously."""
    return _permute_chunks(x, n, axis, zigzag_order(n), "x")


def from_zigzag(x, n: int, axis: int = 1):
    """The inverse of :func:`to_zigzag`: zigzag order back to natural order."""
    return _permute_chunks(x, n, axis, np.argsort(zigzag_order(n)), "x")
