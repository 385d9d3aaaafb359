"""Attention sinks in the contract: every implementation that takes them against the float64 oracle
(forward, and gradients of q, k, v and the sinks), and the refusals of those that do not."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_grads_close, random_qkv
from oracle import oracle_attention, oracle_grads

import tpuattn
from tpuattn.api import TAKES_SINKS, choose, get_implementation, make_spec
from tpuattn.errors import UnavailableImplementation, UnsupportedInput

TAKERS = tpuattn.implementations(TAKES_SINKS)
FORWARD_TOL, GRAD_TOL = 2e-5, 1e-4

# (name, lengths and heads, contract keywords, sinks): the sinks span "takes most of the mass" (3.0
# against logits of about +-1) to "off" (-inf) and negative; one case has rows that see no key.
CASES = {
    "causal-gqa": (dict(q_len=40, kv_len=40, q_heads=4, kv_heads=2), dict(causal=True),
                   [3.0, -1.0, 0.5, -np.inf]),
    "window-softcap-qlen<kvlen": (dict(q_len=24, kv_len=56, q_heads=2, kv_heads=1),
                                  dict(causal=True, window=(10, 0), softcap=5.0), [0.0, 2.0]),
    "segments-with-empty-rows": (dict(q_len=6, kv_len=6, q_heads=2, kv_heads=2),
                                 dict(segment_ids=(np.array([[0, 9, 0, 9, 1, 1]], np.int32),
                                                   np.array([[0, 0, 1, 1, 1, 1]], np.int32))), [1.0, -2.0]),
}


def _run(impl, kw, q, k, v, sinks, d_out):
    """One compiled function: the output and the gradients of sum(out * d_out) in q, k, v, sinks."""

    def both(q, k, v, sinks, d_out):
        out, vjp = jax.vjp(lambda *a: tpuattn.attention(*a[:3], sinks=a[3], impl=impl, **kw), q, k, v, sinks)
        return out, vjp(d_out)

    return jax.jit(both)(q, k, v, jnp.asarray(sinks, jnp.float32), d_out)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("impl", TAKERS)
def test_sinks_match_the_oracle_forward_and_gradients(impl, case):
    sizes, kw, sinks = CASES[case]
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, sizes["q_len"], sizes["kv_len"], q_heads=sizes["q_heads"],
                         kv_heads=sizes["kv_heads"])
    d_out = rng.standard_normal(q.shape).astype(np.float32)
    sinks = np.array(sinks, np.float32)
    *_, spec = make_spec(q, k, v, **kw)
    reason = get_implementation(impl).supports(spec, "cpu")
    if reason is not None:  # refused as without sinks, with the implementation's own reason
        with pytest.raises(UnsupportedInput, match="does not support"):
            tpuattn.attention(q, k, v, sinks=sinks, impl=impl, **kw)
        return
    out, grads = _run(impl, kw, q, k, v, sinks, d_out)
    got = np.asarray(out, np.float64)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, oracle_attention(q, k, v, sinks=sinks, **kw), atol=FORWARD_TOL,
                               rtol=FORWARD_TOL, err_msg="forward")
    want = oracle_grads(q, k, v, d_out, sinks=sinks, **kw)
    assert_grads_close(grads[:3], want[:3], tol=GRAD_TOL, finite=True)
    np.testing.assert_allclose(np.asarray(grads[3], np.float64), want[3], atol=GRAD_TOL, rtol=GRAD_TOL,
                               err_msg="dsinks")
    if "empty" in case:  # rows 1 and 3 see no key: zeros out, and nothing flows back from them
        np.testing.assert_array_equal(got[0, [1, 3]], 0.0)


def test_the_oracle_sink_gradient_is_the_derivative_of_its_forward():
    """The oracle's own check: its dsinks against central differences of its float64 forward."""
    rng = np.random.default_rng(1)
    q, k, v = (x.astype(np.float64) for x in random_qkv(rng, 5, 7, q_heads=2, kv_heads=1, head_dim=4))
    d_out, sinks, kw = rng.standard_normal(q.shape), np.array([0.3, -0.8]), dict(causal=True)
    want = oracle_grads(q, k, v, d_out, sinks=sinks, **kw)[3]
    eps = 1e-6
    for h in range(2):
        step = np.eye(2)[h] * eps
        hi = np.sum(oracle_attention(q, k, v, sinks=sinks + step, **kw) * d_out)
        lo = np.sum(oracle_attention(q, k, v, sinks=sinks - step, **kw) * d_out)
        assert abs((hi - lo) / (2 * eps) - want[h]) < 1e-7


