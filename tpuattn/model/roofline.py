"""A roofline model of attention on TPUs: chips, FLOPs and HBM bytes per schedule.

Everything here is *modelled*, never measured: it says what a chip could do at best for a
given implementation's schedule, so that a measurement (:mod:`tpuattn.measure.bench`) can be read
as a fraction of that bound. The model reads its constants from the code it models: chip numbers
from :mod:`tpuattn.chips`, each implementation's schedule and default blocks from its registry
record, the Pallas kernel's VMEM need and budget from :mod:`tpuattn.pallas.blocks`.

**Units: one JAX device.** Every model in :mod:`tpuattn.model` (this roofline, the decode roofline
:mod:`tpuattn.model.decode_roofline`, the ring's communication :mod:`tpuattn.model.comm`) works per JAX
device:
:func:`chip_spec` gives one *device* of a chip: peak bf16 FLOP/s, HBM bandwidth and capacity, its
share of an ICI link, and VMEM per TensorCore. A device is the whole chip on v5e and v6e (one
TensorCore) and on the megacore v4 and v5p (one device spans both TensorCores), and one TensorCore,
half the chip, on v2, v3 and tpu7x (:meth:`tpuattn.chips.Chip.per_device`). The numbers are
:data:`tpuattn.chips.CHIPS` (JAX's own ``tpu_info`` table, kept in the package so every JAX
version gets the same numbers); ``source="jax"`` reads ``pltpu.get_tpu_info_for_chip`` instead,
where the installed JAX has it (>= 0.8.1).

**f32.** The MXU multiplies bf16. A float32 matmul at ``Precision.HIGHEST`` (what every
implementation here uses for f32 inputs) is emulated with 6 bf16 passes
(``jax.lax.Precision`` docstring: "performs float32 computations in 6 bfloat16 passes"), so
the model takes f32 peak = bf16 peak / 6. That is a *modelled* number, not a published one.

**Schedules.** :func:`cost` counts the FLOPs a schedule executes and the HBM bytes it moves, for
``mode="fwd"`` or ``"fwd+bwd"``; an implementation's record names its schedule:

* ``"materialised"``: the ``[batch, heads, q_len, kv_len]`` score matrix is written to HBM in
  float32 and the softmax runs in separate passes over it (:data:`MATERIALISED_FWD_PASSES`,
  :data:`MATERIALISED_BWD_PASSES`). Masks do not save work: every score is computed.
* ``"flash"``: a ``q_block`` of queries stays in VMEM while K/V blocks stream past it, so K and
  V are re-read once per query block; scores never reach HBM; tiles that
  :meth:`MaskSpec.block_map` marks EMPTY are skipped (neither fetched nor computed). The backward
  pass is two kernels (dK/dV, then dQ) with delta = rowsum(dO * O), as in JAX's flash and splash
  kernels, unless ``fused_backward=True``;
* ``"flash (row-sum pass)"``: the same, with a third backward pass first that sums
  delta = rowsum(P * dP) over the visited tiles (tpuattn's Pallas kernel: two more matmuls per tile
  and one more read of K and V, for gradients that stay exact on nearly one-hot rows);
* ``"blockwise (XLA loop)"``: the same tiles in a pure-JAX loop, each step a few fusions around its
  matmuls (:data:`BLOCKWISE_FWD_TILE_PASSES`, read from XLA:TPU's optimised program): a step's f32
  score tile makes a round trip through HBM, and the running ``(acc, max, sum)`` state too, unless
  (given a chip) it fits the VMEM beside the kernels' scoped limit, step by step
  (``tests/test_aot_model_grid.py`` holds the bound between the compulsory bytes and the compiled
  program's HBM traffic, forward and forward+backward at 2048 and 8192 tokens).

The predicted time is the lower bound ``max(flops / peak, bytes / bandwidth, exps / exp rate)``
(:func:`predict`). The vector unit's work is counted (``Cost.transcendentals``: one exp per computed
score and per pass that recomputes P, and with a softcap one tanh beside each exp) and timed at the
chip's transcendental rate (:data:`TRANSCENDENTALS`: one float32 vector register a cycle through the
EUP, derived from the compiled bundles and the clock the peak implies, an upper bound on the rate, so
the term stays a lower bound). FlashAttention-3's argument, that the exps can bound a flash kernel at
``head_dim <= 128``, is then the model's ``bound == "vector"``. It leaves out the vector ALU's other
work (the max, the subtractions, the rescales), pipeline bubbles and launch overhead; measured times
are therefore expected above it.

**Peak HBM.** ``Cost.peak_hbm_bytes`` is the call's arguments and results plus the temporaries XLA:TPU
leaves in HBM (:func:`_peak`): given a chip, a temporary may share a result's buffer or stay in the
VMEM beside the kernels' scoped limit (:attr:`ChipSpec.xla_vmem_bytes`), as the compiler's buffer
assignment showed on a grid of chips, lengths, implementations and modes
(``benchmarks/peak_hbm_grid.py``; ``tests/test_aot_model_grid.py`` holds it within 10%).
``Cost.peak_breakdown`` says where each buffer went.

**Argument shapes.** ``cost(..., arguments=...)`` says how the call's Q, K, V arrive and O leaves
(:data:`ARGUMENT_SHAPES`): ``"contract"``, arrays of the contract's ``[batch, seq, heads, head_dim]``
shape, or ``"projected"``, arrays that a projection made as ``[batch, seq, heads * head_dim]`` and
reshaped to the contract's shape (and O reshaped back into one). A TPU tiles an array's last two
dimensions, so a kernel that reads the columns view ``[batch, seq, heads * head_dim]``
(:class:`tpuattn.pallas.layout.Layout`) needs a relayout of contract-shaped arguments, and none of
projected ones: the reshapes cancel, no copy is made, and the model then charges none (on v5p, whose
XLA gets no VMEM in the model, the Pallas forward at 8192 tokens is 114 MiB contract-shaped and 66 MiB
projected, as the compiler's 112 and 66). A kernel that reads ``[batch, heads, seq, head_dim]`` (splash,
or the heads-first view) copies either way.

**Crossovers.** :func:`materialise_crossover` is the sequence length at which the materialised
schedule's score buffers stop fitting in HBM; :func:`vmem_crossover` is the length at which a
fused kernel that holds a whole row block of scores (no online softmax) stops fitting in the VMEM
a kernel is given (:attr:`ChipSpec.vmem_budget_bytes`, the compiler's own limit). The flash
schedule has no such length: its VMEM working set depends on the block sizes only.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from tpuattn import api, chips
from tpuattn._checks import positive_int
from tpuattn.errors import TpuattnError
from tpuattn.impl.blockwise import schedule as blockwise_schedule
from tpuattn.measure.flops import FORWARD_FLOPS_PER_SCORE, MODES, attention_flops, check_mode
from tpuattn.pallas.blocks import backward_vmem_bytes, dq_vmem_bytes, forward_vmem_bytes
from tpuattn.pallas.layout import Layout, padded_head_dim
from tpuattn.registry import ScheduleModel
from tpuattn.spec import EMPTY, MaskSpec, spec_from_shapes

GIB = 1024**3
MIB = 1024**2

# f32 matmuls at Precision.HIGHEST run as 6 bf16 MXU passes (jax.lax.Precision docstring).
F32_PASSES = 6

SCHEDULES = ("materialised", "flash", "flash (row-sum pass)", "blockwise (XLA loop)")
# How the call's Q, K, V arrive and O leaves (see the module's docstring, "Argument shapes").
ARGUMENT_SHAPES = ("contract", "projected")
SOURCES = ("table", "jax")

__all__ = ["ARGUMENT_SHAPES", "BUFFER_KINDS", "F32_PASSES", "GIB", "MIB", "MODES", "SCHEDULES", "SOURCES",
           "TRANSCENDENTALS",
           "ChipSpec", "Cost", "Prediction",
           "chip_spec", "cost", "default_blocks", "jax_has_tpu_info", "materialise_crossover", "models",
           "predict", "problem", "roofline_curve", "schedule_model", "standard_flops", "visited_tiles",
           "vmem_crossover"]


# ----------------------------------------------------------------------------- chips
@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """Peak numbers of one JAX device of a TPU chip (:meth:`tpuattn.chips.Chip.per_device`)."""

    name: str  # "v5e"
    bf16_flops: float  # FLOP/s per device, dense bf16 matmul
    hbm_bandwidth: float  # bytes/s per device
    hbm_capacity: float  # bytes per device
    vmem_bytes: int  # per TensorCore
    tensor_cores: int  # per device (2 for the megacore v4 and v5p)
    source: str  # where the numbers come from
    kernel_vmem_bytes: int = 16 * MIB  # what a kernel gets (tpuattn.chips.Chip.kernel_vmem_bytes)
    ici_link_bandwidth: float | None = None  # one-way bytes/s of one ICI link, this device's share
    # exp (transcendental) evaluations per second per device (see TRANSCENDENTALS below); None leaves
    # the vector-unit term out of predict()
    transcendentals_per_second: float | None = None

    @property
    def f32_flops(self) -> float:
        """Modelled: f32 matmul at Precision.HIGHEST = 6 bf16 passes."""
        return self.bf16_flops / F32_PASSES

    @property
    def vmem_budget_bytes(self) -> int:
        """The VMEM a kernel is given by default, as the TPU compiler states it (the scoped limit on
        v5e and v6e, the whole VMEM elsewhere): :attr:`tpuattn.chips.Chip.kernel_vmem_bytes`."""
        return self.kernel_vmem_bytes

    @property
    def xla_vmem_bytes(self) -> int:
        """VMEM that XLA's memory-space assignment may give whole buffers (a score matrix, a layout
        copy, a kernel's output) instead of HBM: what the scoped limit kernels get leaves,
        ``vmem_bytes - kernel_vmem_bytes`` (v5e: 112 MiB, v6e: 96 MiB; 0 where a kernel is given
        the whole VMEM). The compiler's own memory-usage reports (libtpu 0.0.42.1) never use more:
        the most VMEM any program of the peak-HBM grid used was 112.00 MiB on v5e and 92.02 MiB on
        v6e."""
        return max(0, self.vmem_bytes - self.kernel_vmem_bytes)

    def peak_flops(self, dtype, precision: str = "highest") -> float:
        """bf16/f16 inputs run at bf16 peak; f32 at the modelled :attr:`f32_flops` -- unless
        ``precision="default"``: JAX's default TPU precision multiplies f32 in one bf16 pass (what
        plain user code gets; every implementation here asks for ``"highest"``)."""
        if precision not in ("highest", "default"):
            raise ValueError(f"precision: expected 'highest' or 'default', got {precision!r}")
        if _dtype_name(dtype) == "float32" and precision == "highest":
            return self.f32_flops
        return self.bf16_flops

    def ridge_point(self, dtype="bfloat16") -> float:
        """Arithmetic intensity (FLOP/byte) above which a kernel is compute bound."""
        return self.peak_flops(dtype) / self.hbm_bandwidth


def jax_has_tpu_info() -> bool:
    """True when the installed JAX has ``pltpu.get_tpu_info_for_chip`` (JAX >= 0.8.1)."""
    from jax.experimental.pallas import tpu as pltpu

    return hasattr(pltpu, "get_tpu_info_for_chip") and hasattr(pltpu, "ChipVersion")


def _from_table(chip: chips.Chip) -> ChipSpec:
    device = chip.per_device()
    return ChipSpec(name=chip.name, bf16_flops=device["bf16_flops"], hbm_bandwidth=device["hbm_bandwidth"],
                    hbm_capacity=device["hbm_bytes"], vmem_bytes=chip.vmem_bytes,
                    tensor_cores=chip.cores_per_device,
                    source="tpuattn.chips (JAX's tpu_info table" + (
                        f"; {chips.NOT_FROM_JAX[chip.name]})" if chip.name in chips.NOT_FROM_JAX else ")"),
                    kernel_vmem_bytes=chip.kernel_vmem_bytes, ici_link_bandwidth=device["ici_link_bandwidth"],
                    transcendentals_per_second=device["exp_per_second"])


def _from_jax(chip: chips.Chip) -> ChipSpec:
    import jax
    from jax.experimental.pallas import tpu as pltpu

    # ChipVersion values are the names without "tpu" ("v5e", "7x"); TpuInfo is per TensorCore.
    info = pltpu.get_tpu_info_for_chip(pltpu.ChipVersion(chip.name.removeprefix("tpu")),
                                       chip.cores_per_device)
    cores = info.num_cores
    clock = chips.mxu_clock_hz(info.bf16_ops_per_second, info.num_mxus, info.mxu_column_size)
    exps = cores * chips.eup_rate(clock, info.num_sublanes * info.num_lanes)
    return ChipSpec(name=chip.name, bf16_flops=float(info.bf16_ops_per_second) * cores,
                    hbm_bandwidth=float(info.mem_bw_bytes_per_second) * cores,
                    hbm_capacity=float(info.hbm_capacity_bytes) * cores,
                    vmem_bytes=int(info.vmem_capacity_bytes), tensor_cores=cores,
                    source=f"pltpu.get_tpu_info_for_chip (JAX {jax.__version__})",
                    kernel_vmem_bytes=chip.kernel_vmem_bytes,
                    ici_link_bandwidth=chip.per_device()["ici_link_bandwidth"],  # JAX has no ICI figures
                    transcendentals_per_second=float(exps))


def chip_spec(name, *, source: str = "table") -> ChipSpec:
    """The :class:`ChipSpec` of one device of ``name``: a chip name (``"v5e"``), a device kind
    (``"TPU v5 lite"``) or a :class:`tpuattn.chips.Chip`.

    ``source``: ``"table"`` (:data:`tpuattn.chips.CHIPS`) or ``"jax"`` (JAX's
    ``get_tpu_info_for_chip``, JAX >= 0.8.1; the same numbers).
    """
    chip = name if isinstance(name, chips.Chip) else chips.get(name)
    if source not in SOURCES:
        raise ValueError(f"source: expected one of {list(SOURCES)}, got {source!r}")
    if source == "table":
        return _from_table(chip)
    if not jax_has_tpu_info():
        raise ValueError("source: 'jax' needs pltpu.get_tpu_info_for_chip (JAX >= 0.8.1); use source='table'")
    return _from_jax(chip)


def _as_chip_spec(chip) -> ChipSpec:
    return chip if isinstance(chip, ChipSpec) else chip_spec(chip)


# ----------------------------------------------------------------------------- problems
def problem(seq_len: int, *, batch: int = 1, heads: int = 8, kv_heads: int | None = None, head_dim: int = 128,
            dtype="bfloat16", causal: bool = False, kv_len: int | None = None, window=None,
            softcap: float | None = None):
    """The :class:`tpuattn.AttentionSpec` of a modelled problem (no arrays needed), built by
    :func:`tpuattn.spec.spec_from_shapes`; ``window`` and ``softcap`` as in :func:`tpuattn.attention`."""
    kv_heads = heads if kv_heads is None else kv_heads
    for arg, value in (("seq_len", seq_len), ("heads", heads), ("kv_heads", kv_heads)):
        positive_int(arg, value)
    if heads % kv_heads:
        raise ValueError(f"heads: expected a multiple of kv_heads={kv_heads}, got {heads}")
    return spec_from_shapes(seq_len, kv_len, batch=batch, num_q_heads=heads, num_kv_heads=kv_heads,
                            head_dim=head_dim, dtype=dtype, causal=causal, window=window, softcap=softcap)


def transcendentals_per_score(spec) -> int:
    """Transcendental evaluations each time a pass computes a score: its exp, and with a softcap the
    ``tanh`` of ``softcap * tanh(s / softcap)`` as well (the kernels and XLA evaluate both per score)."""
    return 1 if spec.softcap is None else 2


def standard_flops(spec, mode: str = "fwd") -> float:
    """The conventional count of :mod:`tpuattn.measure.flops` (what a benchmark reports) for ``spec``."""
    return attention_flops(batch=spec.batch, heads=spec.num_q_heads, q_len=spec.q_len, kv_len=spec.kv_len,
                           head_dim=spec.head_dim, causal=spec.causal, mode=mode)


# ----------------------------------------------------------------------------- costs
@dataclasses.dataclass(frozen=True)
class Cost:
    """What one schedule does for one problem (modelled)."""

    impl: str
    mode: str
    schedule: str  # one of SCHEDULES
    flops: float  # executed, including masked work that the schedule does not skip
    standard_flops: float  # the conventional count, for TFLOP/s comparisons
    hbm_bytes: float  # bytes moved between HBM and the core
    peak_hbm_bytes: float  # largest live set in HBM (inputs, outputs, intermediates)
    vmem_bytes: float  # per-core VMEM working set of a kernel (0 for XLA schedules)
    breakdown: tuple[tuple[str, float], ...]  # (what, bytes) summing to hbm_bytes
    visited_fraction: float = 1.0  # fraction of score tiles computed
    transcendentals: float = 0.0  # exp evaluations: one per computed score, again per recomputing pass
    # (what, bytes, where) of every buffer the peak counts or leaves out; where is "HBM",
    # "VMEM" (kept on chip by XLA, not counted) or "a result's buffer" (shares it, not counted)
    peak_breakdown: tuple[tuple[str, float, str], ...] = ()
    arguments: str = "contract"  # how Q, K, V arrive and O leaves: one of ARGUMENT_SHAPES

    @property
    def intensity(self) -> float:
        """Arithmetic intensity: executed FLOPs per HBM byte."""
        return self.flops / self.hbm_bytes


# Passes over the score matrix of the materialised schedule, in bytes per score element, as
# XLA:TPU fuses ``reference.py``'s graph (its optimised HLO for v5e, JAX 0.10.2, where every
# [batch, heads, q_len, kv_len] buffer lives in HBM): the forward is three fusions, the exp and the
# normalisation fused into the reductions and into the P V matmul. ``p`` is the byte size of P (cast
# to v's dtype; float32 stays 4 bytes). Other graphs (jax.nn's XLA path) fuse less, so this is the
# fewest bytes a materialised schedule moves: a lower bound for all of them.
MATERIALISED_FWD_PASSES = (
    ("S = scale * Q K^T fused with the row max: write S (f32)", lambda p: 4),
    ("row sum of exp(S - m): read S", lambda p: 4),
    ("O = (exp(S - m) / l) V, the softmax fused into the matmul: read S", lambda p: 4),
)
# fwd+bwd: the forward also writes P for the backward, which then reads it in three fusions.
MATERIALISED_BWD_PASSES = (
    ("forward keeps P for the backward: write P", lambda p: p),
    ("dP = dO V^T fused with dS = P (dP - r): read P, S", lambda p: p + 4),
    ("dQ = dS K and dK = dS^T Q, dS recomputed in the matmuls: read P, S", lambda p: p + 4),
    ("dV = P^T dO with the row sums: read S", lambda p: 4),
)
# Bytes per score element live at the peak, when the record does not say (``model.live_scores``):
# S in f32, plus P for the backward.
DEFAULT_LIVE_SCORES = {"fwd": lambda p: 4, "fwd+bwd": lambda p: 4 + p}


def schedule_model(impl: str) -> ScheduleModel:
    """``impl``'s :class:`tpuattn.registry.ScheduleModel` (its record's ``model``), read by attribute:
    a record that carries anything else is an error, never a set of silent defaults."""
    record = api.get_implementation(impl)
    if not isinstance(record.model, ScheduleModel):
        raise TypeError(f"{impl}: its record's model: expected a tpuattn.registry.ScheduleModel, "
                        f"got {type(record.model).__name__}")
    return record.model


def models() -> dict[str, str]:
    """``{implementation: schedule}`` for every registered implementation whose record names a schedule."""
    return {name: api.get_implementation(name).schedule for name in api.known_implementations()
            if api.get_implementation(name).schedule is not None}


def _dtype_name(dtype) -> str:
    import jax.numpy as jnp

    return jnp.dtype(dtype).name


def _itemsize(dtype) -> int:
    import jax.numpy as jnp

    return jnp.dtype(dtype).itemsize


def _io_bytes(spec) -> tuple[float, float, float]:
    """Bytes of Q (= O) and of K (= V)."""
    e = _itemsize(spec.dtype)
    q = spec.batch * spec.q_len * spec.num_q_heads * spec.head_dim * e
    kv = spec.batch * spec.kv_len * spec.num_kv_heads * spec.head_dim * e
    return q, kv, e


def _arguments_and_results(q_bytes: float, kv_bytes: float, mode: str) -> float:
    """HBM of the call's own inputs and outputs: Q, K, V in; O out (fwd) or dQ, dK, dV out (fwd+bwd)."""
    return q_bytes + 2 * kv_bytes + (q_bytes if mode == "fwd" else q_bytes + 2 * kv_bytes)


