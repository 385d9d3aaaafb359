"""Decode on inputs off the beaten path, against the float64 decode oracle (tests/decode_oracle.py):

* ``-1`` in unused page-table entries (the documented convention) with lengths traced under
  ``jax.jit`` and a NumPy table, and with concrete unsigned lengths (uint8, uint32);
* lengths and page ids of narrow, wide and unsigned dtypes, clipped without wrapping under jit;
* ``impl="jax_paged"`` under ``jax_enable_x64``.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from decode_oracle import oracle_decode

from tpuattn import decode
from tpuattn.numerics import x64

B, H, HK, D, PAGES, PAGE = 2, 4, 2, 128, 8, 16
TABLE = np.array([[5, 1, -1, -1], [2, 3, 0, -1]], np.int32)  # -1: unused
LENGTHS = (20, 40)  # sequence 0 uses pages 5, 1; sequence 1 uses 2, 3, 0


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, 1, H, D)).astype(np.float32)
    k = rng.standard_normal((PAGES, PAGE, HK, D)).astype(np.float32)
    v = rng.standard_normal((PAGES, PAGE, HK, D)).astype(np.float32)
    return q, k, v


def _want(q, k, v):
    return oracle_decode(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                         np.array(LENGTHS), page_table=TABLE)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_minus_one_in_unused_entries_with_lengths_traced_under_jit(impl):
    q, k, v = _inputs()
    step = jax.jit(lambda q, k, v, lengths: decode.attention(q, k, v, lengths, page_table=TABLE, impl=impl))
    got = step(q, k, v, np.array(LENGTHS, np.int32))
    np.testing.assert_allclose(np.asarray(got, np.float64), _want(q, k, v), atol=2e-5, rtol=2e-5)


# The lengths are normalised once, in the spec, for every implementation: every dtype through the
# reference, and the kernel once.
@pytest.mark.parametrize(("impl", "dtype"), [("reference", "uint8"), ("reference", "uint32"),
                                             ("reference", "int64"), ("pallas", "uint32")])
def test_minus_one_in_unused_entries_with_lengths_of_any_integer_dtype(impl, dtype):
    q, k, v = _inputs(1)
    with x64(np.dtype(dtype).itemsize > 4):
        got = decode.attention(q, k, v, np.array(LENGTHS, dtype), page_table=TABLE, impl=impl)
    np.testing.assert_allclose(np.asarray(got, np.float64), _want(q, k, v), atol=2e-5, rtol=2e-5)


def test_a_used_entry_of_minus_one_is_still_refused_for_unsigned_lengths():
    q, k, v = _inputs()
    table = TABLE.copy()
    table[1, 2] = -1  # sequence 1 (length 40) uses page slot 2
    with pytest.raises(ValueError, match=r"page_table: expected page ids in \[0, 8\) for the pages in use, "
                                         r"got -1 at \[1, 2\]"):
        decode.attention(q, k, v, np.array(LENGTHS, np.uint32), page_table=table, impl="reference")


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16"])
def test_traced_narrow_lengths_are_clipped_without_wrapping(dtype):
    """Under jit lengths are clipped into [0, capacity] (documented); capacity 64 fits every dtype
    here, and a length of 100 in int8 must clip to 64, not wrap."""
    q, k, v = _inputs(2)
    lengths = np.array([100 if dtype != "uint8" else 200, 40], dtype)
    table = np.array([[5, 1, 4, 6], [2, 3, 0, 7]], np.int32)
    step = jax.jit(lambda lengths: decode.attention(q, k, v, lengths, page_table=table, impl="reference"))
    got = step(lengths)
    want = oracle_decode(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                         np.array([64, 40]), page_table=table)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-5, rtol=2e-5)


def test_jax_paged_under_x64():
    if "jax_paged" not in decode.implementations():
        pytest.skip("JAX's paged_attention is not available on this JAX")
    q, k, v = _inputs(3)
    with x64(True):
        got = decode.attention(q, k, v, np.array(LENGTHS, np.int32), page_table=TABLE, impl="jax_paged")
    # JAX's kernel rounds K and V to bfloat16 (see tpuattn.decode.native): bfloat16 accuracy.
    np.testing.assert_allclose(np.asarray(got, np.float64), _want(q, k, v), atol=3e-2, rtol=3e-2)
