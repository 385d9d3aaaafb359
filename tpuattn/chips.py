"""TPU chips: one table of what each generation has, and which chip the code is working for.

Everything that needs a chip fact reads it here: the Pallas kernels' VMEM budget, the roofline,
the compile reports. Two questions, one module:

* **What does a chip have?** :data:`CHIPS` holds, per chip (not per TensorCore), peak bf16
  FLOP/s, HBM bandwidth and capacity, and VMEM per TensorCore, as JAX itself tabulates them in
  ``jax/_src/pallas/mosaic/tpu_info.py`` (JAX 0.10.2; ``pltpu.get_tpu_info_for_chip`` from 0.8.1),
  which agree with Google Cloud's TPU pages (https://cloud.google.com/tpu/docs/system-architecture-tpu-vm,
  /tpu/docs/v4, /v5e, /v5p, /v6e, /tpu7x) up to their rounding, except v5p's HBM bandwidth (JAX: 2460
  GB/s; Cloud's v5p page: 2765 GB/s, the figure this table takes): the table is kept here so JAX 0.7.2,
  which has no ``get_tpu_info``, gets the same numbers. Capacities are bytes (v6e: 34.4e9 bytes =
  32 GiB; Cloud's "32 GB" page means GiB).
* **Which chip is the code for?** Normally the local device's (none off a TPU). Inside
  ``with target("v5e"):`` it is the named chip, even on a CPU machine: ahead-of-time compiles for
  a TPU topology (:mod:`tpuattn.measure.aot`) set it, so the kernels compile (not interpret), size
  their blocks for that chip's VMEM and refuse what that chip cannot do.

A JAX device is one TensorCore on v2, v3 and tpu7x (their two cores are separate devices) and a
whole chip on the megacore v4 and v5p; :meth:`Chip.per_device` gives the numbers of one device.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax

GIB = 1024**3
MIB = 1024**2


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU generation. FLOP/s, bandwidth, HBM and ICI are per chip; VMEM per TensorCore.

    Every *model* (:mod:`tpuattn.model`) works per JAX device instead, through :meth:`per_device`:
    a JAX device is the whole chip on v5e and v6e (one TensorCore) and on the megacore v4 and v5p
    (one device spans both TensorCores), and one TensorCore -- half the chip -- on v2, v3 and tpu7x
    (their two TensorCores are separate devices).
    """

    name: str  # "v5e"
    tensor_cores: int  # per chip
    megacore: bool  # True when a JAX device spans both TensorCores (v4, v5p)
    bf16_flops: float  # dense bf16 matmul FLOP/s per chip
    hbm_bandwidth: float  # bytes/s per chip
    hbm_bytes: float  # HBM capacity per chip
    vmem_bytes: int  # VMEM per TensorCore
    topology: str  # a compile-only topology name with this chip ("v5e:2x2")
    device_kinds: tuple[str, ...]  # jax.Device.device_kind strings of this chip
    bf16_matmul: bool = True  # Mosaic accepts bf16 matmul operands (not on v2/v3)
    kernel_vmem_bytes: int = 16 * MIB  # VMEM a Pallas kernel gets by default (see KERNEL_VMEM below)
    # Inter-chip interconnect: bidirectional bytes/s per chip and its ports, as Google Cloud states
    # them (None where this table does not carry them; see ICI below).
    ici_bandwidth: float | None = None
    ici_ports: int | None = None
    # The MXUs of one TensorCore and their side, as JAX's tpu_info table gives them (num_mxus,
    # mxu_column_size): with the peak they fix the clock (see clock_hz).
    mxus: int = 4
    mxu_size: int = 128

    @property
    def clock_hz(self) -> float:
        """The TensorCore clock the peak implies: ``bf16 FLOP/s per TensorCore / (2 x mxus x mxu_size^2)``,
        every MXU cell one multiply-add a cycle (v4: 1.05 GHz, v5e: 1.50, v5p: 1.75). Derived, not
        published: where JAX's table undercounts the MXUs (it gives v6e and tpu7x two each) the clock
        comes out high, which only lowers the bounds that divide by it (see EUP below)."""
        return mxu_clock_hz(self.bf16_flops / self.tensor_cores, self.mxus, self.mxu_size)

    @property
    def exp_per_second(self) -> float:
        """float32 exps (or any transcendental) per second per chip: each TensorCore's transcendental
        unit (EUP) takes one vector register a cycle, :data:`EUP_VREG_ELEMENTS` values, at
        :attr:`clock_hz` (see EUP below: compiled (static) and derived, not published)."""
        return self.tensor_cores * eup_rate(self.clock_hz)

    @property
    def ici_link_bandwidth(self) -> float | None:
        """One-way bytes/s of one ICI link: the per-chip bidirectional figure over 2 x ports."""
        if self.ici_bandwidth is None or not self.ici_ports:
            return None
        return self.ici_bandwidth / (2 * self.ici_ports)

    @property
    def cores_per_device(self) -> int:
        return self.tensor_cores if self.megacore else 1

    def per_device(self) -> dict[str, float | None]:
        """Peak bf16 FLOP/s, HBM bandwidth and bytes, and one-way ICI link bytes/s of one JAX device.

        The chip's share ``cores_per_device / tensor_cores``: 1 on v4, v5e, v5p and v6e (a device is
        the chip), 1/2 on v2, v3 and tpu7x (a device is one of two TensorCores). ICI is assumed
        shared the same way: the two devices of a tpu7x chip share its links, each getting half of
        a link's bandwidth when both send at once (as every device does at each ring step); on the
        other chips one device has the chip's links to itself. ``ici_link_bandwidth`` is None where
        this table carries no ICI figures.
        """
        share = self.cores_per_device / self.tensor_cores
        link = self.ici_link_bandwidth
        return {"bf16_flops": self.bf16_flops * share, "hbm_bandwidth": self.hbm_bandwidth * share,
                "hbm_bytes": self.hbm_bytes * share,
                "ici_link_bandwidth": None if link is None else link * share,
                "exp_per_second": self.exp_per_second * share}


