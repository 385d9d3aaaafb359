"""The custom VJP that ties the forward and backward kernels together, and the options."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from tpuattn import options as typed_options
from tpuattn import softmax
from tpuattn.numerics import first_order_only
from tpuattn.options import PALLAS_BACKWARDS, PallasOptions
from tpuattn.pallas.backward import backward, row_sums
from tpuattn.pallas.blocks import BlockSizes, blocks_for_spec
from tpuattn.pallas.forward import forward
from tpuattn.registry import PartialOps
from tpuattn.sharding import mark_varying, varying_axes
from tpuattn.spec import AttentionSpec

OPTIONS = PallasOptions  # blocks=, backward=, interpret=; old block_q=, block_kv=, block_sizes=
BACKWARDS = PALLAS_BACKWARDS
"""The ``backward`` option: where the backward's ``delta`` (one float per query row) comes from.

* ``"exact"`` (default): ``rowsum(P * dP)`` from a pass of its own over the visible tiles (two
  matmuls each), the very tiles the dQ and dK/dV kernels then use -- 9 matmuls per visible tile;
* ``"fast"``: ``rowsum(dO * O)`` in float32 outside the kernels, ``O`` being the forward kernel's
  float32 output (saved as a residual, not the output rounded to the input dtype) -- 7 matmuls per
  visible tile, one float32 ``O`` more to keep between forward and backward.

