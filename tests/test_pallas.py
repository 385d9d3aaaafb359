"""The Pallas kernels (impl="pallas") beyond the shared oracle suite.

Everything here runs in Pallas interpret mode on CPU (small shapes); the 4096-token block
counts come from the kernels' own schedule and index maps, not from running them.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_qkv
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from oracle import oracle_attention, oracle_grads

import tpuattn
from tpuattn import chips
from tpuattn.errors import UnsupportedInput
from tpuattn.model.counts import kv_schedule, walk_grid
from tpuattn.pallas import (
    BackwardBlocks,
    BlockSizes,
    ForwardBlocks,
    blocks,
    compat,
    default_block_sizes,
    forward_vmem_bytes,
    plan,
    races_found,
    reset_races,
    resolve_interpret,
)
from tpuattn.pallas.layout import Layout
from tpuattn.spec import AttentionSpec, MaskSpec

FWD_TOL, GRAD_TOL = 2e-5, 1e-4  # float32 against the float64 oracle, as the shared suite
# JAX's shipped kernels' own test tolerances (float32).
SHIPPED_FWD_TOL, SHIPPED_GRAD_TOL = 3e-3, 2e-2


def _inputs(seed, batch, q_len, kv_len, q_heads, kv_heads, head_dim):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, q_len, q_heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((batch, kv_len, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((batch, kv_len, kv_heads, head_dim)).astype(np.float32)
    d_out = rng.standard_normal(q.shape).astype(np.float32)
    return q, k, v, d_out


def _value_and_grads(q, k, v, d_out, **kw):
    def loss(q, k, v):
        out = tpuattn.attention(q, k, v, impl="pallas", **kw)
        return jnp.sum(out * d_out), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return np.asarray(out), [np.asarray(g) for g in grads]


def _spec(seq, *, causal=True, window=None, heads=1, kv_heads=1, head_dim=128):
    mask = MaskSpec(q_len=seq, kv_len=seq, causal=causal, window=window)
    return AttentionSpec(batch=1, q_len=seq, kv_len=seq, num_q_heads=heads, num_kv_heads=kv_heads,
                         head_dim=head_dim, dtype=jnp.dtype(jnp.float32), scale=head_dim ** -0.5,
                         softcap=None, mask=mask)


# ------------------------------------------------------------------ lengths that are not block multiples
@pytest.mark.parametrize(
    "shape, kw",
    [
        ((1, 300, 300, 4, 2, 64), dict(causal=True)),
        ((2, 200, 300, 2, 1, 40), dict(window=(70, 20), softcap=3.0)),
    ],
    ids=["causal-gqa-300", "window-softcap-mqa-200x300"],
)
def test_non_multiple_lengths_with_small_blocks_match_oracle(shape, kw):
    q, k, v, d_out = _inputs(0, *shape)
    out, grads = _value_and_grads(q, k, v, d_out, block_sizes=128, **kw)
    np.testing.assert_allclose(out, oracle_attention(q, k, v, **kw), atol=FWD_TOL, rtol=FWD_TOL)
    for name, got, want in zip("qkv", grads, oracle_grads(q, k, v, d_out, **kw), strict=True):
        np.testing.assert_allclose(got, want, atol=GRAD_TOL, rtol=GRAD_TOL, err_msg=f"d{name}")


def test_segments_across_blocks_skip_tiles_and_match_oracle():
    # Three packed documents over 4 blocks of 128: block-diagonal, so 6 of 16 tiles are visited.
    seg = np.repeat(np.array([0, 1, 2, 2]), 128)[None].astype(np.int32)
    q, k, v, d_out = _inputs(1, 1, 512, 512, 2, 1, 32)
    kw = dict(segment_ids=seg)
    out, grads = _value_and_grads(q, k, v, d_out, block_sizes=128, **kw)
    np.testing.assert_allclose(out, oracle_attention(q, k, v, **kw), atol=FWD_TOL, rtol=FWD_TOL)
    for name, got, want in zip("qkv", grads, oracle_grads(q, k, v, d_out, **kw), strict=True):
        np.testing.assert_allclose(got, want, atol=GRAD_TOL, rtol=GRAD_TOL, err_msg=f"d{name}")
    *_, spec = tpuattn.make_spec(q, k, v, segment_ids=seg)
    counts = kv_schedule(spec, 128, segment_ids=(seg, seg))
    np.testing.assert_array_equal(counts.computed[0, 0], [1, 1, 2, 2])
    assert counts.total_computed == 6 * spec.num_q_heads
    for pass_name in ("dq", "dkv"):
        assert kv_schedule(spec, 128, segment_ids=(seg, seg), pass_name=pass_name).computed_fraction == 6 / 16


# ------------------------------------------------------------------ GQA: head blocks of a group
@pytest.mark.parametrize(("q_heads", "kv_heads", "per_step"), [
    (4, 1, None), (8, 2, None), (16, 2, None), (6, 3, None),
    # A group split into head blocks (as a chip's VMEM may ask): 2 or 4 query heads per step.
    (8, 2, 2), (16, 2, 4), (6, 3, 1),
])
def test_gqa_head_blocks_match_the_oracle(monkeypatch, q_heads, kv_heads, per_step):
    """Forward and gradients of GQA through the head-block grid (a step serves ``per_step`` query
    heads of one group; None: the whole group), causal with a ragged length and a segment boundary."""
    if per_step is not None:
        monkeypatch.setattr(plan, "q_heads_per_step", lambda spec, pass_name, bq, bk: per_step)
    q, k, v, d_out = _inputs(q_heads + kv_heads, 1, 200, 200, q_heads, kv_heads, 32)
    seg = np.repeat(np.array([0, 1]), [70, 130])[None].astype(np.int32)
    kw = dict(causal=True, segment_ids=seg)
    out, grads = _value_and_grads(q, k, v, d_out, block_sizes=128, **kw)
    np.testing.assert_allclose(out, oracle_attention(q, k, v, **kw), atol=FWD_TOL, rtol=FWD_TOL)
    for name, got, want in zip("qkv", grads, oracle_grads(q, k, v, d_out, **kw), strict=True):
        np.testing.assert_allclose(got, want, atol=GRAD_TOL, rtol=GRAD_TOL, err_msg=f"d{name}")


# ------------------------------------------------------------------ head_dim 64: two heads to a lane tile
@pytest.mark.parametrize(("q_heads", "kv_heads", "per_step", "kw"), [
    (4, 4, None, dict(causal=True)),  # MHA: each query head on its own kv head's half
    (8, 2, None, dict(causal=True, softcap=5.0)),  # group 4: half of a tile's heads roll to the other half
    (6, 2, None, dict(window=(60, 10))),  # group 3: a tile holds heads of both kv heads
    (12, 4, 2, dict(causal=True, segments=True)),  # a step of 2 heads straddling two kv heads
    (8, 4, 4, dict(causal=True)),  # a kv pair's 4 query heads in one step, 2 pairs on the grid
])
def test_paired_heads_match_the_oracle(monkeypatch, q_heads, kv_heads, per_step, kw):
    """head_dim 64 with an even number of kv heads: the kernels read the free view with two heads to a
    128-lane tile (no copy), forward and gradients, over MHA, GQA groups odd and even, head blocks that
    split a pair's query heads, segments, a window and a softcap."""
    assert Layout.for_head_dim(64, kv_heads) == Layout(columns=True, head_dim=64, pack=2)
    if per_step is not None:
        monkeypatch.setattr(plan, "q_heads_per_step", lambda spec, pass_name, bq, bk: per_step)
    kw = dict(kw)
    if kw.pop("segments", False):
        kw["segment_ids"] = np.repeat(np.array([[0, 1], [0, 0]]), [90, 150], axis=1).astype(np.int32)
    q, k, v, d_out = _inputs(q_heads * 10 + kv_heads, 2, 240, 240, q_heads, kv_heads, 64)
    out, grads = _value_and_grads(q, k, v, d_out, block_sizes=128, **kw)
    np.testing.assert_allclose(out, oracle_attention(q, k, v, **kw), atol=FWD_TOL, rtol=FWD_TOL)
    for name, got, want in zip("qkv", grads, oracle_grads(q, k, v, d_out, **kw), strict=True):
        np.testing.assert_allclose(got, want, atol=GRAD_TOL, rtol=GRAD_TOL, err_msg=f"d{name}")


