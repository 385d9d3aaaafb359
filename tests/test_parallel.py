"""tpuattn.parallel on 8 CPU devices against the float64 oracle: every strategy, layout and mask.

The devices come from ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (set in conftest.py
before JAX starts). The oracle knows nothing of meshes: the sharded result must equal attention on
the global arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_grads_close, random_qkv
from jax.sharding import Mesh
from oracle import oracle_attention, oracle_grads

import tpuattn
from tpuattn import parallel

if len(jax.devices()) < 8:  # pragma: no cover - conftest sets the flag; say so if it did not take
    pytest.skip("needs 8 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts)",
                allow_module_level=True)

DEVICES = np.array(jax.devices()[:8])


def mesh(*shape_and_names):
    shape = tuple(s for s, _ in shape_and_names)
    names = tuple(n for _, n in shape_and_names)
    return Mesh(DEVICES[: int(np.prod(shape))].reshape(shape), names)


def _segments(batch, length, seed):
    """Sorted runs of ids, one run crossing every chunk boundary, and a row of distinct layout."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, length), size=3, replace=False))
    row = np.searchsorted(cuts, np.arange(length), side="right")
    return np.stack([row, row[::-1].copy()][:batch]).astype(np.int32)


# (name, mesh axes, call kwargs, mask kwargs, q_len, kv_len, q_heads, kv_heads)
CASES = [
    ("ring-natural-causal-gqa", (("s", 8),), dict(seq_axis="s"), dict(causal=True), 64, 64, 4, 2),
    ("ring-zigzag-causal-window-softcap", (("s", 4),), dict(seq_axis="s", layout="zigzag"),
     dict(causal=True, window=(5, 0), softcap=4.0), 32, 32, 2, 2),
    ("ring-zigzag-segments", (("s", 4),), dict(seq_axis="s", layout="zigzag"),
     dict(causal=True, segments=True), 32, 32, 2, 1),
    ("ring-natural-window-both-sides", (("s", 4),), dict(seq_axis="s"), dict(window=(5, 3)), 32, 32, 2, 2),
    ("ring-bottom-right-longer-keys", (("s", 4),), dict(seq_axis="s"), dict(causal=True), 16, 64, 2, 2),
    ("ring-empty-rows", (("s", 4),), dict(seq_axis="s"), dict(causal=True), 64, 32, 2, 2),
    ("allgather-natural-segments", (("s", 4),), dict(seq_axis="s", strategy="allgather"),
     dict(segments=True), 32, 32, 2, 2),
    ("allgather-zigzag-causal-window", (("s", 4),), dict(seq_axis="s", strategy="allgather", layout="zigzag"),
     dict(causal=True, window=(6, 0)), 32, 32, 4, 2),
    ("2d-heads-x-ring", (("h", 2), ("s", 4)), dict(seq_axis="s", head_axis="h"), dict(causal=True),
     32, 32, 4, 2),
    ("2d-batch-x-allgather", (("b", 2), ("s", 4)), dict(seq_axis="s", batch_axis="b", strategy="allgather"),
     dict(causal=True), 32, 32, 2, 2),
    ("batch-and-heads-only", (("b", 2), ("h", 4)), dict(batch_axis="b", head_axis="h"), dict(causal=True),
     24, 24, 8, 4),
    # The Pallas kernel as the local kernel with segment ids that vary over the mesh (interpret mode;
    # zigzag blocks with Pallas are the test below: with segments too, that case compiles for 100 s).
    ("ring-pallas-segments", (("s", 4),), dict(seq_axis="s", impl="pallas"),
     dict(causal=True, segments=True), 32, 32, 2, 1),
    ("allgather-pallas-segments", (("s", 4),), dict(seq_axis="s", strategy="allgather", impl="pallas"),
     dict(segments=True), 32, 32, 2, 2),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sharded_equals_the_oracle_forward_and_gradients(case):
    name, axes, call, mask, q_len, kv_len, q_heads, kv_heads = case
    m = mesh(*[(size, axis) for axis, size in axes])
    batch = 2
    rng = np.random.default_rng(len(name))
    q, k, v = random_qkv(rng, q_len, kv_len, batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=8)
    d_out = rng.standard_normal(q.shape).astype(np.float32)
    mask = dict(mask)
    if mask.pop("segments", False):
        mask["segment_ids"] = _segments(batch, q_len, seed=len(name))
    want = oracle_attention(q, k, v, **mask)
    want_grads = oracle_grads(q, k, v, d_out, **mask)

    n = m.shape[call["seq_axis"]] if "seq_axis" in call else 1
    zig = call.get("layout") == "zigzag"
    to = (lambda x: parallel.to_zigzag(x, n)) if zig else (lambda x: x)
    back = (lambda x: parallel.from_zigzag(np.asarray(x), n)) if zig else np.asarray
    if "segment_ids" in mask:
        mask["segment_ids"] = to(mask["segment_ids"])

    def loss(q, k, v):
        out = parallel.attention(q, k, v, mesh=m, **call, **mask)
        return jnp.sum(out * to(d_out)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(to(q), to(k), to(v))
    np.testing.assert_allclose(back(out), want, atol=2e-5, rtol=2e-5)
    assert_grads_close([back(g) for g in grads], want_grads, tol=5e-5)


def test_pallas_in_interpret_mode_serves_as_the_local_kernel():
    m = mesh((4, "s"))
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, 64, 64, batch=1, q_heads=2, kv_heads=1, head_dim=16)
    d_out = rng.standard_normal(q.shape).astype(np.float32)
    n = 4
    to = lambda x: parallel.to_zigzag(x, n)

    def loss(q, k, v):
        out = parallel.attention(q, k, v, mesh=m, seq_axis="s", layout="zigzag", impl="pallas", causal=True)
        return jnp.sum(out * to(d_out)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(to(q), to(k), to(v))
    want = oracle_attention(q, k, v, causal=True)
    np.testing.assert_allclose(parallel.from_zigzag(np.asarray(out), n), want, atol=2e-5, rtol=2e-5)
    assert_grads_close([parallel.from_zigzag(np.asarray(g), n) for g in grads],
                       oracle_grads(q, k, v, d_out, causal=True), tol=5e-5)


@pytest.mark.parametrize("impl", ["pallas", "blockwise"])
def test_the_contract_inside_a_users_shard_map_with_segments(impl):
    """``tpuattn.attention`` called per device inside the user's own ``jax.shard_map`` (default
    checks), batch sharded, with segment ids that differ per device."""
    from jax.sharding import PartitionSpec as P

    m = mesh((4, "b"))
    rng = np.random.default_rng(11)
    q, k, v = random_qkv(rng, 16, 16, batch=4, q_heads=2, kv_heads=1, head_dim=8)
    segs = np.stack([_segments(1, 16, seed=s)[0] for s in range(4)])
    d_out = rng.standard_normal(q.shape).astype(np.float32)

    def local(q, k, v, segs):
        return tpuattn.attention(q, k, v, causal=True, segment_ids=segs, impl=impl)

    sharded = jax.shard_map(local, mesh=m, in_specs=(P("b"), P("b"), P("b"), P("b")), out_specs=P("b"))
    loss = lambda q, k, v: jnp.sum(sharded(q, k, v, segs) * d_out)
    out = jax.jit(sharded)(q, k, v, segs)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(np.asarray(out), oracle_attention(q, k, v, causal=True, segment_ids=segs),
                               atol=2e-5, rtol=2e-5)
    assert_grads_close(grads, oracle_grads(q, k, v, d_out, causal=True, segment_ids=segs), tol=5e-5)


def test_bf16_ring_within_bf16_error_of_the_oracle():
    m = mesh((4, "s"))
    q, k, v = random_qkv(np.random.default_rng(3), 64, 64, batch=1, q_heads=2, kv_heads=2, head_dim=16)
    out = parallel.attention(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), mesh=m, seq_axis="s",
                             causal=True)
    assert out.dtype == jnp.bfloat16
    # bf16 inputs round q, k, v (8 bits of mantissa) and the output: a few 1e-2 at unit scale.
    np.testing.assert_allclose(np.asarray(out, np.float32), oracle_attention(q, k, v, causal=True),
                               atol=3e-2, rtol=3e-2)


# ---------------------------------------------------------------------------- the schedule
def _spec(length, **mask):
    return tpuattn.spec_from_shapes(length, num_q_heads=1, head_dim=8, **mask)


def _visible_pairs(length, causal=False, window=None):
    """Independent count of visible (query, key) pairs of a self-attention of ``length``."""
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    keep = np.ones((length, length), bool)
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= (j >= i - window[0]) & (j <= i + window[1])
    return int(keep.sum())


@pytest.mark.parametrize("layout", ["natural", "zigzag"])
def test_ring_plan_counts_every_visible_score_once(layout):
    plan = parallel.ring_plan(_spec(64, causal=True), 8, layout)
    assert plan.work.sum() == _visible_pairs(64, causal=True)


def test_zigzag_balances_causal_work_and_natural_does_not():
    natural = parallel.ring_plan(_spec(64, causal=True), 8, "natural").work.sum(axis=1)
    zigzag = parallel.ring_plan(_spec(64, causal=True), 8, "zigzag").work.sum(axis=1)
    assert len(set(zigzag.tolist())) == 1                     # every device the same
    # Chunks of 8: device d computes its diagonal block (8 * 9 / 2 scores) and d full blocks (64).
    assert natural.tolist() == [36 + 64 * d for d in range(8)]
    # Natural: device d has work at steps 0..d only (the keys of later devices are its future).
    plan = parallel.ring_plan(_spec(64, causal=True), 8, "natural")
    assert [(plan.work[d] > 0).sum() for d in range(8)] == list(range(1, 9))


def test_a_window_stops_the_ring_early():
    plan = parallel.ring_plan(_spec(64, causal=True, window=(8, 0)), 8, "natural")
    assert plan.steps == 2  # chunks of 8: the window reaches back one chunk
    assert plan.work.sum() == _visible_pairs(64, causal=True, window=(8, 0))


def test_fully_hidden_blocks_are_skipped_branches():
    plan = parallel.ring_plan(_spec(64, causal=True), 4, "natural")
    # Device 0 at step 1 holds device 3's keys: all in its future.
    assert (plan.branch[0, 1] == plan.skip).all()
    # Distinct computations: the diagonal (causal) block and the full block, nothing else.
    assert len(plan.specs) == 2


def test_zigzag_round_trip_and_order():
    x = np.arange(16)[None, :, None, None]
    z = parallel.to_zigzag(x, 4)
    assert z[0, :, 0, 0].tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    np.testing.assert_array_equal(parallel.from_zigzag(z, 4), x)


@pytest.mark.parametrize("impl", ["reference", "blockwise"])
def test_merge_of_two_key_halves_is_attention_over_both(impl):
    from tpuattn import api, softmax
    from tpuattn.spec import block_spec

    rng = np.random.default_rng(11)
    q, k, v = random_qkv(rng, 32, 32, batch=1, q_heads=2, kv_heads=2, head_dim=8)
    spec = tpuattn.make_spec(q, k, v, causal=True)[-1]  # rows 0..15 see nothing of the second half
    ops = api.get_implementation(impl).partial
    halves = [ops.forward(q, k[:, s:s + 16], v[:, s:s + 16], None,
                          block_spec(spec, q_start=0, q_len=32, kv_start=s, kv_len=16)) for s in (0, 16)]
    assert all(isinstance(h, softmax.Partial) for h in halves)
    np.testing.assert_array_equal(np.asarray(halves[1].m)[..., :16], -np.inf)
    out = softmax.merge(*halves).out
    np.testing.assert_allclose(np.asarray(out), oracle_attention(q, k, v, causal=True), atol=2e-6, rtol=2e-6)


# ---------------------------------------------------------------------------- the program
def test_ring_sends_keys_by_permutes_and_allgather_gathers():
    m = mesh((4, "s"))
    x = jax.ShapeDtypeStruct((1, 32, 2, 8), jnp.float32)
    text = {s: jax.jit(lambda q, k, v, s=s: parallel.attention(q, k, v, mesh=m, seq_axis="s", strategy=s))
            .lower(x, x, x).as_text() for s in ("ring", "allgather")}
    # The ring is a loop whose body sends K and V on (once each); no send after the last step.
    ops = lambda name, which: text[which].count(f'"stablehlo.{name}"')
    assert ops("collective_permute", "ring") == 2 and ops("all_gather", "ring") == 0
    assert "stablehlo.while" in text["ring"]
    assert ops("all_gather", "allgather") == 2 and ops("collective_permute", "allgather") == 0


# ---------------------------------------------------------------------------- bad input
BAD = [
    (dict(mesh="not a mesh"), r"^mesh: expected a jax.sharding.Mesh, got str$"),
    (dict(seq_axis="x"), r"^seq_axis: expected None or one of the mesh's axis names \['s'\], got 'x'$"),
    (dict(seq_axis="s", head_axis="s"), r"^seq_axis: expected a mesh axis not already used"),
    (dict(seq_axis="s", strategy="tree"), r"^strategy: expected one of \['ring', 'allgather'\], got 'tree'$"),
    (dict(seq_axis="s", layout="striped"),
     r"^layout: expected one of \['natural', 'zigzag'\], got 'striped'$"),
    (dict(layout="zigzag"), r"^layout: expected 'natural' when seq_axis is None"),
    (dict(seq_axis="s", impl="xla"), r"^impl: expected an implementation that returns partial results"),
    (dict(head_axis="s"), r"^k: expected a number of kv heads divisible by 4 \(the size of mesh axis 's': "
                          r"kv heads are split with their query groups\), got 2$"),
    (dict(batch_axis="s"), r"^q: expected a batch divisible by 4 \(the size of mesh axis 's'\), got 1$"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[b[1][:40] for b in BAD])
def test_bad_meshes_and_arguments_are_refused(kwargs, message):
    q, k, v = random_qkv(np.random.default_rng(0), 32, 32, batch=1, q_heads=4, kv_heads=2, head_dim=8)
    kwargs = {"mesh": mesh((4, "s")), **kwargs}
    with pytest.raises(ValueError, match=message):
        parallel.attention(q, k, v, **kwargs)


@pytest.mark.parametrize("length,layout,message", [
    (30, "natural", r"^q: expected a sequence length divisible by 4 \(the size of mesh axis 's'\), got 30$"),
    (36, "zigzag", r"^q: expected a sequence length divisible by 8 \(the size of mesh axis 's', times 2 "
                   r"chunks per device for layout='zigzag'\), got 36$"),
])
def test_lengths_that_do_not_divide_are_refused(length, layout, message):
    q, k, v = random_qkv(np.random.default_rng(0), length, length, head_dim=8)
    with pytest.raises(ValueError, match=message):
        parallel.attention(q, k, v, mesh=mesh((4, "s")), seq_axis="s", layout=layout)


def test_contract_errors_are_the_single_device_ones():
    q, k, v = random_qkv(np.random.default_rng(0), 32, 32, head_dim=8)
    with pytest.raises(ValueError, match=r"^window: expected a non-negative left extent, got -1$"):
        parallel.attention(q, k, v, mesh=mesh((4, "s")), seq_axis="s", window=(-1, 0))


@pytest.mark.parametrize("impl", parallel.local_implementations())
def test_a_nan_key_reaches_the_ring_gradients(impl):
    """The project's rule through the ring: a NaN key makes the rows that see it NaN, and their gradients
    NaN, never finite (before: with impl="reference" dk and dv came back finite, the merged row max
    NaN read as "saw nothing" by the local backward)."""
    m = mesh((4, "s"))
    rng = np.random.default_rng(23)
    q, k, v = random_qkv(rng, 32, 32, q_heads=2, kv_heads=2, head_dim=8)
    d_out = rng.standard_normal(q.shape).astype(np.float32)
    k[0, 20, 0] = np.nan  # seen by rows 20.. of head 0 (causal), on the last two devices

    def loss(q, k, v):
        out = parallel.attention(q, k, v, mesh=m, seq_axis="s", impl=impl, causal=True)
        return jnp.sum(out * d_out), out

    (_, out), (dq, dk, dv) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    nan_rows = np.isnan(np.asarray(out)).any(axis=3)[0]  # [q_len, heads]
    np.testing.assert_array_equal(nan_rows[:, 0], np.arange(32) >= 20)
    assert not nan_rows[:, 1].any()
    for name, grad in (("dq", dq), ("dk", dk), ("dv", dv)):
        grad = np.asarray(grad)
        assert np.isnan(grad[:, :, 0]).any(), f"{name} of head 0 is finite where its output is NaN"
