"""GQA through the Pallas kernels compiled for v5e (compiled, not run): a 16-query/2-kv-head problem at
4096 tokens compiles with head-block grids (its compile time is in the stage's --durations, not
asserted: a timed test would measure the machine), and the copies left outside the kernels
are the ones counted here (the wrapper's layout copies of Q, K, V, O, dO, dQ, dK, dV and one of the
logsumexp), so that a change that adds one fails.

Needs libtpu; the test command's ``compile`` stage runs it with ``TPUATTN_REQUIRE_TPU_COMPILER=1``.
"""

from __future__ import annotations

import collections

import pytest
from helpers import require_tpu_compiler

from tpuattn.measure import aot

require_tpu_compiler()

T, Q_HEADS, KV_HEADS, D = 4096, 16, 2, 128
Q_SHAPE, KV_SHAPE = f"bf16[1,{T},{Q_HEADS},{D}]", f"bf16[1,{T},{KV_HEADS},{D}]"
LSE_SHAPE = f"f32[1,{Q_HEADS},{T},128]"  # the forward's logsumexp lanes, [batch, heads, seq, 128]
# Copies and transposes of at least a K/V-sized array outside the kernels, by result shape (the
# transposes to and from the kernels' [batch, heads, seq, head_dim] are copies in the contract's shape).
EXPECTED = {
    # Q, K, V into the kernel layout; O out of it.
    "fwd": {Q_SHAPE: 2, KV_SHAPE: 2},
    # Q, K, V in (dO, the gradient of a sum, is a broadcast the compiler makes in place); dQ, dK, dV
    # out; the forward's logsumexp lanes transposed for the dK/dV pass (before its two rows are sliced).
    "fwd+bwd": {Q_SHAPE: 2, KV_SHAPE: 4, LSE_SHAPE: 1},
}


def _compile(mode):
    import jax
    import jax.numpy as jnp

    import tpuattn

    q = jax.ShapeDtypeStruct((1, T, Q_HEADS, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, T, KV_HEADS, D), jnp.bfloat16)
    attend = lambda q, k, v: tpuattn.attention(q, k, v, causal=True, impl="pallas")
    loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32))
    fn = attend if mode == "fwd" else jax.grad(loss, argnums=(0, 1, 2))
    return aot.compile_for("v5e", fn, [q, kv, kv])


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_gqa_16_on_2_compiles_for_v5e_with_the_counted_copies(mode):
    text = _compile(mode).as_text()
    # The Mosaic kernels: forward; row sums, dQ, dK/dV (JAX 0.7 does not name them in the HLO).
    kernels = text.count('custom_call_target="tpu_custom_call"')
    assert kernels == (1 if mode == "fwd" else 4), kernels
    moves = aot.data_movement_ops(text, min_bytes=T * KV_HEADS * D * 2)
    assert dict(collections.Counter(shape for _, _, shape, _ in moves)) == EXPECTED[mode], moves
