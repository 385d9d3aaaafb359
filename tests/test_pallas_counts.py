"""tpuattn.model.counts: the Pallas kernel's grid walk and HBM byte count.

Counts are exact: they come from the kernel's own schedule and index maps (tpuattn.pallas.plan).
"""

import numpy as np
import pytest

from tpuattn.model import counts
from tpuattn.pallas.blocks import ForwardBlocks
from tpuattn.spec import EMPTY, FULL, PARTIAL, MaskSpec


def test_causal_4096_counts_and_bytes():
    spec = counts.spec_for(4096, causal=True, num_q_heads=1, head_dim=128, dtype="bfloat16")
    traffic = counts.hbm_traffic(spec, (128, 128))
    n = 32
    assert traffic.kv_blocks_computed == n * (n + 1) // 2 == 528
    assert traffic.unmasked_kv_blocks == n * n
    # q block 1 starts on kv block 0, which q block 0 ended with: one fetch fewer than computed.
    assert traffic.kv_blocks_fetched == 527
    assert traffic.unmasked_kv_fetched == n * n
    assert traffic.computed_fraction <= 0.52 and traffic.fetched_fraction <= 0.52
    block_bytes = 128 * 128 * 2
    assert traffic.k_read == traffic.v_read == 527 * block_bytes
    assert traffic.q_read == traffic.o_written == 4096 * 128 * 2
    assert traffic.lse_written == 4096 * 8 * 4  # float32 statistics, 8 sublanes a query
    assert traffic.minimum == 4 * 4096 * 128 * 2
    assert traffic.total == traffic.q_read + 2 * 527 * block_bytes + traffic.o_written + traffic.lse_written
    assert traffic.unmasked_total == traffic.q_read + 2 * n * n * block_bytes + traffic.o_written + \
        traffic.lse_written


def test_unmasked_kv_reread_once_per_q_block_and_once_per_gqa_group():
    # 512 tokens, 128-blocks: each of the 4 q blocks streams all 4 kv blocks, once for each kv head's
    # group of 2 query heads (one grid step serves the group), while every q head computes its tiles.
    spec = counts.spec_for(512, batch=2, num_q_heads=4, num_kv_heads=2, head_dim=32, dtype="float32")
    traffic = counts.hbm_traffic(spec, ForwardBlocks(128, 128))
    assert traffic.kv_blocks_computed == 2 * 4 * 4 * 4
    assert traffic.kv_blocks_fetched == traffic.unmasked_kv_fetched == 2 * 2 * 4 * 4
    # head_dim 32 is padded to 128 lanes in the kernel's layout.
    assert traffic.k_read == 2 * 2 * 4 * 4 * 128 * 128 * 4
    assert traffic.minimum == (2 * 2 * 4 * 512 + 2 * 2 * 2 * 512) * 32 * 4
    assert traffic.ratio == pytest.approx(traffic.total / traffic.minimum)


def test_paired_heads_fetch_a_kv_pair_once_for_both_groups():
    # head_dim 64 on 2 kv heads: one 128-lane tile holds both kv heads, and one grid step serves all
    # 4 query heads, so each K/V tile is fetched once per q block, at the contract's width: nothing
    # is padded, and K+V are read at exactly the unpadded size once per q block.
    spec = counts.spec_for(512, batch=2, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype="float32")
    traffic = counts.hbm_traffic(spec, ForwardBlocks(128, 128))
    assert traffic.kv_blocks_computed == 2 * 4 * 4 * 4
    assert traffic.kv_blocks_fetched == traffic.unmasked_kv_fetched == 2 * 1 * 4 * 4
    assert traffic.k_read == 2 * 4 * (2 * 512 * 64 * 4)  # per q block, the whole K of both kv heads
    assert traffic.q_read == traffic.o_written == 2 * 4 * 512 * 64 * 4


def test_walk_causal_matches_the_schedule_layout():
    walk = counts.grid_walk(counts.spec_for(512, causal=True), (128, 128))
    np.testing.assert_array_equal(walk.kv_index, [[0, 0, 0, 0], [0, 1, 1, 1], [0, 1, 2, 2], [0, 1, 2, 3]])
    np.testing.assert_array_equal(walk.computed, np.tril(np.ones((4, 4), bool)))
    expected_fetch = np.tril(np.ones((4, 4), bool))
    expected_fetch[1, 0] = False  # kv block 0 is still resident from q block 0
    np.testing.assert_array_equal(walk.fetched, expected_fetch)
    # Diagonal tiles need the element mask; tiles below it do not; above it are skipped.
    np.testing.assert_array_equal(walk.tiles, np.tril(np.full((4, 4), FULL), -1)
                                  + np.eye(4, dtype=int) * PARTIAL)


def test_walk_window_visits_exactly_the_non_empty_tiles_and_shortens_the_grid():
    spec = counts.spec_for(1024, causal=True, window=(300, 0))
    walk = counts.grid_walk(spec, (128, 128))
    visible = MaskSpec(1024, 1024, causal=True, window=(300, 0)).block_map(128, 128) != EMPTY
    np.testing.assert_array_equal(walk.tiles != EMPTY, visible)
    assert walk.steps == visible.sum(axis=1).max() < walk.num_kv_blocks
    for i in range(walk.num_q_blocks):
        named = set(walk.kv_index[i][walk.computed[i]].tolist())
        assert named == set(np.flatnonzero(visible[i]).tolist())
    # A step fetches exactly when the block index changes along the row-major walk.
    flat = walk.kv_index.reshape(-1)
    changes = np.concatenate([[True], flat[1:] != flat[:-1]])
    np.testing.assert_array_equal(walk.fetched.reshape(-1), changes)


def test_spec_for_rejects_bad_sizes():
    with pytest.raises(ValueError, match="q_len"):
        counts.spec_for(0)
    with pytest.raises(ValueError, match="num_q_heads"):
        counts.spec_for(128, num_q_heads=3, num_kv_heads=2)
    assert counts.spec_for(256, window=64).mask.window == (64, 64)
    assert counts.describe_mask(counts.spec_for(256, causal=True, window=(64, 0))) == "causal, window (64, 0)"
    assert counts.describe_mask(counts.spec_for(256)) == "no mask"


def test_block_sizes_are_validated_by_the_package():
    with pytest.raises(ValueError, match="block_kv"):
        counts.hbm_traffic(counts.spec_for(256), (128, 100))


def test_format_table():
    text = counts.format_table([{"a": 1, "b": 0.5}, {"a": 22, "b": 1.25}])
    assert text.splitlines() == [" a     b", "--  ----", " 1  0.50", "22  1.25"]