def test_head_dims_that_cannot_pair_take_the_padded_copy():
    """Pairing needs head_dim 64 and whole kv head pairs; anything else is the heads-first copy."""
    assert Layout.for_head_dim(128, 1) == Layout(columns=True, head_dim=128)
    assert Layout.for_head_dim(256, 3).columns
    for head_dim, kv_heads in [(64, 1), (64, 3), (32, 4), (96, 2)]:
        assert Layout.for_head_dim(head_dim, kv_heads) == Layout(columns=False, head_dim=128)


# ------------------------------------------------------------------ block counts at 4096, counted
def test_causal_4096_computes_and_fetches_at_most_52_percent():
    spec = _spec(4096)
    counts = kv_schedule(spec, 128)
    nq = 4096 // 128
    assert (counts.num_q_blocks, counts.num_kv_blocks, counts.steps) == (nq, nq, nq)
    np.testing.assert_array_equal(counts.computed[0, 0], np.arange(1, nq + 1))  # q block i sees i + 1
    assert counts.unmasked_computed == counts.unmasked_fetched == nq * nq
    assert counts.total_computed == nq * (nq + 1) // 2  # 528 of 1024
    # Fetches: one per computed tile, except that q block 1 starts on kv block 0, the block
    # q block 0 ended on (still resident), so 527.
    assert counts.total_fetched == nq * (nq + 1) // 2 - 1
    assert counts.computed_fraction <= 0.52 and counts.fetched_fraction <= 0.52
    for pass_name in ("dq", "dkv"):
        other = kv_schedule(spec, 128, pass_name=pass_name)
        assert other.computed_fraction <= 0.52 and other.fetched_fraction <= 0.52, pass_name


