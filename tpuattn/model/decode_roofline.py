"""A roofline for one decode step (every number here is *modelled*, not measured or compiled).

**Units: one JAX device**, as everywhere in :mod:`tpuattn.model` (:meth:`tpuattn.chips.Chip.per_device`):
the whole chip on v5e, v6e and the megacore v4 and v5p; one of the two TensorCores (half the chip's
FLOP/s and HBM bandwidth) on v2, v3 and tpu7x. The peak FLOP/s is the one the attention roofline uses
for the dtype (:meth:`tpuattn.model.roofline.ChipSpec.peak_flops`): bf16 peak for bf16/f16, the
modelled f32 peak (bf16 peak / 6: ``Precision.HIGHEST``, which the decode kernels use for f32) for f32.

A decode step reads, per sequence, K and V of every position a query can see, for every kv head, plus
``q`` and writes the output; it does ``4 * q_len * heads * head_dim`` FLOPs per key position (``q.k``
and ``p.v``, 2 FLOPs per multiply-add each). So

* bytes  = sum_b visible_b * 2 * kv_heads * head_dim * itemsize  +  2 * batch * q_len * heads * head_dim
  * itemsize  (+ lengths and page table, int32);
* FLOPs  = sum_b visible_b * 4 * q_len * heads * head_dim;
* intensity = FLOPs / cache bytes ~= 2 * q_len * group / itemsize FLOP per byte, i.e. ``group x q_len``
  FLOPs per (K, V) byte pair in bf16. It does not depend on the batch: every sequence reads its own
  cache, so batching more sequences never makes decode compute-bound; only more queries per cached
  key (a larger GQA group, speculative ``q_len``) does;
* time per device = max(bytes / HBM bandwidth, FLOPs / peak FLOP/s for the dtype), and the ``q_len`` at
  which the two meet: ``ridge * itemsize / (2 * group)`` with ridge = peak / bandwidth.

``visible_b`` is ``lengths[b]`` without a window, else the union of the queries' windows
(``min(lengths[b], q_len + left)``). The model is a lower bound: it ignores the partials that a
split-K kernel writes and merges, padding to tiles, and (for the reference) the gathered copy. The
split-K kernel reads the cache in place, so the compiler's bytes accessed for it stay within 1.25x of
these bytes (1.09x at notebook 07's serving shape on v5e; ``tests/test_aot_decode.py`` holds it there).

Two things an inference engine's batch adds (:func:`decode_roofline`'s ``q_lens``, ``cache_dtype`` and
``scales``):

* a **ragged batch**: each sequence has its own number of new queries ``q_lens[b]`` (a chunk of prefill
  beside single-token decodes; 0 allowed: an idle sequence reads nothing), the queries flat
  ``[sum(q_lens), heads, head_dim]``. Then ``q_len`` above becomes ``q_lens[b]`` per sequence: the cache
  term is unchanged, q and the output are ``sum(q_lens)`` rows, ``cu_q_lens`` (``batch + 1``) and
  ``num_seqs`` (one) int32 are read beside the lengths, and under a window
  ``visible_b = min(lengths[b], q_lens[b] + left)``;
* a **quantized cache**: K and V stored as int8 or fp8 (``float8_e4m3fn``), one byte an element, plus
  their float32 scales (``scales="tensor"``: one for K and one for V; ``"kv_head"``: one per kv head
  each), so the cache term is ``visible * 2 * kv_heads * head_dim * 1 + scale bytes``, about half of a
  bfloat16 cache's. The FLOPs are the same (the kernels dequantize to q's dtype and multiply at its
  peak), so a quantized cache doubles the intensity and halves ``crossover_q_len``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tpuattn import chips
from tpuattn.errors import TpuattnError
from tpuattn.model import roofline

LABEL = "modelled"
# Cache dtypes of one byte an element that need scales (a quantized cache), and the scale layouts.
QUANTIZED_CACHE_DTYPES = ("int8", "float8_e4m3fn")
SCALES = {None: 0, "tensor": 1, "kv_head": None}  # scales per K (and per V): None = kv_heads
SCALE_ITEMSIZE = 4  # float32


@dataclasses.dataclass(frozen=True)
class DecodeRoofline:
    """One decode step on one JAX device of ``chip`` (see the module docstring)."""

    chip: str
    cache_bytes: float  # K and V of the visible positions
    io_bytes: float  # q, output, lengths, page table
    flops: float
    intensity: float  # FLOPs per byte read or written
    ridge: float  # the device's peak FLOP/s for the dtype / HBM bandwidth
    memory_s: float
    compute_s: float
    memory_bound: bool
    crossover_q_len: float  # q_len at which this problem would stop being memory-bound
    label: str = LABEL
    cache_dtype: str = "bfloat16"  # K and V as stored (int8 or float8_e4m3fn: quantized)
    scale_bytes: float = 0.0  # the quantized cache's float32 scales (inside cache_bytes)
    tokens: int = 0  # new query rows in the step (batch * q_len, or sum(q_lens))

    @property
    def bytes(self) -> float:
        return self.cache_bytes + self.io_bytes

    @property
    def time_s(self) -> float:
        return max(self.memory_s, self.compute_s)


def visible_positions(lengths, q_len, window_left: int | None = None) -> np.ndarray:
    """Positions a sequence's queries see: ``lengths`` without a window, else ``min(lengths, q_len +
    left)``; ``q_len`` an int or one per sequence (a ragged batch)."""
    lengths = np.asarray(lengths, np.int64)
    return lengths if window_left is None else np.minimum(lengths, np.asarray(q_len, np.int64) + window_left)


def _q_lens(lengths: np.ndarray, q_len: int, q_lens) -> np.ndarray:
    """One query count per sequence, checked: ``q_len`` for each, or the ragged batch's ``q_lens``."""
    if q_lens is None:
        return np.full(len(lengths), q_len, np.int64)
    if q_len != 1:
        raise TpuattnError(f"q_len: give q_len (every sequence's new queries) or q_lens (one per sequence), "
                           f"not both; got q_len={q_len} and q_lens")
    q_lens = np.asarray(q_lens).reshape(-1)
    if not np.issubdtype(q_lens.dtype, np.integer) or q_lens.shape != lengths.shape:
        raise TpuattnError(f"q_lens: expected one integer per sequence ({len(lengths)}), got "
                           f"{q_lens.dtype} of shape {q_lens.shape}")
    q_lens = q_lens.astype(np.int64)
    if (q_lens < 0).any() or (q_lens > lengths).any():
        raise TpuattnError(f"q_lens: each must be in [0, lengths[b]] (the new queries are the last of a "
                           f"sequence's positions), got q_lens={q_lens.tolist()} for "
                           f"lengths={lengths.tolist()}")
    return q_lens