``benchmarks/backward_accuracy.py`` measures both against the float64 oracle.
"""


def resolve_backward(backward) -> str:
    """The ``backward`` option -> ``"exact"`` or ``"fast"`` (``None``: ``"exact"``)."""
    if backward is None:
        return "exact"
    if isinstance(backward, str) and backward in BACKWARDS:
        return backward
    raise ValueError(f"backward: expected one of {BACKWARDS} (or None for 'exact'), got {backward!r}")


def resolve_interpret(interpret) -> Any:
    """The ``interpret`` option -> the value handed to ``pallas_call`` (the package's one rule,
    :func:`tpuattn.options.resolve_interpret`, with the simulator's values):

    * ``None`` (default): compiled for a TPU (the local one, or the chip of ``tpuattn.chips.target``),
      Pallas interpret mode (``True``) anywhere else;
    * ``True`` / ``False``: force interpret mode / compilation;
    * ``"simulate"``: the TPU simulator with race detection (``pltpu.InterpretParams(detect_races=True)``);
      read the verdict with :func:`tpuattn.pallas.races_found`;
    * a ``pltpu.InterpretParams`` instance: used as given.
    """
    return typed_options.resolve_interpret(interpret, "pallas", simulate=True)


@dataclasses.dataclass(frozen=True)
class Config:
    """Static (hashable) arguments of one call."""

    spec: AttentionSpec
    blocks: BlockSizes
    interpret: Any
    backward: str = "exact"


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, segment_ids, config):
    out, _ = forward(q, k, v, segment_ids, config.spec, config.blocks.forward, config.interpret)
    return out


SECOND_DERIVATIVE = ("impl='pallas' has no second derivatives: its backward kernels define only a "
                     "first-order VJP. Use impl='reference', 'blockwise' or 'xla' for grad-of-grad "
                     "(e.g. Hessian-vector products).")


def _flash_fwd(q, k, v, segment_ids, config):
    fast = config.backward == "fast"
    run = lambda q, k, v, segment_ids: forward(q, k, v, segment_ids, config.spec, config.blocks.forward,
                                               config.interpret, out_dtype=jnp.float32 if fast else None)
    out, lse = first_order_only(run, SECOND_DERIVATIVE)(q, k, v, segment_ids)
    if not fast:
        # Residuals: the inputs and two floats per query row; the exact backward needs no output.
        return out, (q, k, v, segment_ids, lse, None)
    # The fast backward's delta = rowsum(dO * O) reads the kernel's float32 output, before rounding.
    return out.astype(q.dtype), (q, k, v, segment_ids, lse, out)


def fast_delta(out, d_out):
    """``rowsum(dO * O)`` ``[b, h, q_len]`` float32 from contract-layout ``out`` and ``d_out``."""
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [b, q_len, h]
    return jnp.swapaxes(delta, 1, 2)


def _flash_bwd(config, residuals, d_out):
    q, k, v, segment_ids, lse, out = residuals
    delta = None if out is None else fast_delta(out, d_out)
    run = lambda q, k, v, segment_ids, lse, d_out, delta: backward(
        q, k, v, segment_ids, lse, d_out, config.spec, config.blocks.backward, config.interpret, delta=delta)
    dq, dk, dv = first_order_only(run, SECOND_DERIVATIVE)(q, k, v, segment_ids, lse, d_out, delta)
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def pallas_attention(q, k, v, segment_ids, spec, **options):
    """The ``impl="pallas"`` entry point (see :mod:`tpuattn.pallas` for the options,
    :class:`tpuattn.options.PallasOptions` for their record)."""
    chosen = PallasOptions.parse(options)
    blocks = blocks_for_spec(chosen.blocks, spec)
    interpret = resolve_interpret(chosen.interpret)
    which = resolve_backward(chosen.backward)
    # Inside a shard_map every operand is typed varying over the same mesh axes, so that the
    # kernels' outputs can be typed like any one of them (compat.out_struct).
    axes = varying_axes(q, k, v, *(segment_ids or ()))
    q, k, v = (mark_varying(x, axes) for x in (q, k, v))
    if segment_ids is not None:
        segment_ids = tuple(mark_varying(s, axes) for s in segment_ids)
    return _flash(q, k, v, segment_ids, Config(spec, blocks, interpret, which))


# --------------------------------------------------------------------------- one block of many
def _block_call(q, k, v, segment_ids, spec, options, *rows):
    """Options resolved as :func:`pallas_attention` does, operands typed alike inside a shard_map.

    ``backward`` is validated and otherwise unused: a block of a larger problem (the ring, sinks)
    gets its delta from :func:`partial_row_sums`, always ``rowsum(P * dP)``, since only the caller
    holds the whole row's output."""
    chosen = PallasOptions.parse(options)
    blocks = blocks_for_spec(chosen.blocks, spec)
    interpret = resolve_interpret(chosen.interpret)
    arrays = (q, k, v, *(segment_ids or ()), *rows)
    axes = varying_axes(*arrays)
    arrays = [mark_varying(x, axes) for x in arrays]
    q, k, v = arrays[:3]
    segment_ids = None if segment_ids is None else tuple(arrays[3:5])
    return q, k, v, segment_ids, arrays[len(arrays) - len(rows):], blocks, interpret


# The kernels' edge: their row statistics are rows (m, log l, seen) with (0, 0) for a row that saw
# nothing; everything outside speaks tpuattn.softmax.Partial (m = -inf, log l = 0 there).
def _lse_in(m, log_l):
    """Whole-row stats ``[b, h, q_len]`` (a :class:`~tpuattn.softmax.Partial`'s ``m``, ``log_l``) as
    the kernels' ``[b, h, 2, q_len]`` (a row that sees nothing: 0 and 0, as the forward writes it;
    its probabilities are masked to 0 anyway)."""
    seen = m != -jnp.inf
    return jnp.stack([jnp.where(seen, m, 0.0), jnp.where(seen, log_l, 0.0)], axis=2)


def _partial_out(out, stats) -> softmax.Partial:
    """The forward's float32 output and ``[b, h, 3, q_len]`` rows ``(m, log l, seen)`` as a Partial."""
    seen = stats[:, :, 2] > 0
    m, log_l = stats[:, :, 0], stats[:, :, 1]
    return softmax.Partial(out, jnp.where(seen, m, -jnp.inf), jnp.where(seen, log_l, 0.0))


# The partial operations are differentiated once by their callers' custom VJPs (tpuattn.sinks, the
# ring); a second derivative differentiates the kernels themselves, refused with SECOND_DERIVATIVE
# (without the guard, pallas_call's bare NotImplementedError('')).
def partial_forward(q, k, v, segment_ids, spec, **options):
    """This block's :class:`tpuattn.softmax.Partial`: the kernel accumulates in float32 and writes
    its output in float32, not rounded to the input dtype before the merge."""
    q, k, v, segment_ids, _, blocks, interpret = _block_call(q, k, v, segment_ids, spec, options)
    run = lambda q, k, v, segment_ids: forward(q, k, v, segment_ids, spec, blocks.forward, interpret,
                                               seen=True, out_dtype=jnp.float32)
    return _partial_out(*first_order_only(run, SECOND_DERIVATIVE)(q, k, v, segment_ids))


def partial_row_sums(q, k, v, segment_ids, spec, m, log_l, d_out, **options):
    q, k, v, segment_ids, (m, log_l, d_out), blocks, interpret = _block_call(
        q, k, v, segment_ids, spec, options, m, log_l, d_out)
    run = lambda q, k, v, segment_ids, lse, d_out: row_sums(q, k, v, segment_ids, lse, d_out, spec,
                                                            blocks.backward, interpret)
    return first_order_only(run, SECOND_DERIVATIVE)(q, k, v, segment_ids, _lse_in(m, log_l),
                                                    d_out.astype(q.dtype))


def partial_backward(q, k, v, segment_ids, spec, m, log_l, d_out, delta, **options):
    q, k, v, segment_ids, (m, log_l, d_out, delta), blocks, interpret = _block_call(
        q, k, v, segment_ids, spec, options, m, log_l, d_out, delta)
    run = lambda q, k, v, segment_ids, lse, d_out, delta: backward(q, k, v, segment_ids, lse, d_out, spec,
                                                                   blocks.backward, interpret, delta=delta)
    grads = first_order_only(run, SECOND_DERIVATIVE)(q, k, v, segment_ids, _lse_in(m, log_l),
                                                     d_out.astype(q.dtype), delta)
    return tuple(g.astype(jnp.float32) for g in grads)


PARTIAL = PartialOps(forward=partial_forward, row_sums=partial_row_sums, backward=partial_backward)
