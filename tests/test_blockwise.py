"""Blockwise-specific tests: block sizes, the schedule's skipping, the VJP's residuals, teaching versions.

The shared oracle suite (test_oracle_suite.py) already runs "blockwise" with its default blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_grads_close, random_qkv
from oracle import _allowed, oracle_attention, oracle_grads

import tpuattn
from tpuattn.impl import blockwise
from tpuattn.spec import MaskSpec

FWD_TOL = 2e-5  # float32, as the shared suite
GRAD_TOL = 1e-4


def _inputs(seed, q_len, kv_len, q_heads=2, kv_heads=2, head_dim=16, batch=1):
    rng = np.random.default_rng(seed)
    return (rng, *random_qkv(rng, q_len, kv_len, batch=batch, q_heads=q_heads, kv_heads=kv_heads,
                             head_dim=head_dim))


# Lengths that are not multiples of the blocks, blocks that are not powers of two, GQA.
BLOCK_CASES = [
    dict(q_len=100, kv_len=100, block_q=32, block_kv=48, causal=True),
    dict(q_len=37, kv_len=203, block_q=16, block_kv=64, causal=True),
    dict(q_len=70, kv_len=50, block_q=24, block_kv=40, window=(10, 5)),
    dict(q_len=90, kv_len=90, block_q=7, block_kv=30, window=(20, 0), causal=True, q_heads=4, kv_heads=1),
    dict(q_len=65, kv_len=65, block_q=128, block_kv=8, softcap=3.0),
    dict(q_len=48, kv_len=48, block_q=16, block_kv=24, segments=True, causal=True),
]


@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_block_sizes_match_oracle(case):
    case = dict(case)
    shape = {key: case.pop(key) for key in ("q_len", "kv_len")}
    heads = {key: case.pop(key) for key in ("q_heads", "kv_heads") if key in case}
    options = {key: case.pop(key) for key in ("block_q", "block_kv")}
    rng, q, k, v = _inputs(sum(shape.values()), **shape, **heads)
    kw = dict(case)
    if kw.pop("segments", False):
        seg = np.sort(rng.integers(0, 3, (1, shape["q_len"])), axis=1).astype(np.int32)
        kw["segment_ids"] = seg
    segment_ids = kw.pop("segment_ids", None)
    # jit: one compile instead of op-by-op dispatch of every unrolled step.
    attend = jax.jit(lambda q, k, v, seg: tpuattn.attention(q, k, v, impl="blockwise", segment_ids=seg,
                                                            **kw, **options))
    out = attend(q, k, v, segment_ids)
    kw["segment_ids"] = segment_ids
    np.testing.assert_allclose(np.asarray(out, np.float64), oracle_attention(q, k, v, **kw),
                               atol=FWD_TOL, rtol=FWD_TOL)
    d_out = rng.standard_normal(q.shape).astype(np.float32)
    grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v, segment_ids) * d_out),
                             argnums=(0, 1, 2)))(q, k, v)
    assert_grads_close(grads, oracle_grads(q, k, v, d_out, **kw), tol=GRAD_TOL)


@pytest.mark.parametrize("fn", [blockwise.fori_loop_attention, blockwise.vmap_attention],
                         ids=["fori_loop", "vmap"])
@pytest.mark.parametrize("causal", [False, True])
def test_teaching_versions_match_oracle(fn, causal):
    _, q, k, v = _inputs(7, 96, 96, q_heads=3, kv_heads=3)
    out = jax.jit(lambda q, k, v: fn(q, k, v, block_q=32, block_kv=16, causal=causal))(q, k, v)
    np.testing.assert_allclose(np.asarray(out, np.float64), oracle_attention(q, k, v, causal=causal),
                               atol=FWD_TOL, rtol=FWD_TOL)


def test_teaching_versions_reject_blocks_that_do_not_divide():
    _, q, k, v = _inputs(0, 40, 40)
    with pytest.raises(ValueError, match="block_q"):
        blockwise.vmap_attention(q, k, v, block_q=16, block_kv=8)


def _nonempty_tiles(q_len, kv_len, block_q, block_kv, **mask):
    """Independent count from the oracle's own NumPy mask: tiles with at least one visible pair."""
    allowed = _allowed(0, q_len, kv_len, mask.get("causal", False), mask.get("window"), None)
    nq, nk = -(-q_len // block_q), -(-kv_len // block_kv)
    padded = np.zeros((nq * block_q, nk * block_kv), bool)
    padded[:q_len, :kv_len] = allowed
    return padded.reshape(nq, block_q, nk, block_kv).any(axis=(1, 3))


@pytest.mark.parametrize("q_len, kv_len, block_q, block_kv, mask", [
    (4096, 4096, 128, 128, dict(causal=True)),
    (1000, 1500, 64, 96, dict(causal=True)),
    (2048, 2048, 128, 256, dict(window=(300, 100))),
    (512, 512, 64, 64, dict()),
])
def test_schedule_visits_exactly_the_tiles_that_see_something(q_len, kv_len, block_q, block_kv, mask):
    spec = MaskSpec(q_len=q_len, kv_len=kv_len, causal=mask.get("causal", False), window=mask.get("window"))
    steps = blockwise.schedule(spec, block_q, block_kv)
    visited = np.zeros_like(_nonempty_tiles(q_len, kv_len, block_q, block_kv, **mask))
    for step in steps:
        assert not visited[step.q_lo:step.q_hi, step.kv_block].any(), "a tile is visited twice"
        visited[step.q_lo:step.q_hi, step.kv_block] = True
    expected = _nonempty_tiles(q_len, kv_len, block_q, block_kv, **mask)
    np.testing.assert_array_equal(visited, expected)
    assert blockwise.visited_tiles(steps) == expected.sum()
    if mask == dict(causal=True) and q_len == kv_len == 4096:
        n = 4096 // 128
        assert blockwise.visited_tiles(steps) == n * (n + 1) // 2 == 528


def test_step_groups_cover_the_schedule_in_order():
    steps = blockwise.schedule(MaskSpec(q_len=1000, kv_len=1000), 128, 128)
    groups = blockwise.step_groups(steps)
    assert len(groups) == 2  # 7 full key blocks in one loop, then the padded (masked) last block
    expanded = [(first.kv_block + i, first.q_lo, first.q_hi, first.masked)
                for first, count in groups for i in range(count)]
    assert expanded == [(s.kv_block, s.q_lo, s.q_hi, s.masked) for s in steps]


def _largest_vjp_residual(impl, q, k, v, **kw):
    _, f_vjp = jax.vjp(lambda q, k, v: tpuattn.attention(q, k, v, impl=impl, **kw), q, k, v)
    return max(int(np.size(x)) for x in jax.tree_util.tree_leaves(f_vjp))


@pytest.mark.parametrize("causal", [False, True])
def test_backward_does_not_store_the_score_matrix(causal):
    q_len = kv_len = 256
    _, q, k, v = _inputs(1, q_len, kv_len, q_heads=1, kv_heads=1, head_dim=8)
    scores = q_len * kv_len
    # The check can fail: the materialised reference keeps a [q_len, kv_len] residual.
    assert _largest_vjp_residual("reference", q, k, v, causal=causal) >= scores
    largest = _largest_vjp_residual("blockwise", q, k, v, causal=causal, block_q=128, block_kv=128)
    assert largest <= q_len * 8  # q, k, v, out: [seq, head_dim]
    assert largest < scores


@pytest.mark.parametrize("options, name", [
    (dict(block_q=0), "block_q"),
    (dict(block_kv=-8), "block_kv"),
    (dict(block_kv=16.0), "block_kv"),
    (dict(block_q=True), "block_q"),
    (dict(block_size=64), "block_size"),
])
def test_bad_options_raise_naming_the_option(options, name):
    _, q, k, v = _inputs(0, 8, 8)
    with pytest.raises(ValueError, match=name):
        tpuattn.attention(q, k, v, impl="blockwise", **options)


def test_default_blocks_rule():
    assert blockwise.default_blocks(16384, 16384) == (512, 512)
    assert blockwise.default_blocks(100, 7) == (100, 7)
    spec = tpuattn.make_spec(*(jnp.zeros((1, 300, 1, 8)),) * 3)[-1]
    assert blockwise.resolve_blocks(spec, {"block_kv": 1024}) == (300, 300)