def test_a_sink_of_minus_infinity_is_no_sink_and_a_large_one_takes_the_mass():
    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, 16, 16)
    plain = np.asarray(tpuattn.attention(q, k, v, causal=True, impl="reference"))
    off = np.asarray(tpuattn.attention(q, k, v, causal=True, sinks=jnp.full((2,), -jnp.inf),
                                       impl="reference"))
    np.testing.assert_allclose(off, plain, atol=1e-6, rtol=1e-6)  # another path: float32 rounding apart
    heavy = np.asarray(tpuattn.attention(q, k, v, causal=True, sinks=jnp.full((2,), 60.0), impl="blockwise"))
    assert np.abs(heavy).max() < 1e-20  # exp(-60) of the mass is left for the values


def test_auto_chooses_among_the_implementations_that_take_sinks():
    *_, spec = make_spec(*random_qkv(np.random.default_rng(0), 8, 8))
    choice = choose(spec, "cpu", subset=TAKES_SINKS)
    assert choice.impl in TAKERS
    refused = dict(choice.refused)
    assert "xla" in refused and "takes sinks" in refused["xla"]


@pytest.mark.parametrize("impl", sorted(set(tpuattn.known_implementations()) - set(TAKERS)))
def test_implementations_that_cannot_take_sinks_refuse_them(impl):
    q, k, v = random_qkv(np.random.default_rng(0), 8, 8)
    with pytest.raises((UnsupportedInput, UnavailableImplementation), match="sinks|not available"):
        tpuattn.attention(q, k, v, sinks=jnp.zeros(2), impl=impl)


@pytest.mark.parametrize(("sinks", "error", "match"), [
    (np.zeros(3, np.float32), ValueError, r"sinks: expected shape \(2,\).*got \(3,\)"),
    (np.zeros((1, 2), np.float32), ValueError, r"sinks: expected shape \(2,\)"),
    (np.zeros(2, np.int32), TypeError, "sinks: expected a floating dtype.*int32"),
    ([0.0, 1.0], TypeError, "sinks: expected an array, got list"),
])
def test_bad_sinks_are_refused_by_name(sinks, error, match):
    q, k, v = random_qkv(np.random.default_rng(0), 8, 8)
    with pytest.raises(error, match=match):
        tpuattn.attention(q, k, v, sinks=sinks, impl="reference")


# ----------------------------------------------------------------------------- decode
DECODE_TAKERS = tuple(name for name in tpuattn.decode.implementations()
                      if tpuattn.decode.get_implementation(name).takes_sinks)


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("impl", DECODE_TAKERS)
def test_decode_with_sinks_matches_the_oracle(impl, paged):
    from decode_oracle import oracle_decode

    rng = np.random.default_rng(5)
    b, q_len, heads, kv_heads, d, page = 3, 2, 4, 2, 32, 8
    lengths = np.array([0, 5, 24], np.int32)  # an empty sequence: its rows stay zeros
    if paged:
        k = rng.standard_normal((b * 3 + 2, page, kv_heads, d)).astype(np.float32)
        table = rng.permutation(b * 3 + 2)[: b * 3].reshape(b, 3).astype(np.int32)
    else:
        k, table = rng.standard_normal((b, 24, kv_heads, d)).astype(np.float32), None
    v = rng.standard_normal(k.shape).astype(np.float32)
    q = rng.standard_normal((b, q_len, heads, d)).astype(np.float32)
    sinks = np.array([2.0, -1.0, 0.0, -np.inf], np.float32)
    options = dict(chunk_blocks=1, pages_per_step=1) if impl == "pallas" and paged else {}
    out = jax.jit(lambda q, k, v, lengths, table, sinks: tpuattn.decode.attention(
        q, k, v, lengths, page_table=table, softcap=4.0, sinks=sinks, impl=impl, **options))(
        q, k, v, lengths, table, sinks)
    got = np.asarray(out, np.float64)
    want = oracle_decode(q, k, v, lengths, page_table=table, softcap=4.0, sinks=sinks)
    np.testing.assert_allclose(got, want, atol=FORWARD_TOL, rtol=FORWARD_TOL)
    np.testing.assert_array_equal(got[0], 0.0)


@pytest.mark.parametrize("impl", sorted(set(tpuattn.decode.known_implementations()) - set(DECODE_TAKERS)))
def test_decode_implementations_that_cannot_take_sinks_refuse_them(impl):
    q = jnp.zeros((1, 1, 2, 128), jnp.float32)
    cache = jnp.zeros((1, 16, 2, 128), jnp.float32)
    with pytest.raises((UnsupportedInput, UnavailableImplementation), match="sinks|not available"):
        tpuattn.decode.attention(q, cache, cache, jnp.array([3]), sinks=jnp.zeros(2), impl=impl)


