"""Everything that differs between the JAX versions we support (0.7.2 and 0.10.2).

The kernels import Pallas names from here only. Kept small on purpose: when a new
JAX release moves something, this is the one file to touch.

* compiler parameters: ``pltpu.CompilerParams`` (>= 0.6.1) or ``pltpu.TPUCompilerParams`` (older);
* the VMEM memory space: ``pltpu.VMEM`` or ``pltpu.MemorySpace.VMEM`` (older: ``TPUMemorySpace``);
* the chip's VMEM size: ``pltpu.get_tpu_info()`` exists only from 0.8.1; before that a table by device kind;
* the TPU simulator's race flag: ``jax._src.pallas.mosaic.interpret.races`` (0.7.x, one module) or
  ``jax._src.pallas.mosaic.interpret.interpret_pallas_call.races`` (a package from 0.8).

Checked and found the same in 0.7.2 and 0.10.2 (so not wrapped): ``pl.BlockSpec(block_shape,
index_map, *, memory_space=...)`` with ``None`` for squeezed dimensions, ``pl.ANY``,
``pltpu.PrefetchScalarGridSpec(num_scalar_prefetch, grid, in_specs, out_specs, scratch_shapes)``,
``pltpu.InterpretParams(detect_races=...)``, and dimension semantics given as strings.
"""

from __future__ import annotations

import importlib

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

__all__ = [
    "ARBITRARY",
    "PARALLEL",
    "VMEM",
    "InterpretParams",
    "compiler_params",
    "force_tpu_interpret_mode",
    "pl",
    "pltpu",
    "race_state",
    "races_found",
    "reset_races",
    "vmem_capacity_bytes",
]

# --------------------------------------------------------------------------- compiler params
_CompilerParams = getattr(pltpu, "CompilerParams", None) or pltpu.TPUCompilerParams

# Grid dimension semantics: strings are accepted by every version we support.
PARALLEL = "parallel"
ARBITRARY = "arbitrary"


def compiler_params(dimension_semantics, vmem_limit_bytes: int | None = None):
    """Mosaic compiler parameters with the given grid dimension semantics."""
    kwargs = {"dimension_semantics": tuple(dimension_semantics)}
    if vmem_limit_bytes is not None:
        kwargs["vmem_limit_bytes"] = int(vmem_limit_bytes)
    return _CompilerParams(**kwargs)


# --------------------------------------------------------------------------- memory spaces
def _vmem():
    if hasattr(pltpu, "VMEM"):
        return pltpu.VMEM
    space = getattr(pltpu, "MemorySpace", None) or pltpu.TPUMemorySpace
    return space.VMEM


VMEM = _vmem()

# --------------------------------------------------------------------------- interpret mode
InterpretParams = getattr(pltpu, "InterpretParams", None)
force_tpu_interpret_mode = pltpu.force_tpu_interpret_mode


def simulator_params(detect_races: bool = True):
    """``pltpu.InterpretParams`` for the TPU simulator (race detection on by default)."""
    if InterpretParams is None:  # pragma: no cover - both supported versions have it
        raise RuntimeError(
            f"the TPU simulator (pltpu.InterpretParams) needs a newer JAX, got {jax.__version__}")
    return InterpretParams(detect_races=detect_races)


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


# --------------------------------------------------------------------------- chip facts
# VMEM per TensorCore by device kind, for JAX versions without ``pltpu.get_tpu_info``
# (values from the chips' public specifications, as JAX >= 0.8.1 tabulates them).
_MIB = 1024 * 1024
VMEM_BY_DEVICE_KIND = (
    ("v2", 16 * _MIB),
    ("v3", 16 * _MIB),
    ("v4", 16 * _MIB),
    ("v5 lite", 128 * _MIB),
    ("v5e", 128 * _MIB),
    ("v5p", 64 * _MIB),
    ("v5", 64 * _MIB),
    ("v6 lite", 128 * _MIB),
    ("v6e", 128 * _MIB),
    ("v7", 64 * _MIB),
    ("7x", 64 * _MIB),
)
# A chip we do not know (or no TPU at all): the smallest VMEM of any TPU generation.
DEFAULT_VMEM_BYTES = 16 * _MIB


def vmem_capacity_bytes(device=None) -> tuple[int, str]:
    """VMEM bytes per TensorCore and where the number came from.

    ``pltpu.get_tpu_info()`` when it exists (JAX >= 0.8.1) and the backend is a TPU; else a
    table by device kind; else the conservative 16 MiB default.
    """
    if device is None:
        device = jax.devices()[0]
    if device.platform == "tpu":
        get_info = getattr(pltpu, "get_tpu_info", None)
        if get_info is not None:
            try:
                return int(get_info().vmem_capacity_bytes), "pltpu.get_tpu_info()"
            except Exception:  # noqa: BLE001 - an unknown chip falls back to the table
                pass
        kind = device.device_kind.lower()
        for key, size in VMEM_BY_DEVICE_KIND:
            if key in kind:
                return size, f"table ({device.device_kind})"
    return DEFAULT_VMEM_BYTES, f"default (no TPU: {device.platform})"


def on_tpu() -> bool:
    return jax.default_backend() == "tpu"