def test_kernel_index_maps_fetch_what_the_schedule_counts(monkeypatch):
    """Capture the forward pallas_call's own grid spec at 4096 tokens and walk its index maps."""
    captured = {}

    class Captured(Exception):
        pass

    def fake_pallas_call(kernel, *, grid_spec, **kwargs):
        def call(*args):
            captured.update(grid_spec=grid_spec, args=args)
            raise Captured

        return call

    forward_module = importlib.import_module("tpuattn.pallas.forward")
    monkeypatch.setattr(forward_module.pl, "pallas_call", fake_pallas_call)
    seq, heads, kv_heads = 4096, 4, 2
    q = jnp.zeros((1, seq, heads, 128), jnp.float32)
    k = jnp.zeros((1, seq, kv_heads, 128), jnp.float32)
    with pytest.raises(Captured):
        tpuattn.attention(q, k, k, causal=True, impl="pallas", block_sizes=128)
    grid_spec, args = captured["grid_spec"], captured["args"]
    prefetch = tuple(np.asarray(a) for a in args[: grid_spec.num_scalar_prefetch])
    q_arg, k_arg = args[grid_spec.num_scalar_prefetch:][:2]
    # The contract's arrays as the free view [batch, seq, heads * head_dim] (head_dim 128): no copy,
    # and K is not repeated per query head.
    assert k_arg.shape == (1, seq, kv_heads * 128)
    assert q_arg.shape == (1, seq, heads * 128)
    grid = tuple(grid_spec.grid)
    nq = seq // 128
    assert grid == (1, kv_heads, nq, nq)  # one grid step serves the query heads of a GQA group
    # A step's query block: the group's heads side by side, each a 128-lane column block.
    assert grid_spec.in_specs[0].block_shape == (None, 128, heads // kv_heads * 128)
    k_spec = grid_spec.in_specs[1]
    fetches = walk_grid(k_spec.index_map, grid, prefetch)
    per_head = nq * (nq + 1) // 2 - 1  # q block 1 reuses kv block 0, resident from q block 0
    # Each kv head's K/V blocks are fetched once for its whole group: per kv head, not per query head.
    assert int(fetches.sum()) == kv_heads * per_head
    counts = kv_schedule(_spec(seq, heads=heads, kv_heads=kv_heads), 128)
    assert counts.total_fetched == int(fetches.sum())
    assert counts.grid == grid and counts.q_heads == heads // kv_heads
    assert counts.fetched_fraction <= 0.52
    # Skipped steps name the resident block: no index change at any step past the count.
    count = np.arange(1, nq + 1)  # causal, equal blocks: q block i sees kv blocks 0..i
    steps = np.arange(nq)
    assert not fetches[0, 0][steps[None, :] >= count[:, None]].any()


@pytest.mark.parametrize("pass_name", ["forward", "dq", "dkv"])
def test_a_gqa_group_takes_the_grid_steps_of_one_head_and_fetches_kv_once(pass_name):
    """16 query heads on 2 kv heads: every pass's grid has no more steps than 2 heads on 2. The forward
    and dQ fetch every K/V block as often as for 2/2 (once per group); the dK/dV pass holds its K/V
    block for the whole group and streams the group's Q blocks 8 heads at a time."""
    gqa = kv_schedule(_spec(1024, heads=16, kv_heads=2), 128, pass_name=pass_name)
    mha = kv_schedule(_spec(1024, heads=2, kv_heads=2), 128, pass_name=pass_name)
    per_head = kv_schedule(_spec(1024, heads=16, kv_heads=16), 128, pass_name=pass_name)
    assert gqa.q_heads == 8 and mha.q_heads == per_head.q_heads == 1
    assert gqa.grid_steps == mha.grid_steps == per_head.grid_steps // 8
    assert gqa.total_fetched == mha.total_fetched == per_head.total_fetched // 8
    assert gqa.total_computed == per_head.total_computed == 8 * mha.total_computed
    outer = 2 if pass_name == "dkv" else 16  # computed: per query head, or per kv head summed over its group
    assert gqa.fetched.shape == (1, 2, 8) and gqa.computed.shape == (1, outer, 8)
    if pass_name == "dkv":
        assert gqa.grid == (1, 2, 8, 1, 8)  # (batch, kv head, kv block, head block, q step)
    else:
        assert gqa.grid == (1, 2, 8, 8)  # (batch, head block, q block, kv step)


def test_a_group_larger_than_the_vmem_allows_is_split_into_head_blocks():
    """Compiled for a chip, the heads per step are the largest divisor of the group whose modelled VMEM
    fits; v3's 16 MiB takes fewer query heads of a 16-head group than v5e's 128 MiB."""
    spec = _spec(4096, heads=16, kv_heads=1)
    assert plan.q_heads_per_step(spec, "forward", 512, 512) == 16  # no chip: interpret mode, no VMEM
    with chips.target("v5e"):
        assert plan.q_heads_per_step(spec, "forward", 512, 512) == 16
        assert plan.head_block_vmem_limit(spec, "forward", 512, 512, 16) is not None
        assert plan.head_block_vmem_limit(spec, "forward", 512, 512, 1) is None
    with chips.target("v3"):
        small = plan.q_heads_per_step(spec, "forward", 512, 512)
        assert 16 % small == 0 and small < 16
        need = forward_vmem_bytes(512, 512, 128, 4, small) * blocks.VMEM_MARGIN
        assert need <= chips.get("v3").vmem_bytes * 3 // 4
        counts = kv_schedule(spec, 512)
        assert counts.q_heads == small and counts.grid[1] == 16 // small


def test_window_shortens_the_grid():
    counts = kv_schedule(_spec(1024, causal=True, window=(128, 0)), 128)
    assert counts.steps == 2  # each q block sees its own kv block and the one before
    assert counts.total_computed == 2 * 8 - 1
    assert counts.computed_fraction == 15 / 64


def test_query_blocks_that_see_nothing_park_on_the_resident_block():
    # q_len 512 > kv_len 128, causal (bottom-right): queries 0..383 see no key at all.
    mask = MaskSpec(q_len=512, kv_len=128, causal=True)
    spec = AttentionSpec(batch=1, q_len=512, kv_len=128, num_q_heads=1, num_kv_heads=1, head_dim=64,
                         dtype=jnp.dtype(jnp.float32), scale=0.125, softcap=None, mask=mask)
    counts = kv_schedule(spec, 128)
    np.testing.assert_array_equal(counts.computed[0, 0], [0, 0, 0, 1])
    # The pipeline's first step always loads a block (kv 0); the empty q blocks park on it and
    # q block 3 computes with it, so one fetch in all.
    np.testing.assert_array_equal(counts.fetched[0, 0], [1, 0, 0, 0])


def test_visited_tiles_are_the_non_empty_tiles_of_the_mask():
    spec = _spec(640, causal=False, window=(150, 40))
    counts = kv_schedule(spec, 128)
    block_map = spec.mask.block_map(128, 128)
    np.testing.assert_array_equal(counts.visit_map[0] > 0, block_map > 0)
    np.testing.assert_array_equal(counts.visit_map[0] == 2, block_map == 2)  # FULL: no mask work
    assert counts.total_fetched <= counts.total_computed


# ------------------------------------------------------------------ JAX's shipped kernels
def test_matches_jax_flash_attention():
    from jax.experimental.pallas.ops.tpu import flash_attention as jax_flash

    batch, seq, heads, head_dim = 1, 256, 2, 64
    q, k, v, d_out = _inputs(2, batch, seq, seq, heads, heads, head_dim)
    rng = np.random.default_rng(5)
    seg = np.sort(rng.integers(0, 3, (batch, seq)), axis=1).astype(np.int32)
    scale = head_dim ** -0.5
    kw = dict(causal=True, segment_ids=seg, scale=scale)
    out, grads = _value_and_grads(q, k, v, d_out, block_sizes=128, **kw)

    def theirs(q, k, v):  # [batch, heads, seq, dim] layout
        t = [jnp.swapaxes(x, 1, 2) for x in (q, k, v)]
        o = jax_flash.flash_attention(*t, segment_ids=jax_flash.SegmentIds(seg, seg), causal=True,
                                      sm_scale=scale)
        return jnp.swapaxes(o, 1, 2)

    with pltpu.force_tpu_interpret_mode():
        ref_out, vjp = jax.vjp(theirs, q, k, v)
        ref_grads = vjp(jnp.asarray(d_out))
    np.testing.assert_allclose(out, ref_out, atol=SHIPPED_FWD_TOL, rtol=SHIPPED_FWD_TOL)
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        np.testing.assert_allclose(got, want, atol=SHIPPED_GRAD_TOL, rtol=SHIPPED_GRAD_TOL,
                                   err_msg=f"d{name}")


@pytest.mark.parametrize("mqa", [False, True], ids=["mha-causal-softcap", "mqa-causal"])
def test_matches_splash_attention(mqa):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    seq, heads, head_dim = 256, 2, 128
    kv_heads = 1 if mqa else heads
    softcap = None if mqa else 4.0
    q, k, v, d_out = _inputs(3, 1, seq, seq, heads, kv_heads, head_dim)
    kw = dict(causal=True, scale=1.0, softcap=softcap)
    out, grads = _value_and_grads(q, k, v, d_out, block_sizes=128, **kw)

    mask = splash.MultiHeadMask([splash.CausalMask((seq, seq)) for _ in range(heads)])
    blocks = splash.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128,
                               block_kv_dkv=128, block_kv_dkv_compute=128, block_q_dq=128, block_kv_dq=128)
    make = splash.make_splash_mqa_single_device if mqa else splash.make_splash_mha_single_device
    kernel = make(mask, block_sizes=blocks, attn_logits_soft_cap=softcap, interpret=True)

    def theirs(q, k, v):  # per batch element: q [heads, seq, d]; k, v [seq, d] (MQA) or [heads, seq, d]
        kv = (lambda x: x[0, :, 0]) if mqa else (lambda x: jnp.swapaxes(x[0], 0, 1))
        return jnp.swapaxes(kernel(jnp.swapaxes(q[0], 0, 1), kv(k), kv(v)), 0, 1)[None]

    ref_out, vjp = jax.vjp(theirs, q, k, v)
    ref_grads = vjp(jnp.asarray(d_out))
    np.testing.assert_allclose(out, ref_out, atol=SHIPPED_FWD_TOL, rtol=SHIPPED_FWD_TOL)
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        np.testing.assert_allclose(got, want, atol=SHIPPED_GRAD_TOL, rtol=SHIPPED_GRAD_TOL,
                                   err_msg=f"d{name}")