# tpuattn.parallel with sinks on 8 CPU devices (tests/conftest.py): the sinks sharded with the heads,
# the sequence by ring (the sink starts every row's running state) or all-gather (attended locally).
# (name, mesh axes, call keywords, mask keywords, sinks)
PARALLEL_CASES = {
    "ring-zigzag-causal-gqa": ((("s", 4),), dict(seq_axis="s", layout="zigzag"), dict(causal=True),
                               [3.0, -1.0, 0.5, -np.inf]),
    "heads-x-ring-window": ((("h", 2), ("s", 4)), dict(seq_axis="s", head_axis="h"),
                            dict(causal=True, window=(6, 0)), [1.0, -2.0, 0.0, 2.5]),
    "batch-x-allgather": ((("b", 2), ("s", 4)), dict(seq_axis="s", batch_axis="b", strategy="allgather"),
                          dict(causal=True), [2.0, -0.5, 1.0, 0.0]),
    "batch-and-heads-only": ((("b", 2), ("h", 2)), dict(batch_axis="b", head_axis="h"), dict(causal=True),
                             [0.5, 1.5, -1.0, 3.0]),
}


@pytest.mark.parametrize("case", sorted(PARALLEL_CASES))
def test_parallel_with_sinks_matches_the_oracle(case):
    from jax.sharding import Mesh

    from tpuattn import parallel

    axes, call, kw, sinks = PARALLEL_CASES[case]
    size = int(np.prod([n for _, n in axes]))
    if len(jax.devices()) < size:  # pragma: no cover - conftest sets the flag
        pytest.skip(f"needs {size} CPU devices")
    mesh = Mesh(np.array(jax.devices()[:size]).reshape([n for _, n in axes]), [a for a, _ in axes])
    rng = np.random.default_rng(11)
    q, k, v = random_qkv(rng, 32, 32, batch=2, q_heads=4, kv_heads=2, head_dim=8)
    d_out = rng.standard_normal(q.shape).astype(np.float32)
    sinks = np.array(sinks, np.float32)
    n = dict(axes).get("s", 1)
    zig = call.get("layout") == "zigzag"
    to = (lambda x: parallel.to_zigzag(x, n)) if zig else (lambda x: x)
    back = (lambda x: parallel.from_zigzag(np.asarray(x), n)) if zig else np.asarray

    def both(q, k, v, z, d_out):
        f = lambda q, k, v, z: parallel.attention(q, k, v, mesh=mesh, sinks=z, **call, **kw)
        out, vjp = jax.vjp(f, q, k, v, z)
        return out, vjp(d_out)

    out, grads = jax.jit(both)(to(q), to(k), to(v), jnp.asarray(sinks), to(d_out))
    np.testing.assert_allclose(back(out), oracle_attention(q, k, v, sinks=sinks, **kw), atol=FORWARD_TOL,
                               rtol=FORWARD_TOL, err_msg="forward")
    want = oracle_grads(q, k, v, d_out, sinks=sinks, **kw)
    assert_grads_close([back(g) for g in grads[:3]], want[:3], tol=GRAD_TOL, finite=True)
    np.testing.assert_allclose(np.asarray(grads[3], np.float64), want[3], atol=GRAD_TOL, rtol=GRAD_TOL,
                               err_msg="dsinks")


def test_the_contract_and_the_ring_share_one_partial_result_backward(monkeypatch):
    """``tpuattn.sinks.partial_backward`` is the one backward of partial results (delta summed, then the
    gradients, the sinks' gradient apart): the contract's sinks and the ring, with sinks or without,
    differentiate through it (their gradients against the oracle: the tests above)."""
    from jax.sharding import Mesh

    from tpuattn import parallel
    from tpuattn import sinks as attention_sinks

    calls = []
    shared = attention_sinks.partial_backward

    def spy(sinks, *args, **kwargs):
        calls.append(sinks is not None)
        return shared(sinks, *args, **kwargs)

    monkeypatch.setattr(attention_sinks, "partial_backward", spy)
    mesh = Mesh(np.array(jax.devices()[:2]), ["s"])
    q, k, v = random_qkv(np.random.default_rng(5), 12, 12, q_heads=2, kv_heads=1, head_dim=4)
    z = jnp.asarray([1.0, -1.0])
    ring = dict(mesh=mesh, seq_axis="s", impl="reference")
    jax.grad(lambda q, z: jnp.sum(tpuattn.attention(q, k, v, sinks=z, impl="reference")), (0, 1))(q, z)
    jax.grad(lambda q, z: jnp.sum(parallel.attention(q, k, v, sinks=z, **ring)), (0, 1))(q, z)
    jax.grad(lambda q: jnp.sum(parallel.attention(q, k, v, **ring)))(q)
    assert calls == [True, True, False]


