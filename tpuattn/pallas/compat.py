"""What differs between the JAX versions we support (0.7.2 and 0.10.2), and nothing else.

* an output's varying mesh axes inside a ``shard_map``: ``ShapeDtypeStruct(..., manual_axis_type=)``
  (0.10) or ``ShapeDtypeStruct(..., vma=)`` (0.7);
* the TPU simulator's race flag: ``jax._src.pallas.mosaic.interpret.races`` (0.7.x, one module) or
  ``jax._src.pallas.mosaic.interpret.interpret_pallas_call.races`` (a package from 0.8);
* a lane rotation of 16-bit data: Mosaic before JAX 0.10 rotates 32-bit data only in some of the
  kernels' rolls ("not implemented: Rotate with non-32-bit data": the paired forward on 0.7.2, the
  paired backward of 8 heads of 64 on 0.7.2, 0.8.3 and 0.9.2); 0.10.2 rotates any
  (:func:`roll_lanes`);
* which Mosaic serialization version a compile-only TPU program carries: JAX picks it from the backend
  it lowers for, by the libtpu build date that backend reports; libtpu 0.0.21.1 (Colab's) reports a
  build of 2025-08-25, after JAX 0.7.2's cut-off for version 8, yet reads up to 7 ("Unsupported
  version: expected <= 7 but got 8"). :func:`match_installed_libtpu` asks the installed libtpu what it
  reads, once, and lowers for that;
* whether a compile-only device may be asked its default layout: after compiling, JAX asks the
  device's client for each argument's default layout (only to choose how to pass arguments when the
  program runs), and with libtpu 0.0.21.1 that query crashes the process (a segmentation fault in
  ``PjRtTopology::GetDefaultLayout``, JAX 0.7.2, Python 3.11 and 3.13). A compile-only program never
  runs, so :func:`match_installed_libtpu` has JAX skip the query for compile-only devices.

* none yet, but named here: :data:`INTERPRETER_READS_VARYING_TABLES`;
* which of JAX's own TPU kernels the installed JAX ships, and whether it can interpret them off a TPU
  (:func:`has_module`, :func:`has_interpret_mode`, :func:`force_tpu_interpret_mode`: present in both
  versions, wrapped so that a JAX without them reports :mod:`tpuattn.decode.native`'s kernels
  unavailable instead of failing at import).

Checked and found the same in 0.7.2 and 0.10.2 (so used directly, not wrapped):
``pltpu.CompilerParams(dimension_semantics=...)`` with strings, ``pltpu.VMEM``,
``pltpu.PrefetchScalarGridSpec`` (``num_scalar_prefetch=``), ``pl.BlockSpec`` with ``None`` for
squeezed dimensions, ``pl.CostEstimate``, ``pltpu.InterpretParams(detect_races=...)``, and
``jax.experimental.pallas.ops.tpu.paged_attention.paged_attention`` and
``...ops.tpu.ragged_paged_attention.ragged_paged_attention`` (the same arguments).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import re

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


# libtpu releases that read older Mosaic serializations than the build date they report leads JAX to
# write (seen here with match_installed_libtpu's probe: libtpu 0.0.21.1, Colab's TPU runtime's, reports
# a build of 2025-08-25 and reads up to version 7, while JAX 0.7.2 writes 8 for builds after
# 2025-08-14). With one of them installed, every lowering in the process is held to what it reads from
# the start -- on a real TPU too, where no compile-only device is made to ask. tests/test_aot_libtpu.py
# holds this table to the probe (in the compile stages and in the colab stage, on libtpu 0.0.21.1).
KNOWN_LIBTPU_READS = {"0.0.21.1": 7}
# The newest Mosaic serialization version lowering may write in this process (None: JAX's own choice),
# and whether the probe has run.
_LIBTPU_READS: dict[str, int | None] = {"version": None}
_PROBED: list[bool] = []
_UNSUPPORTED_VERSION = re.compile(r"Unsupported version: expected <= (\d+) but got (\d+)")


def mosaic_version_refused(message: str) -> int | None:
    """The newest Mosaic serialization version a libtpu's refusal says it reads, or None if ``message``
    is not such a refusal."""
    found = _UNSUPPORTED_VERSION.search(message)
    return int(found.group(1)) if found else None


def installed_libtpu() -> str | None:
    """The installed libtpu's version, or None without one."""
    from importlib import metadata

    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return None