# ------------------------------------------------------------------ lowering for a TPU, without one
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernels_lower_to_mosaic_for_tpu(dtype):
    """Cross-platform export runs Pallas's Mosaic lowering of all three kernels on this host.

    It catches operations Mosaic cannot lower (it caught a floor division in an index map);
    Mosaic's own compilation (layouts, VMEM allocation) still needs a TPU.
    """
    from jax import export

    q = jax.ShapeDtypeStruct((1, 300, 4, 64), dtype)
    k = jax.ShapeDtypeStruct((1, 300, 2, 64), dtype)
    seg = jax.ShapeDtypeStruct((1, 300), jnp.int32)

    def loss(q, k, v, seg):
        out = tpuattn.attention(q, k, v, causal=True, window=(200, 0), softcap=5.0, segment_ids=seg,
                                impl="pallas", block_sizes=128, interpret=False)
        return jnp.sum(out.astype(jnp.float32))

    # For a TPU, so inside chips.target (interpret=False off one is refused: the target is the CPU).
    with chips.target("v5e"):
        exported = export.export(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), platforms=["tpu"])(
            q, k, k, seg)
    text = exported.mlir_module()
    for name in ("tpuattn_flash_forward", "tpuattn_flash_dq", "tpuattn_flash_dkv"):
        assert name in text, name