# The contract inside a user's own jax.shard_map (default checks): the batch sharded over 4 devices and
# the sinks replicated (P()). Each device's rows give a share of the sinks' gradient; the gradient is
# the sum of the shares (before: a raw custom-VJP type error for the implementations with partial
# results, and from splash under jit the first device's share alone, 0.723 where the sum is 1.555;
# eagerly, splash raised "`manual_axis_type` on `jax.ShapeDtypeStruct` must not be None").
@pytest.mark.parametrize("mode", ["jit", "eager"])
@pytest.mark.parametrize("impl", TAKERS)
def test_replicated_sinks_inside_a_users_shard_map_sum_their_gradient_over_the_devices(impl, mode):
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:4]), ("b",))
    rng = np.random.default_rng(13)
    q, k, v = random_qkv(rng, 32, 32, batch=4, q_heads=4, kv_heads=2, head_dim=16)
    d_out = rng.standard_normal(q.shape).astype(np.float32)
    sinks = np.array([0.5, -1.0, 2.0, -np.inf], np.float32)
    kw = dict(causal=True)
    local = lambda q, k, v, z: tpuattn.attention(q, k, v, sinks=z, impl=impl, **kw)
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P("b"), P("b"), P("b"), P()), out_specs=P("b"))
    grad = jax.grad(lambda q, k, v, z: jnp.sum(sharded(q, k, v, z) * d_out), argnums=(0, 1, 2, 3))
    grads = (jax.jit(grad) if mode == "jit" else grad)(q, k, v, jnp.asarray(sinks))
    want = oracle_grads(q, k, v, d_out, sinks=sinks, **kw)
    assert_grads_close(grads[:3], want[:3], tol=GRAD_TOL, finite=True)
    np.testing.assert_allclose(np.asarray(grads[3], np.float64), want[3], atol=GRAD_TOL, rtol=GRAD_TOL,
                               err_msg="dsinks: the sum over the devices' shares")


# Non-finite inputs: a NaN output never comes with finite gradients (the project's rule, as in
# tests/test_hardening.py). 32 tokens: short enough that XLA's CPU max returns a NaN row max for a row
# that sees a NaN key (at 128 tokens its vectorised max skips the NaN), the case the reference's
# backward read as "saw nothing" (P = 0: dq, dk, dv exactly zero, or dk and dv finite).
def _nan_per_head(x):
    return np.isnan(np.asarray(x, np.float64)).any(axis=tuple(i for i in range(x.ndim) if i != 2))


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("impl", TAKERS)
def test_a_non_finite_sink_gives_its_head_nan_outputs_and_nan_gradients(impl, bad):
    rng = np.random.default_rng(17)
    q, k, v = random_qkv(rng, 32, 32, q_heads=2, kv_heads=2, head_dim=16)
    d_out = rng.standard_normal(q.shape).astype(np.float32)
    out, (dq, dk, dv, dz) = _run(impl, dict(causal=True), q, k, v, np.array([bad, 0.5], np.float32), d_out)
    assert np.isnan(np.asarray(out)[:, :, 0]).all(), "head 0's output: NaN everywhere"
    for name, grad in (("dq", dq), ("dk", dk), ("dv", dv)):  # head 0 (its own kv head) NaN, head 1 not
        np.testing.assert_array_equal(_nan_per_head(grad), [True, False], err_msg=name)
    assert np.isnan(np.asarray(dz)[0])
    # Head 1 is untouched: the oracle's values with a finite sink for head 0.
    want_out = oracle_attention(q, k, v, causal=True, sinks=[0.0, 0.5])
    np.testing.assert_allclose(np.asarray(out, np.float64)[:, :, 1], want_out[:, :, 1], atol=FORWARD_TOL,
                               rtol=FORWARD_TOL)
    want = oracle_grads(q, k, v, d_out, causal=True, sinks=[0.0, 0.5])
    head1 = lambda x: np.asarray(x, np.float64)[1] if np.ndim(x) == 1 else np.asarray(x, np.float64)[:, :, 1]
    for name, got, w in zip(("dq", "dk", "dv", "dz"), (dq, dk, dv, dz), want, strict=True):
        np.testing.assert_allclose(head1(got), head1(w), atol=GRAD_TOL, rtol=GRAD_TOL, err_msg=name)


