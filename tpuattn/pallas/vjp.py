"""The custom VJP that ties the forward and backward kernels together, and the options."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax.experimental.pallas import tpu as pltpu

from tpuattn import chips
from tpuattn._checks import known_options
from tpuattn.impl.common import first_order_only, mark_varying, varying_axes
from tpuattn.pallas.backward import backward
from tpuattn.pallas.blocks import BlockSizes, as_block_sizes
from tpuattn.pallas.forward import forward
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