# Per chip, from JAX's tpu_info.py (0.10.2), except v5p's HBM bandwidth (see V5P_HBM below). Device kinds as
# JAX's chip_version_from_device_kind reads them.
CHIPS: dict[str, Chip] = {chip.name: chip for chip in (
    Chip("v2", 2, False, 4.6e13, 7.16e11, 16.0e9, 16 * MIB, "v2:2x2x1", ("TPU v2",), bf16_matmul=False,
         mxus=1),
    Chip("v3", 2, False, 1.40e14, 8.25e11, 34.4e9, 16 * MIB, "v3:2x2x1", ("TPU v3",), bf16_matmul=False,
         mxus=2),
    Chip("v4", 2, True, 2.75e14, 1.23e12, 34.4e9, 16 * MIB, "v4:2x2x1", ("TPU v4",)),
    Chip("v5e", 1, False, 1.97e14, 8.20e11, 17.2e9, 128 * MIB, "v5e:2x2", ("TPU v5 lite", "TPU v5e"),
         ici_bandwidth=400e9, ici_ports=4),
    Chip("v5p", 2, True, 4.59e14, 2.765e12, 103.0e9, 64 * MIB, "v5p:2x2x1", ("TPU v5", "TPU v5p"),
         kernel_vmem_bytes=64 * MIB, ici_bandwidth=1200e9, ici_ports=6),
    Chip("v6e", 1, False, 9.20e14, 1.64e12, 34.4e9, 128 * MIB, "v6e:2x2", ("TPU v6 lite", "TPU v6e"),
         kernel_vmem_bytes=32 * MIB, mxus=2, mxu_size=256),
    Chip("tpu7x", 2, False, 2.31e15, 7.40e12, 206.0e9, 64 * MIB, "tpu7x:2x2x1", ("TPU7x",),
         kernel_vmem_bytes=64 * MIB, mxus=2, mxu_size=256),
)}
NAMES = tuple(CHIPS)
# ``kernel_vmem_bytes``: the VMEM a Pallas kernel may use without raising ``vmem_limit_bytes``, as
# the TPU compiler itself states it when a kernel overflows (libtpu 0.0.42.1, compile-only): a scoped
# limit of 16 MiB on v5e and 32 MiB on v6e ("E1001: CompileTimeScopedVmemOom ... limit 16.00M"), the
# whole VMEM elsewhere ("Used ... of 16.00M vmem" on v2/v3/v4, "of 63.94M" on v5p, "of 64.00M" on tpu7x).

