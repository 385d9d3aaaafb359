"""The custom VJP that ties the forward and backward kernels together, and the options."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from tpuattn import chips, softmax
from tpuattn._checks import known_options
from tpuattn.numerics import first_order_only
from tpuattn.pallas.backward import backward, row_sums
from tpuattn.pallas.blocks import BlockSizes, as_block_sizes
from tpuattn.pallas.forward import forward
from tpuattn.registry import PartialOps
from tpuattn.sharding import mark_varying, varying_axes
from tpuattn.spec import AttentionSpec

OPTIONS = ("block_sizes", "interpret")


def resolve_interpret(interpret) -> Any:
    """The ``interpret`` option -> the value handed to ``pallas_call``.

    * ``None`` (default): compiled for a TPU (the local one, or the chip of ``tpuattn.chips.target``),
      Pallas interpret mode (``True``) anywhere else;
    * ``True`` / ``False``: force interpret mode / compilation;
    * ``"simulate"``: the TPU simulator with race detection (``pltpu.InterpretParams(detect_races=True)``);
      read the verdict with :func:`tpuattn.pallas.races_found`;
    * a ``pltpu.InterpretParams`` instance: used as given.
    """
    if interpret is None:
        return chips.target_backend() != "tpu"
    if isinstance(interpret, bool):
        return interpret
    if interpret == "simulate":
        return pltpu.InterpretParams(detect_races=True)
    if isinstance(interpret, pltpu.InterpretParams):
        return interpret
    raise ValueError(
        f"interpret: expected None, True, False, 'simulate' or a pltpu.InterpretParams, got {interpret!r}"
    )


@dataclasses.dataclass(frozen=True)
class Config:
    """Static (hashable) arguments of one call."""

    spec: AttentionSpec
    blocks: BlockSizes
    interpret: Any


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, segment_ids, config):
    out, _ = forward(q, k, v, segment_ids, config.spec, config.blocks.forward, config.interpret)
    return out


SECOND_DERIVATIVE = ("impl='pallas' has no second derivatives: its backward kernels define only a "
                     "first-order VJP. Use impl='reference', 'blockwise' or 'xla' for grad-of-grad "
                     "(e.g. Hessian-vector products).")


def _flash_fwd(q, k, v, segment_ids, config):
    run = lambda q, k, v, segment_ids: forward(q, k, v, segment_ids, config.spec, config.blocks.forward,
                                               config.interpret)
    out, lse = first_order_only(run, SECOND_DERIVATIVE)(q, k, v, segment_ids)
    # Residuals: the inputs and two floats per query row; the backward needs no output.
    return out, (q, k, v, segment_ids, lse)


def _flash_bwd(config, residuals, d_out):
    q, k, v, segment_ids, lse = residuals
    run = lambda q, k, v, segment_ids, lse, d_out: backward(q, k, v, segment_ids, lse, d_out, config.spec,
                                                            config.blocks.backward, config.interpret)
    dq, dk, dv = first_order_only(run, SECOND_DERIVATIVE)(q, k, v, segment_ids, lse, d_out)
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def pallas_attention(q, k, v, segment_ids, spec, **options):
    """The ``impl="pallas"`` entry point (see :mod:`tpuattn.pallas` for the options)."""
    known_options("pallas", options, OPTIONS)
    blocks = as_block_sizes(options.get("block_sizes"), spec.head_dim, spec.dtype)
    interpret = resolve_interpret(options.get("interpret"))
    # Inside a shard_map every operand is typed varying over the same mesh axes, so that the
    # kernels' outputs can be typed like any one of them (compat.out_struct).
    axes = varying_axes(q, k, v, *(segment_ids or ()))
    q, k, v = (mark_varying(x, axes) for x in (q, k, v))
    if segment_ids is not None:
        segment_ids = tuple(mark_varying(s, axes) for s in segment_ids)
    return _flash(q, k, v, segment_ids, Config(spec, blocks, interpret))


# --------------------------------------------------------------------------- one block of many
def _block_call(q, k, v, segment_ids, spec, options, *rows):
    """Options resolved as :func:`pallas_attention` does, operands typed alike inside a shard_map."""
    known_options("pallas", options, OPTIONS)
    blocks = as_block_sizes(options.get("block_sizes"), spec.head_dim, spec.dtype)
    interpret = resolve_interpret(options.get("interpret"))
    arrays = (q, k, v, *(segment_ids or ()), *rows)
    axes = varying_axes(*arrays)
    arrays = [mark_varying(x, axes) for x in arrays]
    q, k, v = arrays[:3]
    segment_ids = None if segment_ids is None else tuple(arrays[3:5])
    return q, k, v, segment_ids, arrays[len(arrays) - len(rows):], blocks, interpret


# The kernels' edge: their row statistics are lanes (m, log l, seen) with (0, 0) for a row that saw
# nothing; everything outside speaks tpuattn.softmax.Partial (m = -inf, log l = 0 there).
def _lse_in(m, log_l):
    """Whole-row stats ``[b, h, q_len]`` (a :class:`~tpuattn.softmax.Partial`'s ``m``, ``log_l``) as
    the kernels' ``[b, h, q_len, 2]`` (a row that sees nothing: 0 and 0, as the forward writes it;
    its probabilities are masked to 0 anyway)."""
    seen = m != -jnp.inf
    return jnp.stack([jnp.where(seen, m, 0.0), jnp.where(seen, log_l, 0.0)], axis=-1)


def _partial_out(out, lanes) -> softmax.Partial:
    """The forward's float32 output and ``[b, h, q_len, 3]`` lanes ``(m, log l, seen)`` as a Partial."""
    seen = lanes[..., 2] > 0
    return softmax.Partial(out, jnp.where(seen, lanes[..., 0], -jnp.inf), jnp.where(seen, lanes[..., 1], 0.0))


def partial_forward(q, k, v, segment_ids, spec, **options):
    """This block's :class:`tpuattn.softmax.Partial`: the kernel accumulates in float32 and writes
    its output in float32, not rounded to the input dtype before the merge."""
    q, k, v, segment_ids, _, blocks, interpret = _block_call(q, k, v, segment_ids, spec, options)
    out, lanes = forward(q, k, v, segment_ids, spec, blocks.forward, interpret, seen=True,
                         out_dtype=jnp.float32)
    return _partial_out(out, lanes)


def partial_row_sums(q, k, v, segment_ids, spec, m, log_l, d_out, **options):
    q, k, v, segment_ids, (m, log_l, d_out), blocks, interpret = _block_call(
        q, k, v, segment_ids, spec, options, m, log_l, d_out)
    return row_sums(q, k, v, segment_ids, _lse_in(m, log_l), d_out.astype(q.dtype), spec, blocks.backward,
                    interpret)


def partial_backward(q, k, v, segment_ids, spec, m, log_l, d_out, delta, **options):
    q, k, v, segment_ids, (m, log_l, d_out, delta), blocks, interpret = _block_call(
        q, k, v, segment_ids, spec, options, m, log_l, d_out, delta)
    grads = backward(q, k, v, segment_ids, _lse_in(m, log_l), d_out.astype(q.dtype), spec, blocks.backward,
                     interpret, delta=delta)
    return tuple(g.astype(jnp.float32) for g in grads)


PARTIAL = PartialOps(forward=partial_forward, row_sums=partial_row_sums, backward=partial_backward)
