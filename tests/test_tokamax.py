"""impl="tokamax": what the adapter adds beyond tests/test_oracle_suite.py (which runs every case
against the float64 oracle through tokamax's "xla" path wherever tokamax is available): its other CPU
path, its refusals, that ``auto`` never picks it, and that it is unavailable, with the reason, on a JAX
older than 0.9.2."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import assert_grads_close, random_qkv
from oracle import oracle_attention, oracle_grads

import tpuattn
from tpuattn import chips
from tpuattn.api import get_implementation
from tpuattn.errors import UnavailableImplementation, UnsupportedInput

OLD_JAX = tuple(int(p) for p in jax.__version__.split(".")[:3]) < (0, 9, 2)
AVAILABLE = "tokamax" in tpuattn.implementations()


@pytest.mark.skipif(not OLD_JAX, reason="this JAX is 0.9.2 or newer")
def test_unavailable_before_jax_0_9_2_with_the_reason():
    assert "tokamax" not in tpuattn.implementations()
    q, k, v = random_qkv(np.random.default_rng(0), 8, 8)
    with pytest.raises(UnavailableImplementation, match=r"tokamax needs JAX 0\.9\.2 or newer"):
        tpuattn.attention(q, k, v, impl="tokamax")
    # Nothing else changes: auto still answers.
    assert tpuattn.attention(q, k, v, causal=True).shape == q.shape


needs_tokamax = pytest.mark.skipif(not AVAILABLE, reason="tokamax is unavailable on this installation")


@needs_tokamax
def test_xla_chunked_matches_the_oracle_forward_and_gradients():
    rng = np.random.default_rng(1)
    q, k, v = random_qkv(rng, 40, 56, batch=2, q_heads=4, kv_heads=2)
    d_out = rng.standard_normal(q.shape).astype(np.float32)
    kw = dict(causal=True, window=(9, 0), softcap=6.0)

    def both(q, k, v, d_out):
        out, vjp = jax.vjp(lambda *a: tpuattn.attention(*a, impl="tokamax", implementation="xla_chunked",
                                                        **kw), q, k, v)
        return out, vjp(d_out)

    out, grads = jax.jit(both)(q, k, v, d_out)
    np.testing.assert_allclose(np.asarray(out, np.float64), oracle_attention(q, k, v, **kw), atol=2e-5,
                               rtol=2e-5)
    assert_grads_close(grads, oracle_grads(q, k, v, d_out, **kw), tol=1e-4, finite=True)


@needs_tokamax
def test_refusals_name_the_argument():
    q, k, v = random_qkv(np.random.default_rng(2), 8, 8)
    with pytest.raises(UnsupportedInput, match=r"sinks"):
        tpuattn.attention(q, k, v, sinks=np.zeros(2, np.float32), impl="tokamax")
    with pytest.raises(ValueError, match=r"^implementation: 'mosaic' is tokamax's TPU kernel; this call is "
                                         r"for 'cpu'"):
        tpuattn.attention(q, k, v, impl="tokamax", implementation="mosaic")
    with pytest.raises(ValueError, match=r"^implementation: expected None or one of .*got 'triton'"):
        tpuattn.attention(q, k, v, impl="tokamax", implementation="triton")
    with pytest.raises(ValueError, match=r"tokamax: unknown option"):
        tpuattn.attention(q, k, v, impl="tokamax", block_q=128)


@needs_tokamax
@pytest.mark.parametrize("chip", ["v2", "v4"])
def test_chips_before_v5_are_refused(chip):
    spec = tpuattn.spec_from_shapes(2048, num_q_heads=8, head_dim=128, dtype="bfloat16", causal=True)
    with chips.target(chip):
        reason = get_implementation("tokamax").supports(spec, "tpu")
    assert reason is not None and reason.startswith("chip: ") and chip in reason


@needs_tokamax
@pytest.mark.parametrize("chip", [None, "v5e", "v6e"])
def test_auto_never_picks_it(chip):
    for n in (128, 2048, 32768):
        spec = tpuattn.spec_from_shapes(n, num_q_heads=8, head_dim=128, dtype="bfloat16", causal=True)
        if chip is None:
            assert tpuattn.choose(spec, "cpu").impl != "tokamax"
        else:
            with chips.target(chip):
                assert tpuattn.choose(spec, "tpu").impl != "tokamax"