# ------------------------------------------------------------------ the TPU simulator
def test_simulator_reports_no_race_for_causal_gqa():
    q, k, v, d_out = _inputs(4, 1, 256, 256, 4, 2, 32)
    reset_races()
    kw = dict(causal=True)
    out, grads = _value_and_grads(q, k, v, d_out, block_sizes=128, interpret="simulate", **kw)
    # The flag we read must exist after a simulated run, else "no race" would be vacuous.
    assert compat.race_state() is not None
    assert not races_found()
    np.testing.assert_allclose(out, oracle_attention(q, k, v, **kw), atol=FWD_TOL, rtol=FWD_TOL)
    for name, got, want in zip("qkv", grads, oracle_grads(q, k, v, d_out, **kw), strict=True):
        np.testing.assert_allclose(got, want, atol=GRAD_TOL, rtol=GRAD_TOL, err_msg=f"d{name}")


def _copy_kernel(racy: bool):
    def kernel(x_hbm, o_ref, buf, sem):
        copy = pltpu.make_async_copy(x_hbm, buf, sem)
        copy.start()
        if racy:
            o_ref[...] = buf[...]  # reads the VMEM buffer the DMA is still writing
        copy.wait()
        if not racy:
            o_ref[...] = buf[...]

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                          in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                          scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA],
                          interpret=resolve_interpret("simulate"))


