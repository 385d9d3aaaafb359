"""What differs between the JAX versions decode runs on (0.7.2 and 0.10.2), and nothing else.

Checked the same in both (used directly): ``pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=...)``,
``pl.BlockSpec`` with ``None`` for squeezed dimensions, ``pl.CostEstimate``,
``jax.experimental.pallas.ops.tpu.paged_attention.paged_attention`` and
``...ops.tpu.ragged_paged_attention.ragged_paged_attention`` (same arguments), and
``pltpu.force_tpu_interpret_mode`` (present in both; wrapped so that a JAX without it reports the
native kernels unavailable instead of failing at import).
"""

from __future__ import annotations

import contextlib
import importlib.util

from jax.experimental.pallas import tpu as pltpu


def has_module(name: str) -> bool:
    """True when ``name`` imports on this JAX."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def has_interpret_mode() -> bool:
    """True when JAX's own TPU kernels can run off a TPU (``pltpu.force_tpu_interpret_mode``)."""
    return hasattr(pltpu, "force_tpu_interpret_mode")


def force_tpu_interpret_mode() -> contextlib.AbstractContextManager:
    """``pltpu.force_tpu_interpret_mode()``: JAX's TPU kernels (with their own DMAs) interpreted on CPU."""
    return pltpu.force_tpu_interpret_mode()