def _scale_count(cache_dtype: str, scales, kv_heads: int) -> int:
    """Scales per K (and per V) of the cache: 0 for a full-width cache, else 1 or ``kv_heads``."""
    quantized = cache_dtype in QUANTIZED_CACHE_DTYPES
    if scales not in SCALES:
        raise TpuattnError(f"scales: expected one of {sorted(s for s in SCALES if s)} (or None for a "
                           f"full-width cache), got {scales!r}")
    if quantized and scales is None:
        raise TpuattnError(f"scales: a {cache_dtype} cache is quantized and needs its scales, 'tensor' or "
                           f"'kv_head'; got None")
    if not quantized and scales is not None:
        raise TpuattnError(f"scales: a {cache_dtype} cache is not quantized (quantized: "
                           f"{', '.join(QUANTIZED_CACHE_DTYPES)}); got scales={scales!r}")
    return kv_heads if scales == "kv_head" else SCALES[scales]


def decode_roofline(lengths, *, q_len: int = 1, heads: int, kv_heads: int, head_dim: int,
                    dtype="bfloat16", chip="v5e", window_left: int | None = None,
                    pages_per_sequence: int = 0, q_lens=None, cache_dtype=None,
                    scales: str | None = None) -> DecodeRoofline:
    """The modelled cost of one decode step for ``lengths`` (one per sequence) on one device of ``chip``
    (a chip name, a :class:`tpuattn.chips.Chip` or a :class:`tpuattn.model.roofline.ChipSpec`).

    ``dtype`` is q's (and the output's, and the FLOPs' peak); ``cache_dtype`` K and V's as stored
    (default ``dtype``; ``int8`` or ``float8_e4m3fn`` with ``scales`` ``"tensor"`` or ``"kv_head"``);
    ``q_lens`` a ragged batch's new queries per sequence (instead of ``q_len`` for each)."""
    device = chip if isinstance(chip, roofline.ChipSpec) else roofline.chip_spec(chip)
    itemsize = roofline._itemsize(dtype)
    cache_dtype = roofline._dtype_name(cache_dtype or dtype)
    cache_itemsize = roofline._itemsize(cache_dtype)
    peak = device.peak_flops(dtype)
    lengths = np.asarray(lengths, np.int64).reshape(-1)
    batch = len(lengths)
    per_seq = _q_lens(lengths, q_len, q_lens)
    tokens = int(per_seq.sum())
    visible_b = np.where(per_seq > 0, visible_positions(lengths, per_seq, window_left), 0)  # 0: idle
    visible = int(visible_b.sum())
    scale_bytes = 2 * _scale_count(cache_dtype, scales, kv_heads) * SCALE_ITEMSIZE
    cache = visible * 2 * kv_heads * head_dim * cache_itemsize + scale_bytes
    metadata = 4 * batch * (1 + pages_per_sequence) + (4 * (batch + 2) if q_lens is not None else 0)
    io = 2 * tokens * heads * head_dim * itemsize + metadata
    flops = 4.0 * heads * head_dim * float((visible_b * per_seq).sum())
    ridge = peak / device.hbm_bandwidth
    memory_s, compute_s = (cache + io) / device.hbm_bandwidth, flops / peak
    group = heads // kv_heads
    return DecodeRoofline(chip=device.name, cache_bytes=float(cache), io_bytes=float(io), flops=flops,
                          intensity=flops / (cache + io), ridge=ridge, memory_s=memory_s,
                          compute_s=compute_s, memory_bound=memory_s >= compute_s,
                          crossover_q_len=ridge * cache_itemsize / (2 * group), cache_dtype=cache_dtype,
                          scale_bytes=float(scale_bytes), tokens=tokens)


def table(lengths, *, q_len=1, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16", chip_names=None,
          window_left=None) -> list[dict]:
    """One row per chip (dicts, per device, every number labelled modelled), for notebooks and reports."""
    rows = []
    for name in chip_names or chips.NAMES:
        r = decode_roofline(lengths, q_len=q_len, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                            dtype=dtype, chip=name, window_left=window_left)
        rows.append(dict(chip=name, bytes=r.bytes, flops=r.flops, intensity=r.intensity, ridge=r.ridge,
                         time_us=r.time_s * 1e6, memory_bound=r.memory_bound,
                         crossover_q_len=r.crossover_q_len, label=r.label))
    return rows
