"""A roofline for one decode step (every number here is *modelled*, not measured or compiled).

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
* time per chip = max(bytes / HBM bandwidth, FLOPs / peak bf16 FLOP/s) (:mod:`tpuattn.chips`), and the
  ``q_len`` at which the two meet: ``ridge * itemsize / (2 * group)`` with ridge = peak / bandwidth.

``visible_b`` is ``lengths[b]`` without a window, else the union of the queries' windows
(``min(lengths[b], q_len + left)``). The model is a lower bound: it ignores the partials that a
split-K kernel writes and merges, padding to tiles, and (for the reference) the gathered copy.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tpuattn import chips

LABEL = "modelled"


@dataclasses.dataclass(frozen=True)
class DecodeRoofline:
    chip: str
    cache_bytes: float  # K and V of the visible positions
    io_bytes: float  # q, output, lengths, page table
    flops: float
    intensity: float  # FLOPs per byte read or written
    ridge: float  # the chip's peak FLOP/s / HBM bandwidth
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
    """The modelled cost of one decode step for ``lengths`` (one per sequence) on ``chip``."""
    itemsize = np.dtype("float32").itemsize if str(dtype) == "float32" else 2
    chip = chips.get(chip) if isinstance(chip, str) else chip
    lengths = np.asarray(lengths, np.int64).reshape(-1)
    batch = len(lengths)
    visible = int(visible_positions(lengths, q_len, window_left).sum())
    cache = visible * 2 * kv_heads * head_dim * itemsize
    io = 2 * batch * q_len * heads * head_dim * itemsize + 4 * batch * (1 + pages_per_sequence)
    flops = 4.0 * q_len * heads * head_dim * visible
    ridge = chip.bf16_flops / chip.hbm_bandwidth
    memory_s, compute_s = (cache + io) / chip.hbm_bandwidth, flops / chip.bf16_flops
    group = heads // kv_heads
    return DecodeRoofline(chip=chip.name, cache_bytes=float(cache), io_bytes=float(io), flops=flops,
                          intensity=flops / (cache + io), ridge=ridge, memory_s=memory_s,
                          compute_s=compute_s, memory_bound=memory_s >= compute_s,
                          crossover_q_len=ridge * itemsize / (2 * group))


def table(lengths, *, q_len=1, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16", chip_names=None,
          window_left=None) -> list[dict]:
    """One row per chip (dicts, every number labelled modelled), for notebooks and reports."""
    rows = []
    for name in chip_names or chips.NAMES:
        r = decode_roofline(lengths, q_len=q_len, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                            dtype=dtype, chip=name, window_left=window_left)
        rows.append(dict(chip=name, bytes=r.bytes, flops=r.flops, intensity=r.intensity, ridge=r.ridge,
                         time_us=r.time_s * 1e6, memory_bound=r.memory_bound,
                         crossover_q_len=r.crossover_q_len, label=r.label))
    return rows
