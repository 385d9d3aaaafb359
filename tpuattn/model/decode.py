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
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tpuattn import chips
from tpuattn.model import roofline

LABEL = "modelled"


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

    @property
    def bytes(self) -> float:
        return self.cache_bytes + self.io_bytes

    @property
    def time_s(self) -> float:
        return max(self.memory_s, self.compute_s)


def visible_positions(lengths, q_len: int, window_left: int | None = None) -> np.ndarray:
    lengths = np.asarray(lengths, np.int64)
    return lengths if window_left is None else np.minimum(lengths, q_len + window_left)


def decode_roofline(lengths, *, q_len: int = 1, heads: int, kv_heads: int, head_dim: int,
                    dtype="bfloat16", chip="v5e", window_left: int | None = None,
                    pages_per_sequence: int = 0) -> DecodeRoofline:
    """The modelled cost of one decode step for ``lengths`` (one per sequence) on one device of ``chip``
    (a chip name, a :class:`tpuattn.chips.Chip` or a :class:`tpuattn.model.roofline.ChipSpec`)."""
    device = chip if isinstance(chip, roofline.ChipSpec) else roofline.chip_spec(chip)
    itemsize = roofline._itemsize(dtype)
    peak = device.peak_flops(dtype)
    lengths = np.asarray(lengths, np.int64).reshape(-1)
    batch = len(lengths)
    visible = int(visible_positions(lengths, q_len, window_left).sum())
    cache = visible * 2 * kv_heads * head_dim * itemsize
    io = 2 * batch * q_len * heads * head_dim * itemsize + 4 * batch * (1 + pages_per_sequence)
    flops = 4.0 * q_len * heads * head_dim * visible
    ridge = peak / device.hbm_bandwidth
    memory_s, compute_s = (cache + io) / device.hbm_bandwidth, flops / peak
    group = heads // kv_heads
    return DecodeRoofline(chip=device.name, cache_bytes=float(cache), io_bytes=float(io), flops=flops,
                          intensity=flops / (cache + io), ridge=ridge, memory_s=memory_s,
                          compute_s=compute_s, memory_bound=memory_s >= compute_s,
                          crossover_q_len=ridge * itemsize / (2 * group))


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