def _hold_lowering_to(reads: int | None) -> None:
    """Every Mosaic lowering from now on writes at most version ``reads`` (None: JAX's own choice)."""
    from jax._src import tpu_custom_call

    _LIBTPU_READS["version"] = reads
    original = getattr(tpu_custom_call, "get_ir_version", None)
    if original is None or getattr(original, "tpuattn_held", False):
        return  # a JAX that no longer chooses this way, or held already (the value above is read)

    def get_ir_version(ctx):
        chosen = original(ctx)  # None: the newest JAX writes
        held = _LIBTPU_READS["version"]
        return held if held is not None and (chosen is None or chosen > held) else chosen

    get_ir_version.tpuattn_held = True
    tpu_custom_call.get_ir_version = get_ir_version


# The name of the one-tile copy kernel the package compiles to ask the compiler a question (what it
# reads, whether it works at all): the static reports leave it out of a dump's kernels.
PROBE_KERNEL_NAME = "tpuattn_probe_copy"


def probe_argument(sharding=None) -> jax.ShapeDtypeStruct:
    """The probe kernel's one argument (and its output's shape): one float32 (8, 128) tile."""
    return jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=sharding)


def probe_kernel():
    """A one-tile copy (:func:`probe_argument`) as a ``pallas_call``, its kernel named
    :data:`PROBE_KERNEL_NAME`."""
    from jax.experimental import pallas as pl

    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    copy.__name__ = copy.__qualname__ = PROBE_KERNEL_NAME
    return pl.pallas_call(copy, out_shape=probe_argument())


def match_installed_libtpu(device) -> int | None:
    """Make Mosaic lowering emit the serialization version the installed libtpu reads, as it says.

    ``device`` is a compile-only TPU device (``jax.experimental.topologies``). The first call compiles
    a one-tile copy kernel for it with JAX's own choice of version; if libtpu refuses the version,
    every later Mosaic lowering in this process for which JAX would choose a newer version gets the
    newest the refusal names instead (the process has one libtpu). Returns that version (None: JAX's
    own choice compiles).
    """
    _skip_layout_query_off_device()
    if _PROBED:
        return _LIBTPU_READS["version"]
    _PROBED.append(True)
    known = _LIBTPU_READS["version"]
    _hold_lowering_to(None)  # while probing, JAX chooses

    tile = probe_argument(jax.sharding.SingleDeviceSharding(device))
    try:
        jax.jit(probe_kernel()).lower(tile).compile()
        reads = None
    except Exception as error:  # noqa: BLE001 - JAX's runtime error class differs between versions
        reads = mosaic_version_refused(str(error))
        if reads is None:  # another failure: the real compile will report it; keep what was known
            reads = known
    _hold_lowering_to(reads)
    return reads


def _compile_only(sharding) -> bool:
    devices = getattr(sharding, "_device_assignment", None) or ()
    return bool(devices) and type(devices[0].client).__name__.startswith("CompileOnly")


def _skip_layout_query_off_device() -> None:
    """Answer JAX's "is this argument's layout the default?" without asking a compile-only client.

    JAX asks after every compile, to pass arguments to the program when it runs; a compile-only program
    never runs, so "default" (the answer that needs nothing more) is safe, and the query itself crashes
    libtpu 0.0.21.1's compile-only client. Devices with a runtime are asked as before.
    """
    from jax._src.interpreters import pxla

    original = pxla.is_default_layout
    if getattr(original, "tpuattn_compile_only", False):
        return

    def is_default_layout(layout, sharding, aval):
        if layout is not None and _compile_only(sharding):
            return True
        return original(layout, sharding, aval)

    is_default_layout.tpuattn_compile_only = True
    pxla.is_default_layout = is_default_layout


_KNOWN_READS = KNOWN_LIBTPU_READS.get(installed_libtpu() or "")
if _KNOWN_READS is not None:
    _hold_lowering_to(_KNOWN_READS)
