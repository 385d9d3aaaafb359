"""Attention sinks: one learned logit per query head that takes softmax mass and adds no value.

With sinks ``z`` (``[num_q_heads]``), row ``i`` of head ``h`` weighs its visible keys by
``exp(s_ij) / (exp(z_h) + sum_j exp(s_ij))``: the sink sits in the denominator only, so a row can
give most of its attention to "nothing" instead of to the first token (Xiao et al., *Efficient
Streaming Language Models with Attention Sinks*, 2023, https://arxiv.org/abs/2309.17453; as a
learned per-head logit in OpenAI's gpt-oss, https://github.com/openai/gpt-oss). The sink is a logit
of the final score space (after ``scale`` and ``softcap``, which it does not pass through), and a
row that sees no key gives it all the mass: its output is zeros, as without sinks.

In the package's partial-softmax seam the sink is *one more part*: attention over no value with row
max ``z_h`` and row sum 1, i.e. :class:`tpuattn.softmax.Partial` ``(0, z_h, 0)``. Merged with the
keys' partial (:func:`tpuattn.softmax.merge`) it gives the sink's softmax exactly, so every
implementation that returns partial results (its :class:`~tpuattn.registry.PartialOps`) takes sinks
without a change to its kernels. The backward reads the merged statistics, which hold the sink:

* ``P`` of the keys comes from the merged ``(m, log l)``, so the sink is in its denominator;
* ``delta = rowsum(P * dP)`` over the keys (the sink's ``dP`` is 0: it has no value);
* ``dz_h = -sum over batch and rows of p_sink * delta``, with ``p_sink = exp(z_h - lse)``.

Inside a user's ``shard_map`` the sinks are usually replicated (``P()``) while q, k and v vary over
mesh axes (the batch's, say): each device's rows give their own share of ``dz``. :func:`attention`
types the sinks as varying like q, k and v before its custom VJP, so the transpose of that cast sums
the shares over those axes (a ``psum``) and the gradient is the whole batch's, typed as its input.

This module imports only JAX, :mod:`tpuattn.softmax` and :mod:`tpuattn.sharding`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tpuattn import softmax
from tpuattn.sharding import mark_varying, varying_axes


def sink_partial(sinks, batch: int, q_len: int, head_dim: int) -> softmax.Partial:
    """The sink as a :class:`~tpuattn.softmax.Partial`: no value, row max ``z_h``, row sum 1
    (``sinks`` ``[heads]``; a head whose sink is ``-inf`` weighs nothing, as if it had none)."""
    z = jnp.asarray(sinks, jnp.float32)
    heads = z.shape[0]
    m = jnp.broadcast_to(z[None, :, None], (batch, heads, q_len))
    return softmax.Partial(jnp.zeros((batch, q_len, heads, head_dim), jnp.float32), m,
                           jnp.zeros((batch, heads, q_len), jnp.float32))


def sink_probability(sinks, part: softmax.Partial):
    """``p_sink = exp(z_h - lse)`` ``[batch, heads, q_len]`` for merged statistics that include the
    sink (0 where the sink is ``-inf``)."""
    z = jnp.asarray(sinks, jnp.float32)[None, :, None]
    seen = jnp.logical_and(part.m != -jnp.inf, z != -jnp.inf)
    # exp((z - m) - log l): the two terms stay apart, as everywhere in the seam.
    return jnp.where(seen, jnp.exp((z - jnp.where(seen, part.m, 0.0)) - part.log_l), 0.0)


def sink_gradient(sinks, m, log_l, delta):
    """``dz_h = -sum over batch and rows of p_sink * delta`` (``[heads]``, float32) from the merged
    statistics ``m``, ``log_l`` and the rows' ``delta = rowsum(P * dP)``, all ``[batch, heads, q_len]``."""
    p_sink = sink_probability(sinks, softmax.Partial(None, m, log_l))
    return -jnp.sum(p_sink * delta, axis=(0, 2))


def partial_backward(sinks, m, log_l, row_sums, gradients):
    """The backward of attention made of partial results, whatever holds the keys (one kernel call
    here, a ring of blocks in :mod:`tpuattn.parallel.ring`): ``(dq, dk, dv, d_sinks)``.

    ``m``, ``log_l``: the merged statistics of the whole row (the sink's part in them, when there are
    sinks). ``row_sums()`` -> ``delta = rowsum(P * dP)`` ``[batch, heads, q_len]``, summed over every
    block of the row; ``gradients(delta)`` -> ``(dq, dk, dv)`` summed over the blocks. The sink has no
    value, so it adds nothing to either: its gradient is apart, :func:`sink_gradient` of the same
    ``delta`` (None without sinks)."""
    delta = row_sums()
    dq, dk, dv = gradients(delta)
    return dq, dk, dv, (None if sinks is None else sink_gradient(sinks, m, log_l, delta))


def attention(ops, q, k, v, segment_ids, spec, sinks, **options):
    """Attention with ``sinks`` through an implementation's :class:`~tpuattn.registry.PartialOps`
    (``ops``): differentiable in ``q``, ``k``, ``v`` and ``sinks``; an array of q's shape and dtype."""
    config = (ops, spec, tuple(sorted(options.items())))
    # Replicated sinks inside a user's shard_map: typed varying like q, k, v (see the module
    # docstring), so their per-device gradients are summed, not one device's returned.
    sinks = mark_varying(jnp.asarray(sinks, jnp.float32), varying_axes(q, k, v))
    return _with_sinks(q, k, v, segment_ids, sinks, config)


def _forward(q, k, v, segment_ids, sinks, config):
    ops, spec, options = config
    b, t, h, d = q.shape
    keys = ops.forward(q, k, v, segment_ids, spec, **dict(options))
    merged = softmax.merge(keys, sink_partial(sinks, b, t, d))
    return merged.out.astype(q.dtype), merged


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _with_sinks(q, k, v, segment_ids, sinks, config):
    return _forward(q, k, v, segment_ids, sinks, config)[0]


def _with_sinks_fwd(q, k, v, segment_ids, sinks, config):
    out, merged = _forward(q, k, v, segment_ids, sinks, config)
    return out, (q, k, v, segment_ids, sinks, merged.m, merged.log_l)


def _with_sinks_bwd(config, residuals, d_out):
    ops, spec, options = config
    q, k, v, segment_ids, sinks, m, log_l = residuals
    dq, dk, dv, d_sinks = partial_backward(
        sinks, m, log_l,
        row_sums=lambda: ops.row_sums(q, k, v, segment_ids, spec, m, log_l, d_out, **dict(options)),
        gradients=lambda delta: ops.backward(q, k, v, segment_ids, spec, m, log_l, d_out, delta,
                                             **dict(options)))
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, d_sinks)


_with_sinks.defvjp(_with_sinks_fwd, _with_sinks_bwd)

__all__ = ["attention", "partial_backward", "sink_gradient", "sink_partial", "sink_probability"]
