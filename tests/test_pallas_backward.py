"""The Pallas kernel's two backwards (``backward="exact"`` | ``"fast"``): matmuls per visible tile
counted from the kernels' own jaxprs, the fast one against the float64 oracle, and the measured reason
the default stays exact (benchmarks/backward_accuracy.py prints the full comparison)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import CASES, FORWARD_TOL, GRAD_TOL
from helpers import assert_grads_close, random_qkv
from oracle import oracle_attention, oracle_grads
from test_hardening import _one_hot_rows

import tpuattn
from tpuattn.model.counts import matmuls_per_step

CASE = {case.name: case for case in CASES}


# ---------------------------------------------------------------------------- matmuls per tile
def _bwd_counts(backward, **kw):
    """Matmuls per computed grid step of each kernel that jax.grad of attention runs."""
    q = jnp.zeros((1, 256, 4, 128), jnp.bfloat16)
    k = v = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
    options = {} if backward is None else {"backward": backward}
    loss = lambda q, k, v: jnp.sum(
        tpuattn.attention(q, k, v, impl="pallas", interpret=True, **options, **kw).astype(jnp.float32))
    return matmuls_per_step(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)


# A causal GQA problem with segments and a softcap: masked and unmasked tiles, every branch traced.
MASKED = dict(causal=True, softcap=30.0, segment_ids=np.zeros((1, 256), np.int32))


@pytest.mark.parametrize(("backward", "want"), [
    # forward: S = Q K^T, P V. Row sums: S, dP = dO V^T. dQ: S, dP, dS K. dK/dV: S^T, P^T dO, dP^T, dS^T Q.
    (None, {"tpuattn_flash_forward": 2, "tpuattn_flash_row_sums": 2, "tpuattn_flash_dq": 3,
            "tpuattn_flash_dkv": 4}),
    ("exact", {"tpuattn_flash_forward": 2, "tpuattn_flash_row_sums": 2, "tpuattn_flash_dq": 3,
               "tpuattn_flash_dkv": 4}),
    # delta = rowsum(dO * O) is an elementwise product and a sum outside the kernels: no pass, no matmul.
    ("fast", {"tpuattn_flash_forward": 2, "tpuattn_flash_dq": 3, "tpuattn_flash_dkv": 4}),
])
def test_matmuls_per_visible_tile_from_the_kernels_jaxprs(backward, want):
    counts = _bwd_counts(backward, **MASKED)
    assert counts == want
    backward_total = sum(n for name, n in counts.items() if name != "tpuattn_flash_forward")
    assert backward_total == (7 if backward == "fast" else 9)


# ---------------------------------------------------------------------------- the option
@pytest.mark.parametrize("bad", ["quick", "Exact", 1, True])
def test_an_unknown_backward_is_refused_by_name(bad):
    q, k, v = random_qkv(np.random.default_rng(0), 8, 8)
    with pytest.raises(ValueError, match=r"backward: expected one of \('exact', 'fast'\).*got"):
        tpuattn.attention(q, k, v, impl="pallas", backward=bad)


def test_backward_is_an_option_of_pallas_alone():
    assert "backward" in tpuattn.api.get_implementation("pallas").options
    q, k, v = random_qkv(np.random.default_rng(0), 8, 8)
    with pytest.raises(ValueError, match="backward"):
        tpuattn.attention(q, k, v, impl="blockwise", backward="fast")


# ---------------------------------------------------------------------------- fast against the oracle
def _forward_and_gradients(case, backward):
    rng = np.random.default_rng(case.seed)
    q, k, v = case.inputs(rng)
    kw = case.kwargs(rng)
    d_out = rng.standard_normal(q.shape).astype(np.float32)

    def both(q, k, v, d_out):
        out, vjp = jax.vjp(lambda q, k, v: tpuattn.attention(q, k, v, impl="pallas", backward=backward, **kw),
                           q, k, v)
        return out, vjp(d_out.astype(out.dtype))

    out, grads = jax.jit(both)(q, k, v, jnp.asarray(d_out))
    inputs64 = [np.asarray(x, np.float64) for x in (q, k, v)]
    return out, grads, oracle_attention(*inputs64, **kw), oracle_grads(*inputs64, d_out, **kw)


FAST_CASES = ["gqa", "segments-empty-rows", "everything", "softcap", "window-causal-left"]


@pytest.mark.parametrize("name", FAST_CASES)
def test_fast_backward_matches_the_oracle(name):
    """Causal GQA; segments with rows that see no key; window + softcap + segments + GQA together."""
    out, grads, want_out, want_grads = _forward_and_gradients(CASE[name], "fast")
    np.testing.assert_allclose(np.asarray(out, np.float64), want_out, atol=FORWARD_TOL["float32"],
                               rtol=FORWARD_TOL["float32"])
    assert_grads_close(grads, want_grads, tol=GRAD_TOL, finite=True)


def _max_errors(got, want):
    return [float(np.abs(np.asarray(g, np.float64) - w).max()) for g, w in zip(got, want, strict=True)]


def test_why_exact_is_the_default_fast_misses_the_suites_large_logit_case():
    """At exact-integer float32 logits up to ~1.2e3 (the oracle suite's gradient case) the suite asks
    1e-4 of the gradients. Over six draws of dO the exact backward meets it on every one; the fast one's
    delta, rounded through O, carries about |dP| * 2**-24 into every dS, which |q| ~ 1e2 amplifies in dk,
    and misses it on some (on JAX 0.10.2: all six, worst 2.1e-4; on 0.7.2: two, worst 1.3e-4). Should
    this start passing, the default can be reconsidered (benchmarks/backward_accuracy.py)."""
    case = CASE["logits-1e3-spread-causal"]
    rng = np.random.default_rng(case.seed)
    q, k, v = case.inputs(rng)
    kw = case.kwargs(rng)
    inputs64 = [np.asarray(x, np.float64) for x in (q, k, v)]

    def gradient(backward):
        loss = lambda q, k, v, d_out: jnp.sum(tpuattn.attention(q, k, v, impl="pallas", backward=backward,
                                                                **kw) * d_out)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    run = {name: gradient(name) for name in ("exact", "fast")}
    worst = {"exact": 0.0, "fast": 0.0}
    for draw in range(6):
        d_out = np.random.default_rng(100 + draw).standard_normal(q.shape).astype(np.float32)
        want = oracle_grads(*inputs64, d_out, **kw)
        for name, grad in run.items():
            worst[name] = max(worst[name], *_max_errors(grad(q, k, v, d_out), want))
    assert worst["exact"] <= GRAD_TOL, worst
    assert worst["fast"] > GRAD_TOL and worst["fast"] > 2 * worst["exact"], worst


def test_fast_backward_keeps_bf16_near_one_hot_rows_within_the_hardening_bound():
    """The hardening bound (at most 4x the reference's error) holds for fast too: its delta reads the
    forward's float32 output, not the bf16-rounded one."""
    q, k, v, d_out, inputs64 = _one_hot_rows()
    want = oracle_grads(*inputs64, d_out)

    def grads(impl, **options):
        loss = lambda q, k, v: jnp.sum(tpuattn.attention(q, k, v, impl=impl, **options).astype(jnp.float32)
                                       * d_out)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    fast, ref = _max_errors(grads("pallas", backward="fast"), want), _max_errors(grads("reference"), want)
    assert max(f / r for f, r in zip(fast, ref, strict=True)) <= 4.0, (fast, ref)


def test_sinks_take_the_option_and_keep_their_exact_row_sums():
    """With sinks the kernels attend as blocks (PartialOps): the option is validated and their delta
    stays rowsum(P * dP), so the gradients (sinks' included) still match the oracle."""
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 40, 40, q_heads=4, kv_heads=2)
    d_out = rng.standard_normal(q.shape).astype(np.float32)
    sinks = np.array([1.0, -1.0, 0.5, 2.0], np.float32)

    def both(q, k, v, sinks):
        out, vjp = jax.vjp(lambda *a: tpuattn.attention(*a[:3], sinks=a[3], impl="pallas", backward="fast",
                                                        causal=True), q, k, v, sinks)
        return out, vjp(jnp.asarray(d_out))

    out, grads = jax.jit(both)(q, k, v, jnp.asarray(sinks))
    inputs64 = [np.asarray(x, np.float64) for x in (q, k, v)]
    np.testing.assert_allclose(np.asarray(out, np.float64),
                               oracle_attention(*inputs64, causal=True, sinks=sinks), atol=2e-5, rtol=2e-5)
    *want, want_sinks = oracle_grads(*inputs64, d_out, causal=True, sinks=sinks)
    assert_grads_close(grads[:3], want, tol=GRAD_TOL, finite=True)
    np.testing.assert_allclose(np.asarray(grads[3], np.float64), want_sinks, atol=GRAD_TOL, rtol=GRAD_TOL)
