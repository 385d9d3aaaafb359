"""Small helpers shared by the implementations."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def matmul_precision(dtype):
    """Full float32 matmuls for float32 inputs (TPUs default to bf16 passes); native otherwise."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def apply_softcap(s, softcap):
    """``softcap * tanh(s / softcap)``, or ``s`` unchanged when softcap is None."""
    return s if softcap is None else softcap * jnp.tanh(s / softcap)


def check_options(impl: str, options: dict, allowed: tuple[str, ...]) -> None:
    """Raise a clear error for an option the implementation does not take."""
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"{impl}: unknown option(s) {unknown}; expected a subset of {sorted(allowed)}")


def check_block(name: str, value, *, multiple_of: int = 1) -> int:
    """Validate a block size option: a positive int, a multiple of ``multiple_of``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if value % multiple_of:
        raise ValueError(f"{name}: expected a multiple of {multiple_of}, got {value}")
    return value
