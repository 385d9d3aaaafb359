"""Notebook 03's kernels (tpuattn.lesson) against the float64 oracle: each step's kernel, the finished
kernel's forward and gradients through the contract (impl="lesson"), and what it refuses.

Small blocks (8 rows) keep the interpreted grids short while still giving every kernel several blocks
along each axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_grads_close
from oracle import oracle_attention, oracle_grads

import tpuattn
from tpuattn.errors import UnsupportedInput
from tpuattn.lesson import show, steps

B = 8  # block rows in the step tests


def _qkv(seed, q_len, kv_len, q_heads=2, kv_heads=2, head_dim=16, batch=1):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, q_len, q_heads, head_dim)).astype(np.float32)
    k, v = (rng.standard_normal((batch, kv_len, kv_heads, head_dim)).astype(np.float32) for _ in range(2))
    return q, k, v


def _close(got, want, tol=2e-5):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol, rtol=tol)


def test_step1_one_block():
    q, k, v = (x[0, :, 0] for x in _qkv(0, 16, 16))  # [T, D]
    want = oracle_attention(q[None, :, None], k[None, :, None], v[None, :, None])[0, :, 0]
    _close(steps.one_block_attention(q, k, v), want)


def test_step2_grid():
    q, k, v = _qkv(1, 32, 32)
    _close(steps.grid_attention(q, k, v, block_q=B), oracle_attention(q, k, v))


def test_step3_online_softmax_over_kv_blocks():
    q, k, v = _qkv(2, 32, 32)
    _close(steps.flash_attention(q, k, v, block_q=B, block_kv=B), oracle_attention(q, k, v))


@pytest.mark.parametrize("q_len", [32, 16])  # q_len < kv_len: the queries are the last keys' positions
def test_step4_causal_with_skipped_blocks(q_len):
    q, k, v = _qkv(3, q_len, 32)
    _close(steps.causal_attention(q, k, v, block_q=B, block_kv=B), oracle_attention(q, k, v, causal=True))


def test_step5_gqa_through_the_index_map():
    q, k, v = _qkv(4, 32, 32, q_heads=4, kv_heads=2)
    _close(steps.gqa_attention(q, k, v, block_q=B, block_kv=B), oracle_attention(q, k, v, causal=True))


@pytest.mark.parametrize("q_len, kv_len, causal, left", [(32, 32, True, None), (16, 48, True, 12),
                                                          (48, 48, False, 10)])
def test_step5b_scheduled(q_len, kv_len, causal, left):
    q, k, v = _qkv(5, q_len, kv_len, q_heads=4, kv_heads=2)
    window = None if left is None else (left, 0 if causal else None)
    got = steps.scheduled_attention(q, k, v, causal=causal, left=left, block_q=B, block_kv=B)
    _close(got, oracle_attention(q, k, v, causal=causal, window=window))


def test_block_tables_list_exactly_the_visible_blocks():
    q_len, kv_len, left = 48, 64, 12
    kv_index, kv_count = steps.block_tables(q_len, kv_len, B, B, causal=True, left=left)
    pos = np.arange(q_len) + kv_len - q_len
    keys = np.arange(kv_len)
    seen = (keys[None] <= pos[:, None]) & (keys[None] >= pos[:, None] - left)  # [row, key], by brute force
    visible = seen.reshape(q_len // B, B, kv_len // B, B).any(axis=(1, 3))
    for i, row in enumerate(visible):
        np.testing.assert_array_equal(kv_index[i, :kv_count[i]], np.flatnonzero(row))
        assert np.all(kv_index[i, kv_count[i]:] == np.flatnonzero(row)[-1])  # padding repeats the last


def test_block_tables_refuse_a_q_block_that_sees_nothing():
    with pytest.raises(UnsupportedInput, match="q blocks \\[0, 1\\] that see none"):
        steps.block_tables(32, 16, B, B, causal=True)


def test_show_prints_the_source(capsys):
    show(steps.flash_kernel)
    assert "def flash_kernel(" in capsys.readouterr().out


# --------------------------------------------------------------------------- impl="lesson"
GRAD_CASES = {  # lengths not multiples of the block, rows and q blocks that see nothing, GQA, windows
    "causal-gqa-padded": dict(q_len=37, kv_len=45, q_heads=4, kv_heads=2, kw=dict(causal=True)),
    "causal-empty-rows": dict(q_len=40, kv_len=17, q_heads=2, kv_heads=2, kw=dict(causal=True)),
    "window-both-sides-mqa": dict(q_len=30, kv_len=50, q_heads=3, kv_heads=1, kw=dict(window=(7, 4))),
    "plain-scale": dict(q_len=20, kv_len=20, q_heads=2, kv_heads=2, kw=dict(scale=0.3)),
    # Segment ids: query rows of segment 9 see no key; ids are masked inside the position-visible tiles.
    "segments-causal": dict(q_len=27, kv_len=27, q_heads=2, kv_heads=1,
                            kw=dict(causal=True, segment_ids=(np.array([[0] * 9 + [9] * 4 + [1] * 14] * 2),
                                                              np.array([[0] * 13 + [1] * 14] * 2)))),
}


@pytest.mark.parametrize("name", GRAD_CASES)
def test_lesson_forward_and_gradients(name):
    case = GRAD_CASES[name]
    q, k, v = _qkv(6, case["q_len"], case["kv_len"], case["q_heads"], case["kv_heads"], batch=2)
    kw = case["kw"]
    d_out = np.random.default_rng(7).standard_normal(q.shape).astype(np.float32)

    def loss(q, k, v):
        out = tpuattn.attention(q, k, v, impl="lesson", block_q=B, block_kv=B, **kw)
        return jnp.sum(out * d_out), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    _close(out, oracle_attention(q, k, v, **kw))
    assert_grads_close(grads, oracle_grads(q, k, v, d_out, **kw), tol=1e-4, finite=True)


def test_lesson_bfloat16_with_the_default_blocks():
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _qkv(8, 130, 130, q_heads=4, kv_heads=2, head_dim=64))
    out = tpuattn.attention(q, k, v, causal=True, impl="lesson")
    assert out.dtype == jnp.bfloat16
    want = oracle_attention(*(np.asarray(x, np.float64) for x in (q, k, v)), causal=True)
    _close(out.astype(jnp.float32), want, tol=2e-2)


def test_lesson_refuses_a_softcap_by_name():
    q, k, v = _qkv(9, 16, 16)
    with pytest.raises(UnsupportedInput, match="does not support.*softcap"):
        tpuattn.attention(q, k, v, impl="lesson", softcap=5.0)


def test_lesson_refuses_second_derivatives_by_name():
    q, k, v = _qkv(13, 16, 16)
    loss = lambda q: jnp.sum(tpuattn.attention(q, k, v, causal=True, impl="lesson") ** 2)
    with pytest.raises(NotImplementedError, match="impl='lesson' has no second derivatives"):
        jax.jvp(jax.grad(loss), (q,), (q,))


@pytest.mark.parametrize("options, message", [
    (dict(block_q=12), "block_q: expected a multiple of 8, got 12"),
    (dict(block_kv=0), "block_kv: expected a positive int, got 0"),
    (dict(block_sizes=128), "unknown option"),
])
def test_lesson_options_are_checked(options, message):
    q, k, v = _qkv(10, 16, 16)
    with pytest.raises(ValueError, match=message):
        tpuattn.attention(q, k, v, impl="lesson", **options)


def test_lesson_refuses_compiling_off_a_tpu():
    q, k, v = _qkv(11, 16, 16)
    with pytest.raises(UnsupportedInput, match="impl='lesson'"):
        tpuattn.attention(q, k, v, impl="lesson", interpret=False)


def test_lesson_is_offered_by_name_never_by_auto():
    assert "lesson" in tpuattn.implementations()
    for q_len in (16, 4096):
        *_, spec = tpuattn.make_spec(*_qkv(12, q_len, q_len, head_dim=8), causal=True)
        for backend in ("cpu", "tpu"):
            choice = tpuattn.choose(spec, backend)
            assert choice.impl != "lesson"
