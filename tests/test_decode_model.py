"""The decode roofline's ragged batches and quantized caches (tpuattn.model.decode_roofline; modelled
numbers).

The expected bytes and FLOPs are counted here from the problem's description, per sequence and per
array (K, V, their scales, q, the output, the int32 metadata), not from the model's formula.
"""

from __future__ import annotations

import numpy as np
import pytest

from tpuattn.errors import TpuattnError
from tpuattn.model.decode_roofline import decode_roofline

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def _count(lengths, q_lens, *, cache_itemsize, scales_per_tensor, pages_per_sequence, window_left=None,
           ragged=True):
    """Bytes and FLOPs of one step, counted sequence by sequence, query row by query row."""
    cache = io = flops = 0
    for length, q_len in zip(lengths, q_lens, strict=True):
        # every position some query of the sequence sees (the queries are its last q_len positions)
        seen = set()
        for t in range(q_len):
            position = length - q_len + t
            lo = 0 if window_left is None else max(0, position - window_left)
            seen.update(range(lo, length))  # the kernels read whole rows up to the length
        cache += len(seen) * KV_HEADS * HEAD_DIM * cache_itemsize * 2  # K and V
        io += q_len * HEADS * HEAD_DIM * 2 * 2  # q and the output, bfloat16
        io += 4 + 4 * pages_per_sequence  # the length and the page table row
        flops += q_len * len(seen) * HEADS * HEAD_DIM * 2 * 2  # q.k and p.v, a multiply-add is 2
    cache += 2 * scales_per_tensor * 4  # float32 scales of K and of V
    if ragged:
        io += 4 * (len(lengths) + 1) + 4  # cu_q_lens and num_seqs
    return cache, io, flops


@pytest.mark.parametrize("cache_dtype, scales, itemsize, per_tensor", [
    ("bfloat16", None, 2, 0), ("int8", "tensor", 1, 1), ("int8", "kv_head", 1, KV_HEADS),
    ("float8_e4m3fn", "tensor", 1, 1), ("float8_e4m3fn", "kv_head", 1, KV_HEADS)])
def test_a_quantized_cache_moves_one_byte_an_element_plus_its_scales(cache_dtype, scales, itemsize,
                                                                       per_tensor):
    lengths = [1024, 700, 5, 0]
    r = decode_roofline(lengths, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                               cache_dtype=cache_dtype, scales=scales, pages_per_sequence=16, chip="v6e")
    cache, io, flops = _count(lengths, [1] * 4, cache_itemsize=itemsize, scales_per_tensor=per_tensor,
                              pages_per_sequence=16, ragged=False)
    assert (r.cache_bytes, r.io_bytes, r.flops) == (cache, io, flops)
    assert r.scale_bytes == 2 * per_tensor * 4 and r.cache_dtype == cache_dtype and r.label == "modelled"
    full = decode_roofline(lengths, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                  pages_per_sequence=16, chip="v6e")
    # about half a bfloat16 cache's bytes, the same FLOPs at q's (bfloat16) peak: twice the intensity
    assert r.cache_bytes - r.scale_bytes == full.cache_bytes * itemsize / 2
    assert r.flops == full.flops and r.compute_s == full.compute_s
    assert r.crossover_q_len == pytest.approx(full.crossover_q_len * itemsize / 2)


@pytest.mark.parametrize("window_left", [None, 100])
def test_a_ragged_batch_counts_each_sequence_with_its_own_queries(window_left):
    # 2 prefill chunks (one across a page boundary, one the whole sequence) beside decodes and an idle
    # sequence (no new query).
    lengths = [1024, 300, 256, 77, 1, 640]
    q_lens = [256, 200, 256, 1, 1, 0]
    r = decode_roofline(lengths, q_lens=q_lens, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                               window_left=window_left, pages_per_sequence=16)
    cache, io, flops = _count(lengths, q_lens, cache_itemsize=2, scales_per_tensor=0, pages_per_sequence=16,
                              window_left=window_left)
    assert (r.cache_bytes, r.io_bytes, r.flops, r.tokens) == (cache, io, flops, sum(q_lens))


def test_a_ragged_batch_of_equal_query_lengths_costs_what_the_uniform_batch_does_plus_its_offsets():
    kw = dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, pages_per_sequence=8, chip="v5e")
    uniform = decode_roofline([512, 100, 9], q_len=4, **kw)
    ragged = decode_roofline([512, 100, 9], q_lens=np.array([4, 4, 4]), **kw)
    assert ragged.cache_bytes == uniform.cache_bytes and ragged.flops == uniform.flops
    assert ragged.io_bytes - uniform.io_bytes == 4 * (3 + 1) + 4  # cu_q_lens and num_seqs


@pytest.mark.parametrize("kwargs, match", [
    (dict(q_lens=[1, 2]), r"q_lens: expected one integer per sequence \(3\), got int64 of shape \(2,\)"),
    (dict(q_lens=[1.0, 1.0, 1.0]), r"q_lens: expected one integer per sequence \(3\), got float64"),
    (dict(q_lens=[1, -1, 1]), r"q_lens: each must be in \[0, lengths\[b\]\].*got q_lens=\[1, -1, 1\]"),
    (dict(q_lens=[1, 11, 1]), r"q_lens: each must be in \[0, lengths\[b\]\].*lengths=\[10, 10, 10\]"),
    (dict(q_lens=[1, 1, 1], q_len=2), r"q_len: give q_len .* or q_lens .* not both; got q_len=2"),
    (dict(cache_dtype="int8"), r"scales: a int8 cache is quantized and needs its scales.*got None"),
    (dict(cache_dtype="float8_e4m3fn"), r"scales: a float8_e4m3fn cache is quantized"),
    (dict(scales="tensor"), r"scales: a bfloat16 cache is not quantized .*got scales='tensor'"),
    (dict(cache_dtype="int8", scales="row"), r"scales: expected one of \['kv_head', 'tensor'\].*got 'row'"),
])
def test_bad_model_inputs_are_refused_naming_the_argument(kwargs, match):
    with pytest.raises(TpuattnError, match=match):
        decode_roofline([10, 10, 10], heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, **kwargs)
