"""The capstones (tpuattn.puzzles.capstones): a stub is "not written yet", a whole-kernel answer passes
(interpret mode against the float64 oracle, the audits, the v5e compile), and each near miss -- one
plausible slip away from the answer -- fails with the message that names the slip.

The answers here are written apart from notebook 12's solution cells, with switches for the slips;
tests/test_puzzles.py runs the notebook's own stubs and solutions.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from tpuattn.puzzles import capstones as cap  # noqa: E402
from tpuattn.puzzles import core  # noqa: E402

BLOCK, SCALE = cap.BLOCK, cap.SCALE


def _qk(a, b):
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _tn(a, b):
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _params(*semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics)


def _check(puzzle, answer, capsys) -> tuple[bool | None, str]:
    verdict = core.check(puzzle, answer)
    return verdict, capsys.readouterr().out.strip()


def _compiles() -> bool:
    from tpuattn.measure import aot

    return aot.compiler_problem("v5e") is None


def _assert_pass(puzzle, answer, capsys):
    verdict, out = _check(puzzle, answer, capsys)
    assert verdict is True, out
    if _compiles():
        assert out == f"PASS {puzzle.name}: matches the float64 oracle (interpret mode), compiled for v5e"


# ---------------------------------------------------------------------------------------------------
# F. the forward, with switches for its near misses.

def causal_schedule(seq, block, *, skip_diagonal=False):
    """Query block i visits K/V blocks 0..i; each row padded with its last block (no copy)."""
    n = seq // block
    last = np.arange(n) - (1 if skip_diagonal else 0)
    table = np.stack([np.minimum(np.arange(n), max(int(last[i]), 0)) for i in range(n)]).astype(np.int32)
    return table, np.maximum(last + 1, 1).astype(np.int32)


def _forward_kernel(*, lse_with_max=True):
    def kernel(table_ref, counts_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref):
        i, j = pl.program_id(1), pl.program_id(2)
        kv = table_ref[i, j]

        @pl.when(j == 0)
        def _init():
            m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        @pl.when(j < counts_ref[i])
        def _step():
            s = _qk(q_ref[...], k_ref[...]) * SCALE
            rows = i * BLOCK + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
            cols = kv * BLOCK + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
            s = jnp.where(cols <= rows, s, -jnp.inf)
            m_old = m_ref[...]
            m_new = jnp.maximum(m_old, s.max(axis=1, keepdims=True))
            p = jnp.exp(s - m_new)
            alpha = jnp.exp(m_old - m_new)
            l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
            acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p.astype(v_ref.dtype), v_ref[...],
                                                          preferred_element_type=jnp.float32)
            m_ref[...] = m_new

        @pl.when(j == pl.num_programs(2) - 1)
        def _finish():
            o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)
            log_l = jnp.log(l_ref[...])
            lse_ref[...] = m_ref[...] + log_l if lse_with_max else log_l
    return kernel


def forward_answer(*, skip_diagonal=False, lse_with_max=True, kv_semantics="arbitrary",
                   kv_head="group", use_table=True):
    def flash_forward(q, k, v, *, interpret):
        heads, seq, d = q.shape
        group = heads // k.shape[0]
        table, counts = causal_schedule(seq, BLOCK, skip_diagonal=skip_diagonal)

        def kv_map(h, i, j, table, counts):
            head = jax.lax.div(h, group) if kv_head == "group" else h
            return head, table[i, j] if use_table else j, 0

        q_spec = pl.BlockSpec((None, BLOCK, d), lambda h, i, j, table, counts: (h, i, 0))
        kv_spec = pl.BlockSpec((None, BLOCK, d), kv_map)
        lse_spec = pl.BlockSpec((None, BLOCK, 1), lambda h, i, j, table, counts: (h, i, 0))
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(heads, seq // BLOCK, table.shape[1]),
            in_specs=[q_spec, kv_spec, kv_spec], out_specs=[q_spec, lse_spec],
            scratch_shapes=[pltpu.VMEM((BLOCK, 1), jnp.float32), pltpu.VMEM((BLOCK, 1), jnp.float32),
                            pltpu.VMEM((BLOCK, d), jnp.float32)])
        return cap.pallas_call(
            _forward_kernel(lse_with_max=lse_with_max), grid_spec=grid_spec,
            out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                       jax.ShapeDtypeStruct((heads, seq, 1), jnp.float32)],
            compiler_params=_params("parallel", "parallel", kv_semantics), interpret=interpret,
            in_names=("q", "k", "v"), out_names=("out", "lse"),
        )(jnp.asarray(table), jnp.asarray(counts), q, k, v)
    return flash_forward


def _not_written(*args, **kwargs):
    raise NotImplementedError("write the whole kernel")


@pytest.mark.parametrize("puzzle", cap.PUZZLES, ids=lambda p: p.name.split(":")[0] + p.name[-8:])
def test_a_stub_is_not_written_yet(puzzle, capsys):
    verdict, out = _check(puzzle, _not_written, capsys)
    assert verdict is False and out == f"{puzzle.name}: not written yet"


def test_the_forward_passes_in_float32_and_bfloat16(capsys):
    _assert_pass(cap.FORWARD, forward_answer(), capsys)
    _assert_pass(cap.FORWARD_BF16, forward_answer(), capsys)


@pytest.mark.parametrize("slip, message", [
    ({"skip_diagonal": True}, "out mismatch at index (0, 128, 0)"),
    ({"lse_with_max": False}, "lse mismatch at index (0, 0, 0)"),
    ({"kv_semantics": "parallel"}, 'differ along grid axis 2, marked "parallel"'),
    ({"kv_head": "query"},
     "the k index map asks for block (2, 0, 0) at grid step (2, 0, 0); k has 2 x 4 x 1 blocks"),
    ({"use_table": False},
     "at grid step (0, 0, 1) of the launch that writes out, lse the q and k index maps name query block 0 "
     "and K/V block 1, which the causal mask keeps apart"),
], ids=["schedule skips the diagonal", "lse without the max", "kv axis parallel",
        "GQA map by query head", "hidden blocks named"])
def test_forward_near_misses_fail_with_their_message(slip, message, capsys):
    verdict, out = _check(cap.FORWARD, forward_answer(**slip), capsys)
    assert verdict is False and out.startswith(f"FAIL {cap.FORWARD.name}: "), out
    assert message in out, out


# ---------------------------------------------------------------------------------------------------
# The oracle, from the formula.

def test_the_forward_oracle_has_the_logsumexp_of_each_row():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal(shape) for shape in [(4, 16, 128), (2, 16, 128), (2, 16, 128)])
    out, lse = cap.attention64(q, k, v)
    s = q[3] @ k[1].T * SCALE  # query head 3 uses kv head 1
    row = 5  # sees keys 0..5
    assert lse[3, row, 0] == pytest.approx(np.log(np.exp(s[row, :row + 1]).sum()))
    assert np.allclose(out[3, row], np.exp(s[row, :row + 1] - lse[3, row, 0]) @ v[1, :row + 1])