@pytest.mark.parametrize("racy", [True, False], ids=["read-before-wait", "read-after-wait"])
def test_race_flag_is_read_where_this_jax_keeps_it(racy):
    """Positive control for the test above: the flag compat reads does flip on a real race."""
    reset_races()
    jax.block_until_ready(_copy_kernel(racy)(jnp.ones((8, 128), jnp.float32)))
    assert races_found() is racy


# ------------------------------------------------------------------ options and validation
def test_interpret_mode_is_the_default_off_tpu():
    assert jax.default_backend() != "tpu"
    assert resolve_interpret(None) is True
    refusal = r"^interpret: expected True or None .*impl='pallas'.*got False$"
    with pytest.raises(UnsupportedInput, match=refusal):
        resolve_interpret(False)  # compiling off a TPU target (before: Pallas's raw message later)
    simulated = resolve_interpret("simulate")
    assert isinstance(simulated, pltpu.InterpretParams) and simulated.detect_races
    with pytest.raises(ValueError, match="interpret: expected None, True, False, 'simulate'"):
        resolve_interpret("fast")
    with chips.target("v5e"):  # an ahead-of-time compile for a TPU compiles the kernels
        assert resolve_interpret(None) is False
        assert resolve_interpret(False) is False


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ForwardBlocks(100, 128), r"forward.block_q: expected a multiple of 8 .* got 100"),
        (lambda: ForwardBlocks(128, 64), r"forward.block_kv: expected a multiple of 128 .* got 64"),
        (lambda: BackwardBlocks(64, 128), r"backward.block_q: expected a multiple of 128 .* got 64"),
        (lambda: BackwardBlocks(128, 0), r"block_sizes.backward.block_kv: expected a positive int, got 0"),
        (lambda: ForwardBlocks(128.0, 128), r"block_q: expected a positive int, got 128.0"),
        (lambda: BlockSizes(forward=(128, 128)), r"block_sizes.forward: expected a ForwardBlocks"),
    ],
    ids=["fwd-q-sublanes", "fwd-kv-lanes", "bwd-q-lanes", "bwd-kv-positive", "float", "not-dataclass"],
)
def test_block_size_validation_names_the_constraint(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_bad_options_are_refused_through_the_contract():
    q = jnp.zeros((1, 8, 1, 8), jnp.float32)
    # block_sizes=, the old spelling, is read as blocks=Blocks.uniform(96): 96 keys are not whole lanes.
    with pytest.raises(ValueError, match=r"^blocks\.block_kv: expected a multiple of 128, got 96"):
        tpuattn.attention(q, q, q, impl="pallas", block_sizes=96)
    with pytest.raises(ValueError,
                       match="^block_sizes: expected None, a tpuattn.options.Blocks or a positive"):
        tpuattn.attention(q, q, q, impl="pallas", block_sizes="big")
    with pytest.raises(ValueError, match=r"^pallas: unknown option\(s\) \['tile'\]"):
        tpuattn.attention(q, q, q, impl="pallas", tile=128)


def test_default_block_sizes_follow_the_vmem_budget():
    mib = 1024 * 1024
    big = default_block_sizes(128, jnp.bfloat16, vmem_bytes=128 * mib)  # v5e / v6e
    assert big.forward == ForwardBlocks(512, 512)
    assert forward_vmem_bytes(512, 512, 128, 2) <= 16 * mib
    small = default_block_sizes(128, jnp.float32, vmem_bytes=16 * mib)  # v4, or no TPU
    assert small.forward.block_q < 512
    assert forward_vmem_bytes(small.forward.block_q, small.forward.block_kv, 128, 4) <= 2 * mib
    capacity, source = chips.vmem_bytes()  # no TPU here: the smallest VMEM of any generation
    assert (capacity, source.split(" ")[0]) == (chips.DEFAULT_VMEM_BYTES, "default")
    with chips.target("v5e"):  # an ahead-of-time compile for v5e sizes blocks for its VMEM
        assert chips.vmem_bytes()[0] == 128 * mib
        assert default_block_sizes(128, jnp.bfloat16) == big
    # Blocks are clamped to the padded sequence: a 7-token problem runs on one 8 x 128 tile.
    assert ForwardBlocks(512, 512).clamp(7, 7) == ForwardBlocks(8, 128)


# ------------------------------------------------------------------ inputs an adversarial run mishandled
def _bf16_grads(impl, q, k, v, d_out):
    def loss(q, k, v):
        return jnp.sum(tpuattn.attention(q, k, v, causal=True, impl=impl).astype(jnp.float32) * d_out)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


def test_bf16_gradients_of_nearly_one_hot_rows_are_as_accurate_as_the_reference():
    """Query i is a multiple of key i: every row's softmax is nearly one-hot on the diagonal.

    dS = P * (dP - delta) must then cancel to a small number. With delta = rowsum(dO * O) from the
    bf16-rounded O it did not (dq 70x the reference's error); with delta = rowsum(P * dP) it does.
    """
    rng = np.random.default_rng(3)
    _, k, v = random_qkv(rng, 128, 128, batch=2, q_heads=2, kv_heads=2, head_dim=64)
    q = 3.0 * k + 0.1 * rng.standard_normal(k.shape).astype(np.float32)
    d_out = rng.standard_normal(q.shape).astype(np.float32)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    want = oracle_grads(*(np.asarray(x, np.float64) for x in (q, k, v)), d_out, causal=True)
    errors = {impl: [float(np.abs(np.asarray(g, np.float64) - w).max())
                     for g, w in zip(_bf16_grads(impl, q, k, v, d_out), want, strict=True)]
              for impl in ("pallas", "reference")}
    for name, mine, reference in zip("qkv", errors["pallas"], errors["reference"], strict=True):
        assert mine <= 4 * reference, (f"d{name}", mine, reference)


def _shard_map(fn, mesh, in_specs, out_specs, *, experimental=False):
    """``jax.shard_map`` (0.10.2; also in 0.7.2) or ``jax.experimental.shard_map`` (0.7.2's classic
    entry point, deprecated in 0.10.2), each with its default checks (``check_vma``/``check_rep``)."""
    if experimental:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.shard_map import shard_map
        return shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


@pytest.mark.parametrize("experimental", [False, True], ids=["jax.shard_map", "experimental.shard_map"])
def test_inside_a_users_shard_map_with_default_checks(experimental):
    """The kernels' output shapes carry the inputs' varying mesh axes (else JAX refuses them)."""
    q, k, v, d_out = _inputs(4, 1, 128, 128, 2, 1, 64)
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    attend = _shard_map(lambda q, k, v: tpuattn.attention(q, k, v, causal=True, impl="pallas"), mesh,
                        (P(), P(), P()), P(), experimental=experimental)
    out = jax.jit(attend)(q, k, v)
    np.testing.assert_allclose(out, oracle_attention(q, k, v, causal=True), atol=FWD_TOL, rtol=FWD_TOL)
    grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) * d_out), argnums=(0, 1, 2)))(q, k, v)
    for name, got, want in zip("qkv", grads, oracle_grads(q, k, v, d_out, causal=True), strict=True):
        np.testing.assert_allclose(got, want, atol=GRAD_TOL, rtol=GRAD_TOL, err_msg=f"d{name}")
    # Inputs varying over different axes (k sharded, q and v replicated): typed alike before the kernels.
    mixed = _shard_map(lambda q, k, v: tpuattn.attention(q, k, v, causal=True, impl="pallas"), mesh,
                       (P(), P("x"), P()), P("x"), experimental=experimental)
    np.testing.assert_allclose(jax.jit(mixed)(q, k, v), out, atol=FWD_TOL, rtol=FWD_TOL)


