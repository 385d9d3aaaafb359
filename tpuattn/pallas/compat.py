"""What differs between the JAX versions we support (0.7.2 and 0.10.2), and nothing else.

* an output's varying mesh axes inside a ``shard_map``: ``ShapeDtypeStruct(..., manual_axis_type=)``
  (0.10) or ``ShapeDtypeStruct(..., vma=)`` (0.7);
* the TPU simulator's race flag: ``jax._src.pallas.mosaic.interpret.races`` (0.7.x, one module) or
  ``jax._src.pallas.mosaic.interpret.interpret_pallas_call.races`` (a package from 0.8);
* a lane rotation of 16-bit data: Mosaic before JAX 0.10 rotates 32-bit data only in some of the
  kernels' rolls ("not implemented: Rotate with non-32-bit data": the paired forward on 0.7.2, the
  paired backward of 8 heads of 64 on 0.7.2, 0.8.3 and 0.9.2); 0.10.2 rotates any
  (:func:`roll_lanes`).

* none yet, but named here: :data:`INTERPRETER_READS_VARYING_TABLES`.

Checked and found the same in 0.7.2 and 0.10.2 (so used directly, not wrapped):
``pltpu.CompilerParams(dimension_semantics=...)`` with strings, ``pltpu.VMEM``,
``pltpu.PrefetchScalarGridSpec``, ``pl.BlockSpec`` with ``None`` for squeezed dimensions,
``pltpu.InterpretParams(detect_races=...)`` and ``pltpu.force_tpu_interpret_mode``.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

# Mosaic rotates every 16-bit vector the kernels roll from JAX 0.10 on (checked for v5e: 0.7.2, 0.8.3
# and 0.9.2 refuse some; 0.10.2 compiles every kernel, tests/test_aot_pallas_gqa.py).
ROTATES_16_BIT = tuple(int(part) for part in jax.__version__.split(".")[:2]) >= (0, 10)


def out_struct(shape, dtype, like) -> jax.ShapeDtypeStruct:
    """A ``pallas_call`` output shape typed, inside a ``shard_map``, as varying like ``like``.

    With shard_map's default checks an output's varying mesh axes must be given (JAX cannot infer
    them through a kernel); outside a shard_map the field is empty, as for a plain struct.
    """
    aval = jax.typeof(like)
    if hasattr(aval, "manual_axis_type"):  # JAX >= 0.8
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=aval.manual_axis_type)
    return jax.ShapeDtypeStruct(shape, dtype, vma=getattr(aval, "vma", None))


def roll_lanes(x, shift: int):
    """``pltpu.roll`` of ``x`` by ``shift`` lanes (its last axis); narrower data rolled as float32
    (exact: a bfloat16 is a float32) where Mosaic rotates 32-bit data only."""
    if ROTATES_16_BIT or jnp.dtype(x.dtype).itemsize == 4:
        return pltpu.roll(x, shift, x.ndim - 1)
    return pltpu.roll(x.astype(jnp.float32), shift, x.ndim - 1).astype(x.dtype)


def race_state():
    """The simulator's race-detection state object, or None if no simulated run happened yet."""
    for name in ("jax._src.pallas.mosaic.interpret.interpret_pallas_call",  # >= 0.8 (a package)
                 "jax._src.pallas.mosaic.interpret"):  # 0.7.x (one module)
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "races"):
            return module.races
    return None


def races_found() -> bool:
    """True if the last simulated ``pallas_call`` with ``detect_races=True`` reported a data race."""
    state = race_state()
    return bool(state is not None and state.races_found)


def reset_races() -> None:
    """Forget earlier race reports (each simulated call also resets the state at its start)."""
    state = race_state()
    if state is not None:
        state.races_found = False


# JAX's Pallas interpreter (0.7.2 to 0.10.2) evaluates index maps at grid indices that vary over no
# mesh axis; inside ``shard_map`` a scalar-prefetch table that varies (built from a device's own
# segment ids) then fails to index ("dynamic_slice requires varying manual axes to match"). The
# compiled TPU kernel is unaffected. Set True for a JAX whose interpreter types the indices.
INTERPRETER_READS_VARYING_TABLES = False
