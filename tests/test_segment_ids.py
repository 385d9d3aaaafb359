"""Segment ids compare by integer value, whatever their dtypes: ids of different widths or
signedness that merely share bits (int32 -1 and uint32 4294967295) or low bits (int32 0 and int64
2**32) are different segments. Checked against the float64 oracle, which compares Python ints."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from oracle import oracle_attention

import tpuattn
from tpuattn.numerics import x64

# (q ids, kv ids): each pair holds values that a cast to one narrow dtype would make equal.
PAIRS = {
    "int32 vs int64 2**32": (np.array([[0, 1, 0, 1]], np.int32),
                             np.array([[2**32, 1, 0, 2**32 + 1]], np.int64)),
    "int32 -1 vs uint32 max": (np.array([[-1, 5, -1, 5]], np.int32),
                               np.array([[4294967295, 5, 4294967295, 5]], np.uint32)),
    "int64 -1 vs uint64 max": (np.array([[-1, 7, -1, 7]], np.int64),
                               np.array([[2**64 - 1, 7, 2**64 - 1, 7]], np.uint64)),
    "uint32 alone": (np.array([[2**31, 2**31 + 1, 3, 3]], np.uint32),
                     np.array([[2**31, 3, 3, 2**31 + 1]], np.uint32)),
    "int8 vs int16": (np.array([[3, 3, 4, 4]], np.int8), np.array([[3, 259, 4, 260]], np.int16)),
}


def _as_python_ints(ids):
    return np.array([[int(x) for x in row] for row in ids], dtype=object)


@pytest.mark.parametrize("impl", ["reference", "xla", "blockwise"])
@pytest.mark.parametrize("name", sorted(PAIRS))
def test_ids_of_different_widths_compare_by_value(name, impl):
    q_ids, kv_ids = PAIRS[name]
    needs_x64 = max(q_ids.dtype.itemsize, kv_ids.dtype.itemsize) > 4
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, 2, 8)).astype(np.float32) for _ in range(3))
    want = oracle_attention(q, k, v, segment_ids=(_as_python_ints(q_ids), _as_python_ints(kv_ids)))
    with x64(needs_x64):
        got = tpuattn.attention(q, k, v, segment_ids=(q_ids, kv_ids), impl=impl)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-5, rtol=2e-5)


def test_numpy_and_jax_ids_give_the_same_segments():
    from tpuattn.spec import dense_segment_ids

    q_ids, kv_ids = PAIRS["int32 -1 vs uint32 max"]
    a_np, b_np = dense_segment_ids(q_ids, kv_ids)
    a_jx, b_jx = dense_segment_ids(jax.numpy.asarray(q_ids), jax.numpy.asarray(kv_ids))
    same_np = np.asarray(a_np)[:, :, None] == np.asarray(b_np)[:, None, :]
    same_jx = np.asarray(a_jx)[:, :, None] == np.asarray(b_jx)[:, None, :]
    want = _as_python_ints(q_ids)[:, :, None] == _as_python_ints(kv_ids)[:, None, :]
    assert (same_np == want).all() and (same_jx == want).all()
