"""Every implementation against the float64 NumPy oracle, forward and backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import CASES, FORWARD_TOL, GRAD_TOL, KNOWN_LIMITATIONS
from helpers import assert_grads_close, random_qkv
from oracle import oracle_attention, oracle_grads

import tpuattn
from tpuattn.api import get_implementation, make_spec

IMPLS = tpuattn.implementations()


def _supported(impl, case, q, k, v, kw):
    *_, spec = make_spec(*(jnp.asarray(x, case.dtype) for x in (q, k, v)), **kw)
    return get_implementation(impl).supports(spec)


def _forward_and_gradients(impl, kw, with_grad):
    """One compiled function per case: the output and, if asked, the gradients of sum(out * d_out).

    Compiling forward and backward together halves the suite's compile time, which dominates
    for the Pallas kernels in interpret mode.
    """

    def attend(q, k, v):
        return tpuattn.attention(q, k, v, impl=impl, **kw)

    def both(q, k, v, d_out):
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(d_out.astype(out.dtype))

    return jax.jit(both if with_grad else lambda q, k, v, d_out: (attend(q, k, v), None))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_oracle(impl, case):
    """Forward within FORWARD_TOL[dtype]; gradients of q, k, v (float32 cases) within GRAD_TOL."""
    check_against_oracle(impl, case)


def check_against_oracle(impl, case):
    """One case of the suite for one implementation (also used for implementations registered later)."""
    rng = np.random.default_rng(case.seed)
    q, k, v = case.inputs(rng)
    kw = case.kwargs(rng)
    d_out = rng.standard_normal(q.shape).astype(np.float32)
    reason = _supported(impl, case, q, k, v, kw)
    cast = [jnp.asarray(x, case.dtype) for x in (q, k, v)]
    if reason is not None:
        with pytest.raises(ValueError, match="does not support"):
            tpuattn.attention(*cast, impl=impl, **kw)
        return
    out, grads = _forward_and_gradients(impl, kw, case.grad)(*cast, jnp.asarray(d_out))
    assert out.shape == q.shape and out.dtype == jnp.dtype(case.dtype)
    # The oracle sees exactly the (rounded) inputs the implementation saw.
    inputs64 = [np.asarray(x, np.float64) for x in cast]
    expected = oracle_attention(*inputs64, **kw)
    got = np.asarray(out.astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(got))
    tol = FORWARD_TOL[case.dtype]
    np.testing.assert_allclose(got, expected, atol=tol, rtol=tol, err_msg="forward")
    if not case.grad:
        return
    expected_grads = oracle_grads(*inputs64, d_out, **kw)
    limitation = KNOWN_LIMITATIONS.get((impl, case.name, "gradients"))
    try:
        assert_grads_close(grads, expected_grads, tol=GRAD_TOL, finite=True)
    except AssertionError:
        if limitation:
            pytest.xfail(limitation)
        raise


@pytest.mark.parametrize("impl", IMPLS)
def test_rows_that_see_nothing_are_zero_with_zero_gradient(impl):
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 6, 6)
    q_seg = np.array([[0, 9, 0, 9, 1, 1]], np.int32)  # segment 9 has no keys
    kv_seg = np.array([[0, 0, 1, 1, 1, 1]], np.int32)
    kw = dict(segment_ids=(q_seg, kv_seg))
    # One compiled function for the output and the gradient of sum(out) (op by op, the interpreted
    # kernels spend tens of seconds dispatching).
    out, (dq, _, _) = _forward_and_gradients(impl, kw, True)(q, k, v, jnp.ones(q.shape, jnp.float32))
    out = np.asarray(out)
    np.testing.assert_array_equal(out[0, [1, 3]], 0.0)
    assert np.abs(out[0, [0, 2, 4, 5]]).min() > 0
    np.testing.assert_array_equal(np.asarray(dq)[0, [1, 3]], 0.0)
    assert np.all(np.isfinite(np.asarray(dq)))