# V5P_HBM: JAX's tpu_info.py says 2.46e12 B/s for v5p; Google Cloud's v5p page says "HBM2e capacity and
# bandwidth | 95GB, 2765 GBps" (https://cloud.google.com/tpu/docs/v5p, key specifications; its newer table
# writes the same figure as 2575 GiBps). The table takes the source's 2.765e12; chip_spec(source="jax")
# still reads JAX's own figure.
V5P_HBM_BANDWIDTH_SOURCE = "https://cloud.google.com/tpu/docs/v5p (HBM2e bandwidth 2765 GBps)"
# Figures of CHIPS that are not JAX's, per chip: what they are and where they come from.
NOT_FROM_JAX = {"v5p": f"HBM bandwidth from {V5P_HBM_BANDWIDTH_SOURCE}"}

# ICI: "Bidirectional inter-chip interconnect (ICI) bandwidth (per chip)": 400 GBps with 4 ICI ports
# on v5e (https://cloud.google.com/tpu/docs/v5e, 2D torus) and 1200 GBps on v5p
# (https://cloud.google.com/tpu/docs/v5p, 3D torus: 6 neighbours). One link one way is then 50 GB/s
# on v5e and 100 GB/s on v5p ("How to Scale Your Model", ch. 2, tabulates 4.5e10 and 9e10 B/s).
# Only the two chips whose slices the slice report compiles carry them.

# EUP: the transcendental unit's rate, which no Google page nor JAX's table states. Two facts give it.
# (1) What the TPU compiler makes of an exp: libtpu (0.0.42.1, compile-only) turns jnp.exp2 over a
# float32 block into one `vpow2` push to the EUP per vector register (8 sublanes x 128 lanes, JAX's
# num_sublanes x num_lanes) and schedules at most one push per VLIW bundle, one bundle a cycle, on v4,
# v5e, v5p and v6e alike (compiled (static); tests/test_aot_static.py holds both on each chip).
# (2) The clock the peak FLOP/s and JAX's MXU table imply (Chip.clock_hz). The rate is then an upper
# bound on what the unit can do, so the time it gives (roofline's vector term) is a lower bound.
EUP_VREG_ELEMENTS = 8 * 128  # float32 values in one vector register
EUP_PUSHES_PER_CYCLE = 1     # compiled (static): at most one EUP push per bundle
EUP_SOURCE = ("derived: one float32 vector register (8 x 128) per cycle through the EUP, the most "
              "libtpu 0.0.42.1 schedules (compiled (static)), at the clock the peak bf16 FLOP/s and "
              "JAX's MXU table imply")



# CLOCK: the TensorCore clock the static estimate (tpuattn.measure.estimate) counts bundles at, one VLIW
# bundle a cycle. Published for v2 and v3 (Jouppi et al., "A Domain-Specific Supercomputer for Training Deep
# Neural Networks", CACM 63(7), 2020, Table 3: 700 and 940 MHz) and v4 (Jouppi et al., "TPU v4: An
# Optically Reconfigurable Supercomputer for Machine Learning", ISCA 2023, Table 3: 1050 MHz). Google
# publishes no clock for v5e, v5p, v6e or tpu7x; for them it is the clock the peak implies
# (Chip.clock_hz), which for v2 and v4 gives the published figures (0.70 and 1.05 GHz).
PUBLISHED_CLOCK_HZ = {"v2": 700e6, "v3": 940e6, "v4": 1050e6}
CLOCK_SOURCES = {"v2": "Jouppi et al., CACM 2020, Table 3 (700 MHz)",
                 "v3": "Jouppi et al., CACM 2020, Table 3 (940 MHz)",
                 "v4": "Jouppi et al., ISCA 2023, Table 3 (1050 MHz)"}


