"""MaskSpec against an independent NumPy brute force written from the contract's text."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tpuattn.spec import EMPTY, FULL, PARTIAL, MaskSpec

NUM_RANDOM_SPECS = 300
GRID = 24  # random specs have q_len and kv_len below this


def brute_visible(q_len, kv_len, causal, window, q_seg=None, kv_seg=None, kv_cols=None):
    """[q_len, kv_cols] bool, straight from the contract: query i sits at key position i + kv_len - q_len."""
    kv_cols = kv_len if kv_cols is None else kv_cols
    pos = np.arange(q_len)[:, None] + (kv_len - q_len)
    j = np.arange(kv_cols)[None, :]
    ok = np.broadcast_to(j < kv_len, (q_len, kv_cols)).copy()
    if causal:
        ok &= j <= pos
    if window is not None:
        left, right = window
        if left is not None:
            ok &= j >= pos - left
        if right is not None:
            ok &= j <= pos + right
    if q_seg is not None:
        ok &= np.asarray(q_seg)[:, None] == np.asarray(kv_seg)[None, :kv_cols]
    return ok


def random_spec(rng, has_segments=False):
    q_len, kv_len = (int(x) for x in rng.integers(1, GRID, size=2))
    causal = bool(rng.integers(2))
    window = None
    if rng.random() < 0.6:
        side = lambda: None if rng.random() < 0.25 else int(rng.integers(0, 8))  # noqa: E731
        window = (side(), side())
    return MaskSpec(q_len=q_len, kv_len=kv_len, causal=causal, window=window, has_segments=has_segments)


def specs(seed, has_segments=False):
    rng = np.random.default_rng(seed)
    return [(random_spec(rng, has_segments), rng) for _ in range(NUM_RANDOM_SPECS)]


def test_visible_matches_brute_force_including_padded_keys():
    for spec, rng in specs(0):
        kv_cols = spec.kv_len + int(rng.integers(0, 5))  # padded key columns must be hidden
        got = spec.visible(np.arange(spec.q_len)[:, None], np.arange(kv_cols)[None, :])
        want = brute_visible(spec.q_len, spec.kv_len, spec.causal, spec.window, kv_cols=kv_cols)
        got = np.broadcast_to(got, want.shape)  # visible() broadcasts; without masks it is one row
        np.testing.assert_array_equal(got, want, err_msg=str(spec))


def test_visible_with_segments_numpy_and_jax_agree_with_brute_force():
    # JAX compiles each operation once per shape: every spec is evaluated on the same GRID x GRID
    # indices (its lengths are below GRID) and the [q_len, kv_len] corner compared, so the few jax
    # operations compile once for all the specs instead of once per spec.
    rows, cols = np.arange(GRID)[:, None], np.arange(GRID)[None, :]
    rows_jax, cols_jax = jnp.asarray(rows), jnp.asarray(cols)
    for spec, rng in specs(1, has_segments=True):
        q_seg = np.full(GRID, -1)
        kv_seg = np.full(GRID, -2)
        q_seg[:spec.q_len] = rng.integers(0, 3, spec.q_len)
        kv_seg[:spec.kv_len] = rng.integers(0, 3, spec.kv_len)
        want = brute_visible(spec.q_len, spec.kv_len, spec.causal, spec.window, q_seg[:spec.q_len],
                             kv_seg[:spec.kv_len])
        got_np = spec.visible(rows, cols, q_seg[:, None], kv_seg[None, :])
        got_jax = spec.visible(rows_jax, cols_jax, jnp.asarray(q_seg)[:, None], jnp.asarray(kv_seg)[None, :],
                               xp=jnp)
        corner = (slice(spec.q_len), slice(spec.kv_len))
        np.testing.assert_array_equal(got_np[corner], want, err_msg=str(spec))
        np.testing.assert_array_equal(np.asarray(got_jax)[corner], want, err_msg=str(spec))
        assert not got_np[:, spec.kv_len:].any(), spec  # padded keys stay hidden


def test_bottom_right_alignment_examples():
    # One decoding query sees the whole cache under causal.
    assert MaskSpec(1, 5, causal=True).visible(np.arange(1)[:, None], np.arange(5)[None, :]).all()
    # q_len > kv_len with causal: the first queries sit before key 0 and see nothing.
    vis = MaskSpec(5, 3, causal=True).visible(np.arange(5)[:, None], np.arange(3)[None, :])
    np.testing.assert_array_equal(vis.sum(axis=1), [0, 0, 1, 2, 3])


def brute_block_map(spec, q_block, kv_block, q_pad, kv_pad):
    vis = brute_visible(spec.q_len, spec.kv_len, spec.causal, spec.window, kv_cols=kv_pad)
    nq, nk = q_pad // q_block, kv_pad // kv_block
    out = np.empty((nq, nk), np.int8)
    for i in range(nq):
        rows = vis[i * q_block:min((i + 1) * q_block, spec.q_len)]  # padded query rows are not real
        for j in range(nk):
            tile = rows[:, j * kv_block:(j + 1) * kv_block]
            if tile.size == 0 or not tile.any():
                out[i, j] = EMPTY
            elif tile.all() and not spec.has_segments:
                out[i, j] = FULL
            else:
                out[i, j] = PARTIAL
    return out


@pytest.mark.parametrize("has_segments", [False, True])
def test_block_map_matches_brute_force(has_segments):
    for spec, rng in specs(2 + has_segments, has_segments):
        q_block, kv_block = (int(x) for x in rng.integers(1, 9, size=2))
        q_pad = -(-spec.q_len // q_block) * q_block + q_block * int(rng.integers(0, 2))
        kv_pad = -(-spec.kv_len // kv_block) * kv_block + kv_block * int(rng.integers(0, 2))
        got = spec.block_map(q_block, kv_block, q_pad, kv_pad)
        want = brute_block_map(spec, q_block, kv_block, q_pad, kv_pad)
        np.testing.assert_array_equal(got, want, err_msg=f"{spec} q_block={q_block} kv_block={kv_block}")
        if has_segments:
            assert not (got == FULL).any()


def test_block_map_default_padding_and_counts():
    # 8x8 causal, 4x4 tiles: lower-left tile FULL, diagonal tiles PARTIAL, upper-right EMPTY.
    np.testing.assert_array_equal(MaskSpec(8, 8, causal=True).block_map(4, 4),
                                  [[PARTIAL, EMPTY], [FULL, PARTIAL]])
    # No mask, kv_len 6 in tiles of 4: the second key tile holds padding, so it is only PARTIAL.
    np.testing.assert_array_equal(MaskSpec(4, 6).block_map(4, 4), [[FULL, PARTIAL]])


def test_kv_span_is_the_tight_union_of_visible_keys():
    for spec, rng in specs(4):
        q_start = int(rng.integers(0, spec.q_len))
        q_stop = int(rng.integers(q_start + 1, spec.q_len + 1))
        lo, hi = spec.kv_span(q_start, q_stop)
        assert 0 <= lo <= hi <= spec.kv_len, (spec, q_start, q_stop, lo, hi)
        vis = brute_visible(spec.q_len, spec.kv_len, spec.causal, spec.window)[q_start:q_stop]
        cols = np.flatnonzero(vis.any(axis=0))
        if cols.size == 0:
            assert lo == hi, (spec, q_start, q_stop, lo, hi)
        else:
            assert (lo, hi) == (cols[0], cols[-1] + 1), (spec, q_start, q_stop, lo, hi)
