"""Decode's rule for non-finite cache values: they reach exactly the output rows that see them.

A NaN or Inf at a position no query of the row sees (before its window, past its sequence's length,
after its own position) changes nothing: the output equals the float64 oracle on a clean cache. One
at a position a row sees makes that row NaN: everywhere for a key, in that column for a value. Every
decode implementation that runs here is checked (JAX's ragged kernel, which cannot, through JAX's own
reference with the adapter's translation) is listed; JAX's kernels are the documented exception.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_oracle import oracle_decode

from tpuattn import decode

TOL = {"float32": 2e-5, "bfloat16": 2e-2}
BF16_INSIDE = {"jax_paged"}  # rounds K and V to bf16 inside the kernel (see tests/test_decode.py)
RAGGED = "jax_ragged (JAX's reference)"
IMPLS = [*decode.implementations(), RAGGED]
JAX_KERNELS = {"jax_paged", "jax_ragged", RAGGED}
LENGTHS = np.array([29, 13], np.int32)  # sequence 0 is poisoned; 29: the last page is partly used
KV_HEADS, GROUP, HEAD_DIM, COL = 2, 2, 32, 5


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    q_len: int
    window: int | None
    dtype: str = "float32"
    paged: bool = True
    pallas: tuple = ()

    @property
    def capacity(self):
        return 32 if self.paged else 40


CASES = [
    # Rows at positions 25..28 see [pos - 5, pos]: page 2 (16..23) is partly visible, pages 0-1 not.
    Case("paged-tq4-window", 4, 5, pallas=(("chunk_blocks", 1), ("pages_per_step", 1))),
    Case("paged-tq1", 1, None, pallas=(("chunk_blocks", 2), ("pages_per_step", 2))),
    Case("paged-bf16-tq4-window", 4, 5, "bfloat16"),
    Case("contig-tq4-window", 4, (5, 0), paged=False, pallas=(("block_size", 8), ("chunk_blocks", 2))),
]

# Where the poison goes, per kind: (which cache, position in sequence 0, kv head, value). A key is
# poisoned in one entry (column 0), a value in column COL.
HIDDEN = [("k", 3, 0, np.nan), ("v", 3, 1, np.inf), ("k", 17, 1, np.inf), ("v", 17, 0, np.nan),
          ("v", 19, 1, -np.inf), ("k", 19, 0, -np.inf)]  # outside every row's window, inside the length
PAST = [("k", 29, 0, np.nan), ("v", 29, 1, np.nan), ("k", 30, 1, np.inf), ("v", 31, 0, -np.inf)]
VISIBLE = [("k", 20, 0, np.inf), ("v", 27, 1, np.nan), ("v", 21, 0, np.inf)]


def visibility(case: Case):
    """Boolean ``[q_len, capacity]``: which positions each row of sequence 0 sees."""
    pos = LENGTHS[0] - case.q_len + np.arange(case.q_len)[:, None]
    j = np.arange(case.capacity)[None, :]
    seen = (j < LENGTHS[0]) & (j <= pos)
    if case.window is not None:
        left = case.window if isinstance(case.window, int) else case.window[0]
        seen &= j >= pos - left
    return seen


def make_inputs(case: Case, seed=0):
    rng = np.random.default_rng(seed)
    b, heads = len(LENGTHS), KV_HEADS * GROUP
    q = rng.standard_normal((b, case.q_len, heads, HEAD_DIM))
    if case.paged:
        pps, size = case.capacity // 8, 8
        num_pages = b * pps + 2
        k = rng.standard_normal((num_pages, size, KV_HEADS, HEAD_DIM))
        table = rng.permutation(num_pages)[: b * pps].reshape(b, pps).astype(np.int32)
    else:
        k = rng.standard_normal((b, case.capacity, KV_HEADS, HEAD_DIM))
        table = None
    return q, k, rng.standard_normal(k.shape), table


def poisoned(case: Case, k, v, table, poison):
    """Copies of the caches with sequence 0's positions poisoned; the NaN rows the rule expects."""
    k, v = k.copy(), v.copy()
    nan = np.zeros((len(LENGTHS), case.q_len, KV_HEADS * GROUP, HEAD_DIM), bool)
    seen = visibility(case)
    for which, j, head, value in poison:
        where = (table[0, j // 8], j % 8) if case.paged else (0, j)
        (k if which == "k" else v)[(*where, head, 0 if which == "k" else COL)] = value
        heads = slice(head * GROUP, (head + 1) * GROUP)
        rows = seen[:, j]
        if which == "k":
            nan[0, rows, heads, :] = True
        else:
            nan[0, rows, heads, COL] = True
    return k, v, nan


def run(impl, case: Case, q, k, v, table):
    cast = lambda x: jnp.asarray(x, case.dtype)
    q, k, v = cast(q), cast(k), cast(v)
    if impl == RAGGED:
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import ref_ragged_paged_attention

        from tpuattn.decode import native

        *_, spec = decode.make_decode_spec(q, k, v, LENGTHS, table, window=case.window)
        return jax.jit(lambda q, k, v: native.ragged_translation(ref_ragged_paged_attention, q, k, v,
                                                                 LENGTHS, table, spec))(q, k, v)
    return jitted(impl, case)(q, k, v, jnp.asarray(LENGTHS), None if table is None else jnp.asarray(table))


@functools.cache
def jitted(impl, case: Case):
    """One compiled function per implementation and case: the three kinds of poison are data."""
    options = dict(case.pallas) if impl == "pallas" else {}
    return jax.jit(lambda q, k, v, lengths, table: decode.attention(
        q, k, v, lengths, page_table=table, window=case.window, impl=impl, **options))


def supported(impl, case: Case, q, k, v, table) -> bool:
    if impl == RAGGED:
        return case.paged and case.q_len > 1
    spec = decode.make_decode_spec(jnp.asarray(q, case.dtype), jnp.asarray(k, case.dtype),
                                   jnp.asarray(v, case.dtype), LENGTHS, table, window=case.window)[-1]
    return decode.get_implementation(impl).supports(spec, "cpu") is None


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("kind", ["hidden", "past", "visible"])
@pytest.mark.parametrize("impl", IMPLS)
def test_non_finite_values_reach_exactly_the_rows_that_see_them(impl, kind, case):
    poison = {"hidden": HIDDEN, "past": PAST, "visible": VISIBLE}[kind]
    if kind == "hidden" and case.window is None:
        pytest.skip("without a window every position inside the length is seen by the last row")
    q, k, v, table = make_inputs(case)
    if not supported(impl, case, q, k, v, table):
        assert impl not in ("reference", "pallas")
        pytest.skip(f"{impl} refuses this case")
    if impl in JAX_KERNELS:
        pytest.skip("JAX's kernels, wrapped unchanged, are the documented exception to the rule "
                    "(tpuattn/decode/native.py); tests/test_decode.py checks them on finite caches")
    bad_k, bad_v, nan = poisoned(case, k, v, table, poison)
    assert nan.any() == (kind == "visible")
    # The oracle on the clean caches, rounded as the kernels see them.
    rounded = [np.asarray(jnp.asarray(x, case.dtype).astype(jnp.float32), np.float64) for x in (q, k, v)]
    want = oracle_decode(*rounded, LENGTHS, page_table=table, window=case.window)
    got = np.asarray(run(impl, case, q, bad_k, bad_v, table).astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(np.isnan(got), nan)
    assert np.isfinite(got[~nan]).all()
    tol = TOL["bfloat16" if impl in BF16_INSIDE else case.dtype]
    np.testing.assert_allclose(got[~nan], want[~nan], atol=tol, rtol=tol)