def estimate_clock(name: str) -> tuple[float, str]:
    """``(Hz, source)``: the chip's published clock, or (none published) the one its peak implies."""
    chip = get(name)
    if chip.name in PUBLISHED_CLOCK_HZ:
        return PUBLISHED_CLOCK_HZ[chip.name], CLOCK_SOURCES[chip.name]
    return chip.clock_hz, "derived: peak bf16 FLOP/s / (2 x MXUs x MXU side^2), none published"


def mxu_clock_hz(bf16_flops_per_core: float, mxus: int, mxu_size: int) -> float:
    """The clock a TensorCore's peak implies, every cell of its ``mxus`` MXUs (``mxu_size`` square) one
    multiply-add a cycle (:attr:`Chip.clock_hz`; JAX's ``TpuInfo`` gives the same three numbers)."""
    return bf16_flops_per_core / (2 * mxus * mxu_size**2)


def eup_rate(clock_hz: float, vreg_elements: int = EUP_VREG_ELEMENTS) -> float:
    """float32 transcendentals per second of one TensorCore at ``clock_hz`` (see EUP above)."""
    return clock_hz * EUP_PUSHES_PER_CYCLE * vreg_elements


# Off a TPU (and for a chip this table does not know) the kernels budget for the smallest VMEM.
DEFAULT_VMEM_BYTES = 16 * MIB


def get(name: str) -> Chip:
    """The :class:`Chip` for a name (``"v5e"``) or a device kind (``"TPU v5 lite"``)."""
    chip = CHIPS.get(name.lower()) if isinstance(name, str) else None
    if chip is None and isinstance(name, str):
        chip = from_device_kind(name)
    if chip is None:
        raise ValueError(f"chip: expected a chip name in {list(NAMES)} or a TPU device kind, got {name!r}")
    return chip


def from_device_kind(device_kind: str) -> Chip | None:
    """``"TPU v5 lite"`` -> the v5e :class:`Chip`; None for anything this table does not know."""
    for chip in CHIPS.values():
        if device_kind in chip.device_kinds:
            return chip
    return None


# ---------------------------------------------------------------------------- the target
# The target chip is a JAX *user context* (``jax.make_user_context``): JAX includes its value in the
# key of every tracing, lowering and compilation cache. A function traced for the CPU (interpret
# mode, CPU block sizes) is therefore never reused inside ``target("v5e")``, nor the reverse, even
# when it is the same ``jax.jit`` object, nested jits included. A plain context variable would be
# ambient state that JAX's caches cannot see: the first trace would win.
_TARGET = jax.make_user_context(default_value=None)  # the target chip's name, or None


def _target_name() -> str | None:
    return _TARGET.value


@contextlib.contextmanager
def target(chip: str | Chip):
    """Work for ``chip`` (ahead-of-time compilation) inside the ``with`` block, wherever this runs.

    The chip is part of JAX's cache key inside the block (see :data:`_TARGET`), so tracing the same
    function for the CPU before or after compiling it for a TPU never mixes the two programs.
    """
    chip = chip if isinstance(chip, Chip) else get(chip)
    if CHIPS.get(chip.name) != chip:
        raise ValueError(f"chip: expected a chip from tpuattn.chips.CHIPS, got a modified {chip.name!r}")
    with _TARGET(chip.name):
        yield chip


def target_chip() -> Chip | None:
    """The chip set by :func:`target`, else the local TPU's (None off a TPU or for an unknown one)."""
    name = _target_name()
    if name is not None:
        return CHIPS[name]
    if jax.default_backend() != "tpu":
        return None
    return from_device_kind(jax.devices()[0].device_kind)


def target_backend() -> str:
    """``"tpu"`` inside :func:`target`, else JAX's default backend."""
    if _target_name() is not None:
        return "tpu"
    return jax.default_backend()


def vmem_bytes() -> tuple[int, str]:
    """VMEM bytes per TensorCore of the target chip, and where the number came from."""
    chip = target_chip()
    if chip is not None:
        return chip.vmem_bytes, f"tpuattn.chips ({chip.name})"

    backend = jax.default_backend()
    if backend == "tpu":
        return DEFAULT_VMEM_BYTES, f"default (unknown chip {jax.devices()[0].device_kind!r})"
    return DEFAULT_VMEM_BYTES, f"default (no TPU: {backend})"