# TRANSCENDENTALS: the vector unit evaluates one exp per computed score (FlashAttention-3's argument:
# at head_dim 128 the exps, not the matmuls, can bound a flash kernel). The model counts them
# (Cost.transcendentals, held to the compiled kernels' EUP pushes by tests/test_aot_static.py) and
# divides them by ChipSpec.transcendentals_per_second. Neither Google Cloud's TPU pages, nor JAX's
# tpu_info table, nor the scaling book ("How to Scale Your Model", ch. 2) publishes that rate, so it is
# derived (tpuattn.chips, EUP): one float32 vector register per cycle, the most the compiler schedules,
# at the clock the peak FLOP/s and the MXU table imply. An overestimate of the rate only lowers the
# vector term, which keeps it a lower bound.
TRANSCENDENTALS = chips.EUP_SOURCE

# Kinds of a temporary buffer, for :func:`_peak`: "copy" is consumed before the call's results are
# written (a layout copy of an input, the forward's output in a gradient), so it may share a result's
# buffer; "temp" may stay in VMEM; "unread" is an output nothing reads (XLA leaves it in HBM).
BUFFER_KINDS = ("copy", "temp", "unread")


def _peak(arguments: float, results: float, temps, chip: ChipSpec | None) -> tuple[float, tuple]:
    """Peak HBM of a program: its arguments and results plus the temporaries that neither share a
    result's buffer nor stay in VMEM, as XLA:TPU's buffer assignment placed them on the grid of
    ``benchmarks/peak_hbm_grid.py`` (libtpu 0.0.42.1, v5e and v6e):

    1. a "copy" shares a result's buffer while the results have room (the layout copy of Q went into
       the output's allocation: v5e, pallas, forward, 32768 tokens);
    2. the other temporaries but "unread" ones go to VMEM, largest first, each while it fits what is
       left of :attr:`ChipSpec.xla_vmem_bytes` (a buffer as large as what is left goes to HBM: at 2048
       tokens a 64 MiB P stayed in v5e's VMEM and the 128 MiB S did not; at 8192 tokens Pallas's
       backward filled the 112 MiB exactly, so a buffer fits when it is no larger than what is left);
    3. the rest is in HBM.

    ``temps``: ``(what, bytes, kind)`` with kind from :data:`BUFFER_KINDS`. Without a chip nothing stays
    on chip (the peak is then an upper bound of the compiler's)."""
    rows = [("arguments", float(arguments), "HBM"), ("results", float(results), "HBM")]
    room, pending = float(results), []
    for what, size, kind in temps:
        if kind not in BUFFER_KINDS:
            raise ValueError(f"kind: expected one of {list(BUFFER_KINDS)}, got {kind!r}")
        if kind == "copy" and 0 < size <= room:
            room -= size
            rows.append((what, float(size), "a result's buffer"))
        else:
            pending.append((what, float(size), kind))
    vmem = float(chip.xla_vmem_bytes) if chip is not None else 0.0
    for what, size, kind in sorted(pending, key=lambda t: -t[1]):
        if kind != "unread" and 0 < size <= vmem:
            vmem -= size
            rows.append((what, size, "VMEM"))
        else:
            rows.append((what, size, "HBM"))
    return sum(b for _, b, where in rows if where == "HBM"), tuple(rows)


