"""What several test files need: random inputs and the per-gradient comparison with the oracle."""

from __future__ import annotations

import numpy as np


def random_qkv(rng, q_len, kv_len, *, batch=1, q_heads=2, kv_heads=2, head_dim=16, dtype=np.float32):
    """Standard-normal ``q [batch, q_len, q_heads, head_dim]`` and ``k, v [batch, kv_len, kv_heads, ...]``."""
    q = rng.standard_normal((batch, q_len, q_heads, head_dim)).astype(dtype)
    k = rng.standard_normal((batch, kv_len, kv_heads, head_dim)).astype(dtype)
    v = rng.standard_normal((batch, kv_len, kv_heads, head_dim)).astype(dtype)
    return q, k, v


def assert_grads_close(got, want, *, tol, finite=False):
    """``got`` and ``want`` are (dq, dk, dv); each within ``atol = rtol = tol`` of the oracle's."""
    for name, got_grad, want_grad in zip("qkv", got, want, strict=True):
        got_grad = np.asarray(got_grad, np.float64)
        if finite:
            assert np.all(np.isfinite(got_grad)), f"d{name} has non-finite values"
        np.testing.assert_allclose(got_grad, want_grad, atol=tol, rtol=tol, err_msg=f"d{name}")


def require_tpu_compiler() -> None:
    """At the top of a compile-test module: skip it without libtpu, unless the test command's compile
    stage asks for the compiler (``TPUATTN_REQUIRE_TPU_COMPILER``), where a missing libtpu is an error."""
    import os

    import pytest

    from tpuattn.measure import aot

    if aot.tpu_available():
        return
    if os.environ.get("TPUATTN_REQUIRE_TPU_COMPILER"):
        raise RuntimeError('libtpu is not installed: the compile stage needs pip install "jax[tpu]"')
    pytest.skip("libtpu not installed (the test command's compile stage installs it)",
                allow_module_level=True)
