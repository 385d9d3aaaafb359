"""The custom VJP that ties the forward and backward kernels together, and the options."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from tpuattn._checks import known_options
from tpuattn.pallas import compat
from tpuattn.pallas.backward import backward
from tpuattn.pallas.blocks import BlockSizes, as_block_sizes
from tpuattn.pallas.forward import forward
from tpuattn.spec import AttentionSpec

OPTIONS = ("block_sizes", "interpret")


def resolve_interpret(interpret) -> Any:
    """The ``interpret`` option -> the value handed to ``pallas_call``.

    * ``None`` (default): compiled on a TPU, Pallas interpret mode (``True``) anywhere else;
    * ``True`` / ``False``: force interpret mode / compilation;
    * ``"simulate"``: the TPU simulator with race detection (``pltpu.InterpretParams(detect_races=True)``);
      read the verdict with :func:`tpuattn.pallas.races_found`;
    * a ``pltpu.InterpretParams`` instance: used as given.
    """
    if interpret is None:
        return not compat.on_tpu()
    if isinstance(interpret, bool):
        return interpret
    if interpret == "simulate":
        return compat.simulator_params(detect_races=True)
    if compat.InterpretParams is not None and isinstance(interpret, compat.InterpretParams):
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


def _flash_fwd(q, k, v, segment_ids, config):
    out, lse = forward(q, k, v, segment_ids, config.spec, config.blocks.forward, config.interpret)
    return out, (q, k, v, segment_ids, out, lse)


def _flash_bwd(config, residuals, d_out):
    q, k, v, segment_ids, out, lse = residuals
    dq, dk, dv = backward(q, k, v, segment_ids, out, lse, d_out, config.spec, config.blocks.backward,
                          config.interpret)
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def pallas_attention(q, k, v, segment_ids, spec, **options):
    """The ``impl="pallas"`` entry point (see :mod:`tpuattn.pallas` for the options)."""
    known_options("pallas", options, OPTIONS)
    blocks = as_block_sizes(options.get("block_sizes"), spec.head_dim, spec.dtype)
    interpret = resolve_interpret(options.get("interpret"))
    return _flash(q, k, v, segment_ids, Config(spec, blocks, interpret))