def _materialised(impl: str, spec, mode: str, chip: ChipSpec | None = None) -> Cost:
    """Every score computed and kept in HBM. ``chip``: score buffers XLA can keep in the VMEM beside
    the kernels' scoped limit (:func:`_peak`: on v5e a 64 MiB P stayed in VMEM and a 128 MiB S went
    to HBM) are left out of the peak, and cost no HBM traffic when all of them stay there. Not
    counted: a boolean [q_len, kv_len] mask XLA sometimes materialises (seen
    for jax.nn's path in float32 on v4: 64 MiB at 8192 tokens, 12% of the peak with 2 heads, 3% with 8)."""
    q_bytes, kv_bytes, e = _io_bytes(spec)
    p = e  # P is cast to v's dtype; 4 bytes when v is f32
    n = spec.batch * spec.num_q_heads * spec.q_len * spec.kv_len  # score elements
    d = spec.head_dim
    per_score = {**DEFAULT_LIVE_SCORES, **(schedule_model(impl).live_scores or {})}[mode](p)
    io = _arguments_and_results(q_bytes, kv_bytes, mode)
    if chip is not None and per_score * n + io > chip.hbm_capacity:
        per_score = DEFAULT_LIVE_SCORES[mode](p)  # short of HBM, XLA falls back to the leanest graph
    # The live score bytes as buffers: float32 [batch, heads, q_len, kv_len] ones (S, exp S), and
    # what is left over (P in v's dtype for the backward).
    buffers = [("score buffer (f32)", 4 * n)] * int(per_score // 4)
    if per_score % 4:
        buffers.append(("P for the backward", per_score % 4 * n))
    arguments, results = q_bytes + 2 * kv_bytes, io - (q_bytes + 2 * kv_bytes)
    peak, placed = _peak(arguments, results, [(what, b, "temp") for what, b in buffers], chip)
    # Score buffers cost no HBM traffic only when every one of them stays on chip (the same
    # placement as the peak's: VMEM beside the kernels' scoped limit, a buffer at most what is left;
    # on v5e a 64 MiB P stayed in VMEM and a 128 MiB S did not). The optimistic side, as a lower
    # bound must be.
    on_chip = all(where == "VMEM" for what, _, where in placed if what in dict(buffers))
    where = " (on chip: no HBM traffic)" if on_chip else ""
    flops = float(FORWARD_FLOPS_PER_SCORE) * n * d  # QK^T and PV over every pair: masks skip no work
    breakdown = [("read Q, K, V", q_bytes + 2 * kv_bytes), ("write O", q_bytes)]
    breakdown += [(name + where, 0.0 if on_chip else per(p) * n) for name, per in MATERIALISED_FWD_PASSES]
    if mode == "fwd+bwd":
        flops += 8.0 * n * d  # dP, dV, dQ, dK: four matmuls, no recompute
        breakdown += [("bwd: read Q, K, V, dO; write dQ, dK, dV", 2 * q_bytes + 2 * kv_bytes + q_bytes
                       + 2 * kv_bytes)]
        breakdown += [("bwd: " + name + where, 0.0 if on_chip else per(p) * n)
                      for name, per in MATERIALISED_BWD_PASSES]
    # one exp per score in the forward; the backward reads the stored P
    return Cost(impl=impl, mode=mode, schedule="materialised", flops=flops,
                transcendentals=float(n * transcendentals_per_score(spec)),
                standard_flops=standard_flops(spec, mode), hbm_bytes=sum(b for _, b in breakdown),
                peak_hbm_bytes=float(peak), vmem_bytes=0.0, breakdown=tuple(breakdown), peak_breakdown=placed)


@functools.lru_cache(maxsize=256)
def _visited_tiles(mask: MaskSpec, q_block: int, kv_block: int) -> tuple[int, int, int, np.ndarray]:
    """(visited tiles, q blocks, kv blocks, visited tiles per kv block) from MaskSpec.block_map."""
    tiles = mask.block_map(q_block, kv_block) != EMPTY
    return int(tiles.sum()), tiles.shape[0], tiles.shape[1], tiles.sum(axis=0)


def visited_tiles(spec, q_block: int, kv_block: int) -> tuple[int, int]:
    """(tiles a block schedule computes, total tiles) for ``spec``'s mask."""
    visited, nq, nk, _ = _visited_tiles(spec.mask, q_block, kv_block)
    return visited, nq * nk


def _check_blocks(q_block, kv_block) -> None:
    positive_int("q_block", q_block)
    positive_int("kv_block", kv_block)


def _relaid_out(params: ScheduleModel, spec, arguments: str) -> bool:
    """Does the wrapper move Q, K, V (and O, dO, dQ, dK, dV) between the call's arrays and the kernel
    layout? Not where the record says it never does, and not where the kernel reads the columns view
    ``[batch, seq, heads * head_dim]`` (:class:`tpuattn.pallas.layout.Layout`; a record that pairs
    heads reads through it) of projection-shaped arrays: there the reshapes cancel. Compiled for v5e,
    v6e and v5p (libtpu 0.0.42.1), the Pallas wrapper's projected call has no data movement outside
    its kernels (:func:`tpuattn.measure.aot.wrapper_moves`), the contract-shaped one four moves of
    Q's size in a forward."""
    if not params.kernel_layout_copies:
        return False
    return not (arguments == "projected" and params.pairs_heads and Layout.for_spec(spec).columns)


def _flash(impl: str, spec, mode: str, q_block: int, kv_block: int, fused_backward: bool,
           row_sum_pass: bool = False, chip: ChipSpec | None = None, arguments: str = "contract") -> Cost:
    """The flash schedule. ``row_sum_pass``: the backward's delta is rowsum(P * dP), summed by a pass
    of its own over the visited tiles (tpuattn's Pallas kernel), not rowsum(dO * O) (splash).
    ``arguments``: one of :data:`ARGUMENT_SHAPES` (:func:`_relaid_out`)."""
    _check_blocks(q_block, kv_block)
    params = schedule_model(impl)
    lse_row, delta_row = params.lse_row_bytes, params.delta_row_bytes
    e = _itemsize(spec.dtype)
    # A kernel that pads head_dim to the 128 lanes moves and multiplies the padded width; one that
    # pairs heads of 64 in a lane tile moves the contract's width and multiplies the padded one.
    pack = Layout.for_spec(spec).pack if params.pairs_heads else 1
    d_mxu = padded_head_dim(spec.head_dim) if params.pads_head_dim else spec.head_dim
    d = spec.head_dim if pack > 1 else d_mxu
    visited, nq, nk, _ = _visited_tiles(spec.mask, q_block, kv_block)
    heads = spec.batch * spec.num_q_heads  # tiles are computed per (batch, q head, q block, kv block)
    # K/V readers: a kernel whose grid step serves a GQA group's query heads reads K_j, V_j once per
    # kv head; one that steps over query heads reads them once per query head.
    kv_heads = spec.batch * (spec.num_kv_heads if params.kv_once_per_group else spec.num_q_heads)
    tile_flops = float(FORWARD_FLOPS_PER_SCORE) * q_block * kv_block * d_mxu  # QK^T and PV of one tile
    q_tile, kv_tile = q_block * d * e, kv_block * d * e
    # Forward: Q_i read once per q block (it stays in VMEM over the kv loop), K_j and V_j read
    # for every visited tile (of a kv head or a q head, as above), O_i and the f32 logsumexp
    # written once.
    per_group = " of a GQA group" if params.kv_once_per_group and spec.group_size > 1 else ""
    breakdown = [
        ("read Q (once per q block)", heads * nq * q_tile),
        (f"read K, V (once per visited tile{per_group})", kv_heads * visited * 2 * kv_tile),
        ("write O", heads * nq * q_tile),
    ]
    flops = heads * visited * tile_flops
    # VMEM of one grid step: the Pallas kernel's own accounting (head_dim padded to the lanes).
    group = pack * spec.group_size if params.kv_once_per_group else 1  # query heads per grid step
    vmem = forward_vmem_bytes(q_block, kv_block, padded_head_dim(d), e, group)
    if mode == "fwd+bwd":
        vmem = max(vmem, backward_vmem_bytes(q_block, kv_block, padded_head_dim(d), e, group))
        if group > 1:  # the dQ step holds the group's query heads too
            vmem = max(vmem, dq_vmem_bytes(q_block, kv_block, padded_head_dim(d), e, group))
        if row_sum_pass:
            breakdown += [
                ("bwd row sums: read Q, dO, lse; write delta (once per q block)",
                 heads * nq * (2 * q_tile + (lse_row + delta_row) * q_block)),
                (f"bwd row sums: read K, V (per visited tile{per_group})", kv_heads * visited * 2 * kv_tile),
            ]
            flops += heads * visited * 1.0 * tile_flops  # S and dP again: two matmuls
        else:
            breakdown.append(("bwd: delta = rowsum(dO * O): read O, dO; write delta",
                              heads * nq * (2 * q_tile + delta_row * q_block)))
        if fused_backward:
            # One kernel, kv outer: K_j, V_j read once, dK_j, dV_j written once; per visited
            # tile Q_i, dO_i, lse_i, delta_i read and dQ_i read-modified-written (f32).
            breakdown += [
                ("bwd: read K, V; write dK, dV (once per kv block and kv head)",
                 spec.batch * spec.num_kv_heads * nk * 4 * kv_tile),
                ("bwd: read Q, dO, lse, delta; update dQ (per visited tile)",
                 heads * visited * (2 * q_tile + (lse_row + delta_row) * q_block + 2 * q_block * d * 4)),
            ]
            flops += heads * visited * 2.5 * tile_flops  # S, dP, dV, dK, dQ: five matmuls
        else:
            breakdown += [
                ("bwd dK/dV kernel: read K, V; write dK, dV (once per kv block and kv head)",
                 spec.batch * spec.num_kv_heads * nk * 4 * kv_tile),
                ("bwd dK/dV kernel: read Q, dO, lse, delta (per visited tile)",
                 heads * visited * (2 * q_tile + (lse_row + delta_row) * q_block)),
                ("bwd dQ kernel: read Q, dO, lse, delta; write dQ (once per q block)",
                 heads * nq * (3 * q_tile + (lse_row + delta_row) * q_block)),
                (f"bwd dQ kernel: read K, V (per visited tile{per_group})", kv_heads * visited * 2 * kv_tile),
            ]
            flops += heads * visited * 3.5 * tile_flops  # dK/dV: S, dP, dV, dK; dQ: S, dP, dQ
    # What the implementation writes and copies besides the tiles (its record's ``model``): the
    # saved logsumexp and delta per query row (``lse_row_bytes``, ``delta_row_bytes``), and the
    # wrapper's moves to and from the kernel layout (a copy or a relayout: ``kernel_layout_copies``).
    q_bytes, kv_bytes, _ = _io_bytes(spec)
    widen = d / spec.head_dim  # the kernel layout's head_dim over the contract's
    rows = spec.batch * spec.num_q_heads * spec.q_len
    lse, delta = rows * lse_row, rows * delta_row
    written = rows * (params.lse_written_row_bytes or lse_row)  # the logsumexp as the forward writes it
    copies = _relaid_out(params, spec, arguments)
    if mode == "fwd+bwd" or params.forward_saves_lse:
        breakdown.append(("write logsumexp", written))
    if copies:
        breakdown.append(("wrapper: Q, K, V into the kernel layout (read + write)",
                          (1 + widen) * (q_bytes + 2 * kv_bytes)))
        breakdown.append(("wrapper: O out of the kernel layout (read + write)", (1 + widen) * q_bytes))
        if mode == "fwd+bwd":
            breakdown.append(("wrapper: dO in, dQ, dK, dV out (read + write)",
                              (1 + widen) * (2 * q_bytes + 2 * kv_bytes)))
    # Live at the peak (what XLA:TPU's buffer assignment showed, benchmarks/peak_hbm_grid.py): the
    # call's arguments and results; the kernel-layout copies of Q, K, V (and of O and dO in a
    # gradient), consumed before the results are written; the kernel's output O; the logsumexp
    # (unread in a forward-only call); in the backward, the logsumexp as the backward's passes read it
    # (``lse_copies_in_backward`` re-laid-out copies, or the saved one) and delta. The kernels'
    # gradients in the kernel layout reuse buffers dead by then (unless head_dim is padded).
    # :func:`_peak` places them: copies in the results' buffers, others in VMEM while they fit.
    argument_bytes, results = q_bytes + 2 * kv_bytes, _arguments_and_results(q_bytes, kv_bytes, mode) - (
        q_bytes + 2 * kv_bytes)
    kind = "copy" if copies else "temp"
    temps = [("Q in the kernel layout", widen * q_bytes, kind),
             ("K in the kernel layout", widen * kv_bytes, kind),
             ("V in the kernel layout", widen * kv_bytes, kind)] if copies else []
    if mode == "fwd":
        if copies or widen > 1:
            temps.append(("O from the kernel", widen * q_bytes, "temp"))
        if params.forward_saves_lse:
            temps.append(("logsumexp (unread)", written, "unread"))
    else:
        # The exact backward (a row-sum pass) keeps no O: the forward's is dead before the backward runs.
        if not row_sum_pass:
            temps.append(("O from the kernel (the backward's residual)", widen * q_bytes, "copy"))
        if copies:
            temps.append(("dO in the kernel layout", widen * q_bytes, "copy"))
        else:  # the cotangent the gradient makes, already in the kernel layout: the kernels read it
            # while they write the results, so it shares none of their buffers
            temps.append(("dO as the kernels read it", widen * q_bytes, "temp"))
        if params.lse_copies_in_backward == 0:
            temps.append(("logsumexp as the forward wrote it", written, "temp"))
        for n in range(params.lse_copies_in_backward):
            temps.append((f"logsumexp as the backward reads it ({n + 1})", lse, "temp"))
        temps.append(("delta", delta, "temp"))
        # the kernels' gradients padded, or relaid out into the results: buffers of their own
        if widen > 1 or (copies and row_sum_pass):
            temps += [("dQ from the kernel", widen * q_bytes, "temp"),
                      ("dK from the kernel", widen * kv_bytes, "temp"),
                      ("dV from the kernel", widen * kv_bytes, "temp")]
    peak, placed = _peak(argument_bytes, results, temps, chip)
    name = "flash (row-sum pass)" if row_sum_pass else "flash"
    # one exp per computed score and pass that computes P: the forward, then the row-sum pass, and
    # the dK/dV and dQ kernels (or the fused one)
    passes = 1 if mode == "fwd" else 1 + (1 if row_sum_pass else 0) + (1 if fused_backward else 2)
    return Cost(impl=impl, mode=mode, schedule=name, flops=flops,
                transcendentals=float(passes * heads * visited * q_block * kv_block
                                      * transcendentals_per_score(spec)),
                standard_flops=standard_flops(spec, mode),
                hbm_bytes=sum(b for _, b in breakdown), peak_hbm_bytes=float(peak), vmem_bytes=float(vmem),
                breakdown=tuple(breakdown), visited_fraction=visited / (nq * nk), peak_breakdown=placed,
                arguments=arguments)


# Per-tile passes of the blockwise step through HBM, bytes per score element, as XLA:TPU fuses them
# (the optimised program of impl="blockwise", causal, 8 heads of 128, bf16, at 8192 tokens on v5e,
# step by step: tests/test_aot_model_grid.py). Each pass is a matmul whose f32 tile is written once
# and read by the fusions that consume it, the exponentials, masks and row reductions fused into
# them; dS (bf16, half P's size) stays on chip. A step's tile costs this only where it does not fit
# the VMEM beside the kernels' scoped limit (:func:`_peak`'s rule, step by step: at 8192 tokens the
# two largest of a causal schedule's 16 steps, 8192 and 7680 query rows, spill their 128 and 120 MiB
# f32 tiles out of v5e's 112 MiB, the 7168-row step's 112 MiB fits), and always without a chip.
BLOCKWISE_FWD_TILE_PASSES = (
    ("S = Q K^T: write (f32)", lambda p: 4),
    ("max, exp, row sum and P V fused: read S", lambda p: 4),
)
BLOCKWISE_DELTA_TILE_PASSES = (  # the backward's first pass: delta = rowsum(P * dP)
    ("delta pass: a matmul's tile: write (f32)", lambda p: 4),
    ("delta pass: exp and rowsum(P * dP) fused: read it", lambda p: 4),
)
BLOCKWISE_BWD_TILE_PASSES = (
    ("P = exp(S - lse) fused into Q K^T: write (f32)", lambda p: 4),
    ("dS = P (dO V^T - delta) fused: read P", lambda p: 4),
    ("dV += P^T dO: read P", lambda p: 4),
)


def _blockwise(impl: str, spec, mode: str, q_block: int, kv_block: int, chip: ChipSpec | None = None) -> Cost:
    """tpuattn.blockwise's schedule (:func:`tpuattn.impl.blockwise.schedule`): one XLA step per (kv
    block, run of q blocks that see it).

    Each step is one batched matmul over all its query rows, all heads and the GQA group, so
    K_t and V_t are read once per step (per kv head); the step's query rows and their f32
    running state (acc, max, sum) go through HBM unless ``chip`` holds them, and its score tiles
    where they do not fit (:data:`BLOCKWISE_FWD_TILE_PASSES`). The backward is two passes over the
    schedule: delta = rowsum(P * dP), then dQ, dK, dV.
    """
    _check_blocks(q_block, kv_block)
    e = _itemsize(spec.dtype)
    p = e
    d = spec.head_dim
    visited, nq, nk, _ = _visited_tiles(spec.mask, q_block, kv_block)
    step_rows = [(s.q_hi - s.q_lo) * q_block for s in blockwise_schedule(spec.mask, q_block, kv_block)]
    steps = len(step_rows)
    q_heads, kv_heads = spec.batch * spec.num_q_heads, spec.batch * spec.num_kv_heads
    q_tile, kv_tile = q_block * d * e, kv_block * d * e
    scores = q_heads * visited * q_block * kv_block
    flops = q_heads * visited * float(FORWARD_FLOPS_PER_SCORE) * q_block * kv_block * d
    state = q_block * d * 4 + 2 * q_block * 4  # acc, max, sum of one q block (f32)
    q_bytes, kv_bytes, _ = _io_bytes(spec)

    def placed(buffers):  # name -> True where _peak's rule keeps the buffer in VMEM (given a chip)
        rows = _peak(0, 0, [(w, b, "temp") for w, b in buffers], chip)[1]
        return {what: where == "VMEM" for what, _, where in rows if what in dict(buffers)}

    def term(name, nbytes, on_chip):  # a breakdown row: no HBM traffic for a buffer VMEM holds
        return (name + " (on chip)", 0.0) if on_chip else (name, nbytes)

    # The scores of the steps whose f32 tile does not fit on chip, step by step.
    step_scores = [q_heads * rows * kv_block for rows in step_rows]
    spilled = [n for n in step_scores if not placed([("S", 4 * n)])["S"]]

    def tile_terms(prefix, passes):
        if not spilled:
            return [(prefix + name + " (on chip)", 0.0) for name, _ in passes]
        return [(prefix + name + f" ({len(spilled)} of {steps} steps)", per(p) * sum(spilled))
                for name, per in passes]

    fwd_vmem = placed([("state", q_heads * nq * state)])
    breakdown = [
        ("read K, V (once per step, per kv head)", kv_heads * steps * 2 * kv_tile),
        ("read Q rows (per visited tile)", q_heads * visited * q_tile),
        term("state (acc, max, sum): read + write per visited tile", q_heads * visited * 2 * state,
             fwd_vmem["state"]),
        ("write O and logsumexp", q_heads * nq * (q_tile + 4 * q_block)),
    ] + tile_terms("tile: ", BLOCKWISE_FWD_TILE_PASSES)
    peak = 2 * q_bytes + 2 * kv_bytes + q_heads * nq * state
    peak += 4 * max(spilled, default=0)  # the largest spilled step's f32 tile
    if mode == "fwd+bwd":
        flops += q_heads * visited * 10.0 * q_block * kv_block * d  # S, dP, dV, dQ, dK
        flops += q_heads * visited * 4.0 * q_block * kv_block * d  # the delta pass: S and dP again
        # the backward's float32 sums: dQ per q block, dK and dV per kv block
        dq_sums, dkv_sums = q_heads * nq * q_block * d * 4, kv_heads * nk * 2 * kv_block * d * 4
        bwd_vmem = placed([("dQ sums", dq_sums), ("dK, dV sums", dkv_sums)])
        breakdown += [
            ("bwd delta pass: read K, V (per step, per kv head)", kv_heads * steps * 2 * kv_tile),
            ("bwd delta pass: read Q, dO, lse per visited tile; write delta",
             q_heads * visited * (2 * q_tile + 8 * q_block) + q_heads * nq * 4 * q_block),
        ] + tile_terms("bwd ", BLOCKWISE_DELTA_TILE_PASSES) + [
            ("bwd: read K, V (per step, per kv head)", kv_heads * steps * 2 * kv_tile),
            term("bwd: dK, dV f32 sums read + write per step", kv_heads * steps * 2 * 2 * kv_block * d * 4,
                 bwd_vmem["dK, dV sums"]),
            ("bwd: read Q, dO, lse, delta per visited tile", q_heads * visited * (2 * q_tile + 12 * q_block)),
            term("bwd: dQ f32 sums read + write per visited tile", q_heads * visited * 2 * q_block * d * 4,
                 bwd_vmem["dQ sums"]),
        ] + tile_terms("bwd tile: ", BLOCKWISE_BWD_TILE_PASSES)
        peak += 2 * q_bytes + 2 * kv_bytes + q_heads * nq * q_block * d * 4
    return Cost(impl=impl, mode=mode, schedule="blockwise (XLA loop)", flops=flops,
                transcendentals=float(scores * (1 if mode == "fwd" else 3) * transcendentals_per_score(spec)),
                standard_flops=standard_flops(spec, mode), hbm_bytes=sum(b for _, b in breakdown),
                peak_hbm_bytes=float(peak), vmem_bytes=0.0, breakdown=tuple(breakdown),
                visited_fraction=visited / (nq * nk))


def default_blocks(impl: str, spec, chip: ChipSpec | None = None) -> tuple[int, int]:
    """The ``(q_block, kv_block)`` ``impl`` runs by default for ``spec`` (its record's
    ``default_blocks``), on ``chip`` (``None``: the target chip, or this machine)."""
    record = api.get_implementation(impl)
    if record.default_blocks is None:
        raise ValueError(f"q_block, kv_block: {impl!r} registers no default blocks; pass both")
    return tuple(record.default_blocks(spec, None if chip is None else _as_chip_spec(chip).name))


def cost(impl: str, spec, mode: str = "fwd", *, q_block: int | None = None, kv_block: int | None = None,
         fused_backward: bool = False, chip: ChipSpec | None = None, arguments: str = "contract") -> Cost:
    """FLOPs and HBM bytes of ``impl``'s schedule (its record's ``schedule``) for ``spec``.

    Blocks default to :func:`default_blocks` (``chip`` sizes them, as it sizes the kernel's).
    ``arguments``: how Q, K, V arrive and O leaves, one of :data:`ARGUMENT_SHAPES` (the module's
    docstring, "Argument shapes"); only a flash schedule whose kernel reads the columns view tells
    them apart.
    """
    check_mode(mode)
    if arguments not in ARGUMENT_SHAPES:
        raise TpuattnError(f"arguments: expected one of {list(ARGUMENT_SHAPES)}, got {arguments!r}")
    schedule = api.get_implementation(impl).schedule
    if schedule is None:
        raise ValueError(f"impl: expected one of {sorted(models())} (modelled schedules), got {impl!r}")
    if schedule not in SCHEDULES:  # a misspelt schedule is an error, never a silent default
        raise ValueError(f"{impl}: its record's schedule: expected one of {list(SCHEDULES)}, "
                         f"got {schedule!r}")
    if schedule == "materialised":  # XLA's programs: the model does not tell the shapes apart
        chip = None if chip is None else _as_chip_spec(chip)
        return dataclasses.replace(_materialised(impl, spec, mode, chip), arguments=arguments)
    if q_block is None or kv_block is None:
        default_q, default_kv = default_blocks(impl, spec, chip)
        q_block = default_q if q_block is None else q_block
        kv_block = default_kv if kv_block is None else kv_block
    if schedule in ("flash", "flash (row-sum pass)"):
        return _flash(impl, spec, mode, q_block, kv_block, fused_backward,
                      row_sum_pass=schedule == "flash (row-sum pass)",
                      chip=None if chip is None else _as_chip_spec(chip), arguments=arguments)
    return dataclasses.replace(_blockwise(impl, spec, mode, q_block, kv_block,  # "blockwise (XLA loop)"
                                          chip=None if chip is None else _as_chip_spec(chip)),
                               arguments=arguments)


# ----------------------------------------------------------------------------- predictions
@dataclasses.dataclass(frozen=True)
class Prediction:
    """The roofline lower bound of one schedule on one chip (modelled)."""

    cost: Cost
    chip: ChipSpec
    compute_s: float
    memory_s: float

    @property
    def vector_s(self) -> float | None:
        """The exps at the chip's transcendental rate (:data:`TRANSCENDENTALS`); None for a
        :class:`ChipSpec` built without one, and then left out of :attr:`time_s`."""
        rate = self.chip.transcendentals_per_second
        return None if rate is None else self.cost.transcendentals / rate

    @property
    def time_s(self) -> float:
        return max(self.compute_s, self.memory_s, self.vector_s or 0.0)

    @property
    def bound(self) -> str:
        if self.vector_s is not None and self.vector_s > max(self.compute_s, self.memory_s):
            return "vector"
        return "compute" if self.compute_s >= self.memory_s else "memory"

    @property
    def fits_hbm(self) -> bool:
        return self.cost.peak_hbm_bytes <= self.chip.hbm_capacity

    @property
    def fits_vmem(self) -> bool:
        """Within the VMEM a kernel is given (:attr:`ChipSpec.vmem_budget_bytes`)."""
        return self.cost.vmem_bytes <= self.chip.vmem_budget_bytes

    @property
    def standard_tflops(self) -> float:
        """Conventional TFLOP/s at the predicted time (what a benchmark would report)."""
        return self.cost.standard_flops / self.time_s / 1e12

    def as_dict(self) -> dict:
        return {"impl": self.cost.impl, "chip": self.chip.name, "mode": self.cost.mode,
                "schedule": self.cost.schedule, "flops": self.cost.flops, "hbm_bytes": self.cost.hbm_bytes,
                "intensity": self.cost.intensity, "compute_s": self.compute_s, "memory_s": self.memory_s,
                "time_s": self.time_s, "bound": self.bound, "standard_tflops": self.standard_tflops,
                "peak_hbm_bytes": self.cost.peak_hbm_bytes, "fits_hbm": self.fits_hbm,
                "transcendentals": self.cost.transcendentals, "vector_s": self.vector_s,
                "vmem_bytes": self.cost.vmem_bytes, "fits_vmem": self.fits_vmem, "label": "modelled"}


def predict(impl: str, spec, chip, mode: str = "fwd", *, precision: str = "highest",
            **schedule) -> Prediction:
    """Lower-bound time ``max(flops / peak, bytes / bandwidth, exps / exp rate)`` of ``impl`` on ``chip``
    (``precision`` as in :meth:`ChipSpec.peak_flops`)."""
    chip = _as_chip_spec(chip)
    c = cost(impl, spec, mode, chip=chip, **schedule)
    return Prediction(cost=c, chip=chip, compute_s=c.flops / chip.peak_flops(spec.dtype, precision),
                      memory_s=c.hbm_bytes / chip.hbm_bandwidth)


def materialise_crossover(chip, *, batch: int = 1, heads: int = 8, kv_heads: int | None = None,
                          head_dim: int = 128, dtype="bfloat16", mode: str = "fwd") -> int:
    """Smallest sequence length at which no materialised schedule fits in HBM: even the leanest graph
    (S in f32, plus P for the backward) exceeds it (modelled; the compile stage checks it against the
    compiler's own out-of-memory: jax.nn's XLA path keeps a second score buffer while HBM allows and
    drops it when short).

    The live set grows as ``c2 * T^2 + c1 * T`` (score buffers plus inputs and outputs); this
    solves ``c2 * T^2 + c1 * T > capacity`` exactly.
    """
    chip = _as_chip_spec(chip)
    check_mode(mode)

    def peak(t: int) -> float:
        spec = problem(t, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
        return _materialised("reference", spec, mode).peak_hbm_bytes

    c1 = peak(1) - (peak(2) - 2 * peak(1)) / 2  # from peak(t) = c2 t^2 + c1 t
    c2 = (peak(2) - 2 * peak(1)) / 2
    t = int((-c1 + math.sqrt(c1 * c1 + 4 * c2 * chip.hbm_capacity)) / (2 * c2))
    while peak(t) > chip.hbm_capacity:
        t -= 1
    while peak(t + 1) <= chip.hbm_capacity:
        t += 1
    return t + 1


def vmem_crossover(chip, *, q_block: int = 128, head_dim: int = 128, dtype="bfloat16") -> int:
    """Smallest kv length at which a fused kernel holding whole score rows no longer fits the VMEM
    a kernel is given (:attr:`ChipSpec.vmem_budget_bytes`).

    Such a kernel (softmax without the online rescaling) keeps, per core, a row block of
    scores ``[q_block, T]`` in f32 plus the whole K and V ``[T, head_dim]`` of one head.
    """
    chip = _as_chip_spec(chip)
    positive_int("q_block", q_block)
    positive_int("head_dim", head_dim)
    e = _itemsize(dtype)
    fixed = 2 * q_block * head_dim * e + q_block * head_dim * 4  # Q and O blocks, f32 accumulator
    per_token = q_block * 4 + 2 * head_dim * e
    return (chip.vmem_budget_bytes - fixed) // per_token + 1


def roofline_curve(chip, intensities, dtype="bfloat16") -> np.ndarray:
    """Attainable FLOP/s ``min(peak, intensity * bandwidth)`` for an array of intensities."""
    chip = _as_chip_spec(chip)
    intensities = np.asarray(intensities, dtype=np.float64)
    return np.minimum(chip.peak_flops(dtype), intensities * chip.hbm_bandwidth)
