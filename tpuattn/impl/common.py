"""Numerics shared by the implementations: matmul precision and the logit soft-cap."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def matmul_precision(dtype):
    """Full float32 matmuls for float32 inputs (TPUs default to bf16 passes); native otherwise."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def apply_softcap(s, softcap):
    """``softcap * tanh(s / softcap)``, or ``s`` unchanged when softcap is None."""
    return s if softcap is None else softcap * jnp.tanh(s / softcap)


def long_enough_for_flash(spec) -> bool:
    """At least one 128-row query tile and 512 keys: below that a flash kernel pads most of its tile."""
    return spec.q_len >= 128 and spec.kv_len >= 512


def pad_to_multiple(x, axis: int, multiple: int, value=0):
    """Pad ``x`` along ``axis`` at the end, with ``value``, to a multiple of ``multiple``."""
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)
