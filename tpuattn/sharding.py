"""Typing arrays inside ``shard_map``: which mesh axes a value varies over, across JAX versions.

JAX 0.7 spells the varying axes ``typeof(x).vma`` and ``lax.pvary``; JAX 0.10 spells them
``typeof(x).manual_axis_type.varying`` and ``lax.pcast(..., to="varying")``. Kernels run inside
``shard_map`` (ring attention, JAX's splash kernel under a mesh) type their results with these.
"""

from __future__ import annotations

import jax


def varying_axes(*arrays) -> tuple[str, ...]:
    """The mesh axes any of ``arrays`` varies over inside a ``shard_map`` (empty outside one).

    JAX 0.10 reads them from ``typeof(x).manual_axis_type.varying``, JAX 0.7 from ``typeof(x).vma``.
    """
    axes = set()
    for x in arrays:
        aval = jax.typeof(x)
        manual = getattr(aval, "manual_axis_type", None)
        axes |= set(manual.varying if manual is not None else getattr(aval, "vma", ()) or ())
    return tuple(sorted(axes))


def mark_varying(x, axes: tuple[str, ...]):
    """``x`` typed as varying over ``axes`` (``lax.pcast(..., to="varying")`` or 0.7's ``lax.pvary``)."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)


def vma_checks_off():
    """A context in which shard_map's varying-axes checks are off (for kernels we do not own whose
    ``pallas_call`` gives no varying axes for its outputs; :func:`mark_varying` restores them)."""
    from jax._src import config

    return config._check_vma(False)