def test_second_derivatives_are_refused_with_a_message():
    q, k, v, _ = _inputs(5, 1, 128, 128, 1, 1, 64)
    grad = jax.grad(lambda q: jnp.sum(tpuattn.attention(q, k, v, causal=True, impl="pallas") ** 2))
    with pytest.raises(NotImplementedError,
                       match=r"impl='pallas' has no second derivatives.*'reference', 'blockwise' or 'xla'"):
        jax.jvp(grad, (q,), (jnp.ones_like(q),))  # a Hessian-vector product
    with pytest.raises(NotImplementedError, match=r"impl='pallas' has no second derivatives"):
        jax.grad(lambda q: jnp.sum(grad(q)))(q)


def test_numpy_integer_block_sizes_are_accepted():
    assert ForwardBlocks(np.int64(128), np.int32(256)) == ForwardBlocks(128, 256)
    assert type(ForwardBlocks(np.int64(128)).block_q) is int
    assert BlockSizes.uniform(np.int64(256)) == BlockSizes.uniform(256)
    q, k, v, d_out = _inputs(6, 1, 200, 200, 2, 1, 32)
    for block_sizes in (np.int64(128), BlockSizes(ForwardBlocks(np.int64(8), np.int64(128)),
                                                  BackwardBlocks(np.int32(128), np.int64(128)))):
        out, grads = _value_and_grads(q, k, v, d_out, block_sizes=block_sizes, causal=True)
        np.testing.assert_allclose(out, oracle_attention(q, k, v, causal=True), atol=FWD_TOL, rtol=FWD_TOL)
        for name, got, want in zip("qkv", grads, oracle_grads(q, k, v, d_out, causal=True), strict=True):
            np.testing.assert_allclose(got, want, atol=GRAD_TOL, rtol=GRAD_TOL, err_msg=f"d{name}")