@pytest.mark.parametrize("impl", TAKERS)
def test_a_nan_key_with_finite_sinks_reaches_dk_and_dv(impl):
    rng = np.random.default_rng(19)
    q, k, v = random_qkv(rng, 32, 32, q_heads=2, kv_heads=2, head_dim=16)
    d_out = rng.standard_normal(q.shape).astype(np.float32)
    k[0, 20, 0] = np.nan  # kv head 0's key 20: rows 20.. of query head 0 see it (causal)
    out, (dq, dk, dv, dz) = _run(impl, dict(causal=True), q, k, v, np.array([0.5, -1.0], np.float32), d_out)
    nan_rows = np.isnan(np.asarray(out)).any(axis=3)[0]  # [q_len, heads]
    np.testing.assert_array_equal(nan_rows[:, 0], np.arange(32) >= 20)
    assert not nan_rows[:, 1].any()
    for name, grad in (("dk", dk), ("dv", dv), ("dq", dq)):
        assert _nan_per_head(grad)[0], f"{name} of head 0 is finite where its output is NaN"
    assert np.isnan(np.asarray(dz)[0])


@pytest.mark.parametrize("impl", TAKERS)
def test_bf16_inputs_differentiate_their_float32_sinks(impl):
    """bf16 q, k, v with float32 sinks: dq, dk, dv within 1e-2 of the float64 oracle's largest value, and
    the sinks' gradient float32, within bf16 rounding (2**-8) of the sum of its terms' magnitudes,
    sum |p_sink * o * dO| over batch, rows and head_dim (the terms cancel: the gradient is 0.3 to 5 per
    cent of that sum; splash's, its kernel's sum in bf16, is within 1.4e-4 of it, the others 1e-8).
    Before: splash raised a raw "lax.mul requires arguments to have the same dtypes, got bfloat16,
    float32", its kernel's sink gradient coming back in bf16."""
    rng = np.random.default_rng(29)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in random_qkv(rng, 128, 128, batch=2, q_heads=4, kv_heads=2,
                                                                  head_dim=64))
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
    sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    _, grads = _run(impl, dict(causal=True), q, k, v, sinks, d_out)
    assert grads[3].dtype == jnp.float32
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    want = oracle_grads(q, k, v, d_out, causal=True, sinks=sinks)
    for name, got, w in zip(("dq", "dk", "dv"), grads[:3], want[:3], strict=True):
        assert np.abs(np.asarray(got, np.float64) - w).max() <= 1e-2 * np.abs(w).max(), name
    # p_sink = 1 - (attention over values of 1), in float64.
    p_sink = 1.0 - oracle_attention(q, k, np.ones_like(v), causal=True, sinks=sinks)[..., :1]
    terms = np.abs(p_sink * oracle_attention(q, k, v, causal=True, sinks=sinks) * d_out).sum(axis=(0, 1, 3))
    assert np.all(np.abs(np.asarray(grads[3], np.float64) - want[3]) <= 2.0**-8 * terms)


@pytest.mark.parametrize("impl", TAKERS)
def test_second_derivatives_with_sinks_or_a_clear_refusal(impl):
    """A Hessian-vector product through sinks: the oracle's (central differences of its gradient), or
    the kernels' refusal by name (before: pallas raised a bare NotImplementedError(''))."""
    rng = np.random.default_rng(31)
    q, k, v = random_qkv(rng, 32, 32, q_heads=2, kv_heads=1, head_dim=16)
    tangent = rng.standard_normal(q.shape).astype(np.float32)
    sinks = np.array([0.5, -1.0], np.float32)

    def hvp():
        loss = lambda q: jnp.sum(tpuattn.attention(q, k, v, causal=True, sinks=sinks, impl=impl) ** 2)
        return jax.jvp(jax.grad(loss), (q,), (tangent,))[1]

    if impl in ("pallas", "splash"):
        refusal = rf"impl='{impl}' has no second derivatives.*'reference'"
        with pytest.raises(NotImplementedError, match=refusal):
            hvp()
        return
    eps = 1e-3
    oracle_grad = lambda q: oracle_grads(q, k, v, 2 * oracle_attention(q, k, v, causal=True, sinks=sinks),
                                         causal=True, sinks=sinks)[0]
    numeric = (oracle_grad(q + eps * tangent) - oracle_grad(q - eps * tangent)) / (2 * eps)
    assert np.abs(np.asarray(hvp(), np.float64) - numeric).max() <= 1e-2 * np.abs(numeric).max()
