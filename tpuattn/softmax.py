"""The partial softmax: attention over a subset of the keys, and the one merge of such parts.

Attention over disjoint key sets (a ring step's block, a split-K decode chunk, a tile of the
online softmax) is computed part by part, and the parts are merged exactly afterwards. Every part
of the package meets here, in one type with one convention:

:class:`Partial` ``(out, m, log_l)``, all float32:

* ``out`` ``[batch, q_len, heads, head_dim]``: the part's softmax-weighted mean of its values
  (normalised by its own row sum);
* ``m`` ``[batch, heads, q_len]``: the row's shift, the largest logit the part saw (what the
  implementations hand over; :func:`merge` takes any finite shift, e.g. :func:`from_lse`'s, the
  logsumexp itself with ``log_l = 0``);
* ``log_l`` ``[batch, heads, q_len]``: the log of the row sum of ``exp(s - m)``, so that the row's
  logsumexp is ``m + log_l``. Kept as two terms: with logits near 1e4, float32 ``m + log_l`` would
  drop the low bits of ``log_l``, and ``s - m`` is exact where ``s`` is.

A row that saw no key is ``out = 0``, ``m = -inf``, ``log_l = 0`` (:func:`empty`), and weighs
nothing in a merge. :func:`merge` of any number of parts is the attention over the union of their
keys. Kernels keep their own lane layouts (e.g. ``(m, log l, seen)`` in 128-lane tiles) and convert
at their edge; everything above a kernel sees only :class:`Partial`.

This module imports only JAX: it is part of the facts layer, below the specs and the kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Partial(NamedTuple):
    """Attention over some of the keys (see the module docstring for shapes and the convention).

    A named tuple, so a JAX pytree (it goes through ``jit``, ``lax.switch``, loops, ``shard_map``
    and autodiff as it is) and unpacks as ``out, m, log_l = part``.
    """

    out: jax.Array  # [batch, q_len, heads, head_dim] float32, zeros where the row saw nothing
    m: jax.Array  # [batch, heads, q_len] float32, -inf where the row saw nothing
    log_l: jax.Array  # [batch, heads, q_len] float32, 0 where the row saw nothing


def empty(batch: int, q_len: int, heads: int, head_dim: int) -> Partial:
    """The partial result of attending to no key: zeros, ``m = -inf``, ``log_l = 0``.

    (Inside a ``shard_map``, type its arrays as varying over the mesh axes of the inputs before
    carrying it through a loop: the caller knows them, this module does not.)
    """
    stats = (batch, heads, q_len)
    return Partial(jnp.zeros((batch, q_len, heads, head_dim), jnp.float32),
                   jnp.full(stats, -jnp.inf, jnp.float32), jnp.zeros(stats, jnp.float32))


def _to_out(x):
    """Row values ``[..., heads, q_len]`` broadcastable against ``out [..., q_len, heads, head_dim]``."""
    return jnp.swapaxes(x, -1, -2)[..., None]


def from_lse(out, lse) -> Partial:
    """A :class:`Partial` from an output ``[batch, q_len, heads, head_dim]`` and its logsumexp
    ``[batch, heads, q_len]`` (``-inf``: the row saw no key; its output is taken as 0)."""
    out, lse = jnp.asarray(out, jnp.float32), jnp.asarray(lse, jnp.float32)
    _check_one("out", "lse", out, lse)
    seen = lse != -jnp.inf
    return Partial(jnp.where(_to_out(seen), out, 0.0), lse, jnp.zeros_like(lse))


def to_lse(part: Partial):
    """The row logsumexp ``m + log_l`` ``[batch, heads, q_len]`` (``-inf`` for a row that saw no key)."""
    return jnp.where(part.m == -jnp.inf, -jnp.inf, part.m + part.log_l)


def _check_one(out_name: str, stats_name: str, out, *stats) -> None:
    if out.ndim != 4:
        raise ValueError(f"{out_name}: expected [batch, q_len, heads, head_dim], got shape {out.shape}")
    b, t, h, _ = out.shape
    for x in stats:
        if x.shape != (b, h, t):
            raise ValueError(f"{stats_name}: expected shape [batch, heads, q_len] = {(b, h, t)} to match "
                             f"{out_name} {out.shape}, got {x.shape}")


def merge(*parts: Partial) -> Partial:
    """The :class:`Partial` of the union of the parts' key sets (which must be disjoint).

    Each part weighs in with its row sum ``exp(m_i + log_l_i)``, rescaled to the largest shift,
    so nothing overflows (logits of 1e4 are fine) and the two terms stay separate (no precision is
    lost to ``m + log_l``); a part whose row saw nothing weighs 0, and a row no part saw comes out
    as :func:`empty`'s. Differentiable, and traceable anywhere (``jit``, loops, ``shard_map``).
    """
    if not parts:
        raise ValueError("parts: expected at least one softmax.Partial, got none")
    for i, part in enumerate(parts):
        if not isinstance(part, tuple) or len(part) != 3:
            raise ValueError(f"parts[{i}]: expected a softmax.Partial (out, m, log_l), got "
                             f"{type(part).__name__}")
    parts = [Partial(*(jnp.asarray(x, jnp.float32) for x in part)) for part in parts]
    for i, part in enumerate(parts):
        _check_one(f"parts[{i}].out", f"parts[{i}].m and .log_l", *part)
        if part.out.shape != parts[0].out.shape:
            raise ValueError(f"parts[{i}].out: expected the shape of parts[0].out {parts[0].out.shape}, "
                             f"got {part.out.shape}")
    m_all = jnp.stack([p.m for p in parts])  # [n, b, H, T]
    # The merged shift: the largest part's (0 where no part saw anything, so that -inf - 0 = -inf
    # and no -inf - -inf = NaN appears, in the values or in the gradients).
    m = jnp.max(m_all, axis=0)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    # Each part's log row sum relative to the merged shift: moderate numbers, exact differences.
    x = (m_all - m_safe) + jnp.stack([p.log_l for p in parts])  # -inf for a part that saw nothing
    top = jnp.max(x, axis=0)
    top_safe = jnp.where(top == -jnp.inf, 0.0, top)
    w = jnp.exp(x - top_safe)  # <= 1: no overflow, whatever log_l is
    total = jnp.sum(w, axis=0)
    seen = total != 0  # NaN stays NaN (a NaN among the keys reaches the output)
    denom = jnp.where(seen, total, 1.0)
    out = sum(_to_out(w[i]) * p.out for i, p in enumerate(parts)) / _to_out(denom)
    return Partial(out, jnp.where(seen, m, -jnp.inf), jnp.where(seen, top_safe + jnp.log(denom), 0.0))


__all__ = ["Partial", "empty", "from_lse", "merge", "to_lse"]