# ------------------------------------------------------------------ the schedule as arithmetic
@pytest.mark.parametrize("transpose", [False, True], ids=["q-major", "kv-major"])
def test_the_interval_rule_gives_the_tables_build_schedule_builds(transpose):
    """plan.schedule computes a position-only schedule from the block indices (no SMEM table); its
    arithmetic, evaluated over the grid, equals build_schedule's tables from MaskSpec.block_map: index,
    needs_mask, count and the grid length, on a grid of lengths, blocks, masks and shifts."""
    from tpuattn.spec import MaskSpec

    lengths = [(256, 256), (200, 328), (328, 200), (1000, 1000), (64, 640)]
    masks = [dict(), dict(causal=True), dict(window=(100, 0)), dict(causal=True, window=(300, None)),
             dict(window=(0, 50)), dict(window=(130, 130)), dict(causal=True, shift=256),
             dict(causal=True, shift=-128)]
    checked = 0
    for q_len, kv_len in lengths:
        for kw in masks:
            mask = MaskSpec(q_len, kv_len, **kw)
            for bq, bk in ((128, 128), (64, 256), (256, 128)):
                tq, tk = -(-q_len // bq) * bq, -(-kv_len // bk) * bk
                rule = plan.schedule(mask, bq, bk, tq, tk, transpose=transpose)
                tables = plan.build_schedule(plan.position_map(mask, bq, bk, tq, tk, transpose=transpose))
                assert rule.rule is not None and tables.rule is None
                assert (rule.steps, rule.num_outer, rule.num_inner) == (tables.steps, tables.num_outer,
                                                                        tables.num_inner), (mask, bq, bk)
                for got, want, what in zip(rule.tables(), tables.tables(), ("index", "needs_mask", "count"),
                                           strict=True):
                    np.testing.assert_array_equal(got, want, err_msg=f"{what}: {mask}, {bq} x {bk}")
                checked += 1
    assert checked == len(lengths) * len(masks) * 3
