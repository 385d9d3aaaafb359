"""The backward puzzles' checks tell near misses from answers: each answer here is one plausible slip
away from a right one, and its check must fail with the message that names the slip.

tests/test_puzzles.py runs notebook 09's stubs (they fail) and solutions (they pass); this file proves
the checks are sharp enough to catch the mistakes a learner makes on the way.
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from tpuattn.puzzles import backward_puzzles as bw  # noqa: E402
from tpuattn.puzzles import check  # noqa: E402


def _qk(a, b):
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _tn(a, b):
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _dq_kernel(*, with_delta=True, with_scale=True):
    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, acc_ref):
        j = pl.program_id(1)

        @pl.when(j == 0)
        def _init():
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        k = k_ref[...]
        p = jnp.exp(_qk(q_ref[...], k) * bw.SCALE - lse_ref[...])
        dp = _qk(do_ref[...], v_ref[...])
        ds = p * (dp - delta_ref[...]) if with_delta else p * dp
        acc_ref[...] += jnp.dot(ds, k, preferred_element_type=jnp.float32) * (bw.SCALE if with_scale else 1.0)

        @pl.when(j == pl.num_programs(1) - 1)
        def _write():
            dq_ref[...] = acc_ref[...]
    return kernel


def _masked_kernel(*, softcap=True, window=True, safe_max=True):
    block = bw.MASK_BLOCK

    def kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref):
        i, j = pl.program_id(0), pl.program_id(1)

        @pl.when(j == 0)
        def _init():
            m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        s = _qk(q_ref[...], k_ref[...]) * bw.SCALE
        if softcap:
            s = bw.SOFTCAP * jnp.tanh(s / bw.SOFTCAP)
        rows = i * block + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
        cols = j * block + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        seen = (cols <= rows) & (cols > rows - bw.WINDOW) if window else cols <= rows
        s = jnp.where(seen, s, -jnp.inf)
        m_old = m_ref[...]
        m_new = jnp.maximum(m_old, s.max(axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new) if safe_max else m_new
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m_old - m_safe)
        l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
        acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p, v_ref[...], preferred_element_type=jnp.float32)
        m_ref[...] = m_new

        @pl.when(j == pl.num_programs(1) - 1)
        def _write():
            o_ref[...] = acc_ref[...] / l_ref[...]
    return kernel


def _page_index_map(b, c, p, page_table_ref, lengths_ref):
    last = jax.lax.div(lengths_ref[b] - 1, bw.PAGE_SIZE)
    return page_table_ref[b, jnp.minimum(c * bw.PAGES_PER_CHUNK + p, last)], 0, 0


def _unclamped_page_index_map(b, c, p, page_table_ref, lengths_ref):
    return page_table_ref[b, c * bw.PAGES_PER_CHUNK + p], 0, 0


def _next_page_index_map(b, c, p, page_table_ref, lengths_ref):
    return page_table_ref[b, c * bw.PAGES_PER_CHUNK + p + 1], 0, 0


def _merge(out, m, l_sum):
    weight = l_sum * jnp.exp(m - m.max(axis=1, keepdims=True))
    return (weight * out).sum(axis=1) / weight.sum(axis=1)


def _merge_without_l(out, m, l_sum):  # weighs chunks by their maxima only: forgets how many keys each saw
    weight = jnp.where(l_sum > 0, jnp.exp(m - m.max(axis=1, keepdims=True)), 0.0)
    return (weight * out).sum(axis=1) / weight.sum(axis=1)


def _ring_step(*, send=True, direction=1):
    perm = [(d, (d + direction) % bw.RING_DEVICES) for d in range(bw.RING_DEVICES)]

    def step(q, k, v, out, m, l_sum, kv_block):
        block_out, block_m, block_l = bw.block_partial(q, k, v, kv_block)
        m_new = jnp.maximum(m, block_m)
        old, new = l_sum * jnp.exp(m - m_new), block_l * jnp.exp(block_m - m_new)
        out = (old * out + new * block_out) / (old + new)
        if send:
            k, v = (jax.lax.ppermute(x, bw.RING_AXIS, perm) for x in (k, v))
        return out, m_new, old + new, k, v
    return step


def _dkv_kernel(*, dk_scale=True, zero_dv=True):
    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_acc, dv_acc):
        i = pl.program_id(1)

        @pl.when(i == 0)
        def _init():
            dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
            if zero_dv:
                dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

        q, do = q_ref[...], do_ref[...]
        p = jnp.exp(_qk(q, k_ref[...]) * bw.SCALE - lse_ref[...])
        ds = p * (_qk(do, v_ref[...]) - delta_ref[...])
        dv_acc[...] += _tn(p, do)
        dk_acc[...] += _tn(ds, q) * (bw.SCALE if dk_scale else 1.0)

        @pl.when(i == pl.num_programs(1) - 1)
        def _write():
            dk_ref[...] = dk_acc[...]
            dv_ref[...] = dv_acc[...]
    return kernel


def _dq_zeroed_once(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, acc_ref):
    """Puzzle 9's answer with the accumulator zeroed at the first grid step and after each write instead
    of at each row's first step: right in order on one core, not on a megacore's second core."""
    i, j = pl.program_id(0), pl.program_id(1)

    @pl.when((i == 0) & (j == 0))
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    k = k_ref[...]
    p = jnp.exp(_qk(q_ref[...], k) * bw.SCALE - lse_ref[...])
    ds = p * (_qk(do_ref[...], v_ref[...]) - delta_ref[...])
    acc_ref[...] += jnp.dot(ds, k, preferred_element_type=jnp.float32) * bw.SCALE

    @pl.when(j == pl.num_programs(1) - 1)
    def _write():
        dq_ref[...] = acc_ref[...]
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def test_dq_near_misses_fail_and_the_answer_passes(capsys):
    assert check(bw.DQ, _dq_kernel(with_delta=False)) is False
    assert check(bw.DQ, _dq_kernel(with_scale=False)) is False
    assert capsys.readouterr().out.count("dQ mismatch at index") == 2
    assert check(bw.DQ, _dq_zeroed_once) is False
    out = capsys.readouterr().out
    assert ("the values match when the grid runs in order on one core, but scratch carries over from "
            "one index of grid axis 0 to the next, and that axis is marked \"parallel\"") in out, out
    assert check(bw.DQ, _dq_kernel()) is True


def test_dkv_mismatches_name_dk_and_dv(capsys):
    assert check(bw.DKV, _dkv_kernel(dk_scale=False)) is False
    assert ": dK mismatch at index" in capsys.readouterr().out
    # dV's accumulator never zeroed: the interpreter's uninitialised scratch is NaN.
    assert check(bw.DKV, _dkv_kernel(zero_dv=False)) is False
    out = capsys.readouterr().out
    assert ": dV mismatch at index" in out and "got nan" in out, out
    assert check(bw.DKV, _dkv_kernel()) is True


def test_masked_near_misses_fail_and_the_answer_passes(capsys):
    assert check(bw.MASKED, _masked_kernel(softcap=False)) is False
    assert check(bw.MASKED, _masked_kernel(window=False)) is False
    # Without the safe maximum, a row's first tiles see no key: exp(-inf - -inf) is NaN from then on.
    assert check(bw.MASKED, _masked_kernel(safe_max=False)) is False
    out = capsys.readouterr().out
    assert out.count("mismatch at index") == 3 and "got nan" in out
    assert check(bw.MASKED, _masked_kernel()) is True


def test_decode_audit_and_merge(capsys):
    assert check(bw.DECODE, lambda: (_unclamped_page_index_map, _merge)) is False
    out = capsys.readouterr().out
    assert "the values match, but at grid step" in out and "does not own" in out
    assert check(bw.DECODE, lambda: (_page_index_map, _merge_without_l)) is False
    assert "mismatch at index" in capsys.readouterr().out
    # One page on, unclamped: the last step of a chunk reads the page table past its end. On the host
    # that raises (on a TPU it reads whatever lies beyond the table in SMEM).
    assert check(bw.DECODE, lambda: (_next_page_index_map, _merge)) is False
    assert ("the k_pages index map reads outside a scalar-prefetch array at grid step (0, 1, 3)"
            in capsys.readouterr().out)
    assert check(bw.DECODE, lambda: (_page_index_map, _merge)) is True
    table, lengths = bw.decode_tables()
    clamped = bw.fetches(_page_index_map, bw.DECODE_GRID, table, lengths)
    assert len(clamped) == sum(-(-int(n) // bw.PAGE_SIZE) for n in lengths)  # each owned page once


def test_ring_without_the_send_or_sent_backwards_fails_and_with_it_passes(capsys):
    # conftest gives this process 8 CPU devices: the check runs shard_map over 4 of them.
    assert bw.ring_runs_on().startswith("shard_map over 4")
    assert check(bw.RING, _ring_step(send=False)) is False
    assert "mismatch at index" in capsys.readouterr().out
    # Sent to d - 1, device d holds block (d + s) mod 4 at step s, masked as block (d - s) mod 4: the
    # ring is causal, so the values differ (a non-causal ring sees every block either way round).
    assert check(bw.RING, _ring_step(direction=-1)) is False
    out = capsys.readouterr().out
    assert "mismatch at index (1, " in out, out
    assert check(bw.RING, _ring_step()) is True


def test_bug_c_index_map_outside_the_array_is_named(capsys):
    # "Start at the first block K/V block j sees" written as i + j: past the last query block at j > 0.
    # The block outside the array is the cause of the wrong values, and is what the check names.
    assert check(bw.CAUSAL_DKV, lambda j, i: (i + j, 0)) is False
    out = capsys.readouterr().out
    assert "the q index map asks for block (4, 0) at grid step (1, 3); q has 4 x 1 blocks" in out, out


def test_fetches_walks_the_grid_in_order():
    # A map that names block i for step (j, i) fetches at every step; clamped to max(i, j) it fetches
    # only when the block changes.
    grid = (2, 3)
    assert [step for step, _ in bw.fetches(lambda j, i: (i, 0), grid)] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert bw.fetches(lambda j, i: (max(i, j), 0), grid) == [((0, 0), (0, 0)), ((0, 1), (1, 0)),
                                                             ((0, 2), (2, 0)), ((1, 0), (1, 0)),
                                                             ((1, 2), (2, 0))]
