"""The Pallas kernels compiled for v5e (compiled, not run) at 4096 tokens, MHA (8 query heads on 8 kv
heads) and GQA (16 on 2), bf16, head_dim 128, causal: what is left outside the kernels.

The kernels read and write ``[batch, seq, heads * head_dim]`` (lane columns per head) and keep the
per-row statistics as compact rows ``[batch, heads, 8, seq]``. Where Q, K, V come from a projection
(``[batch, seq, heads * head_dim]``, reshaped to the contract's ``[batch, seq, heads, head_dim]``) and
O goes into one, the optimised program has no copy, transpose or reshape of any array of at least a
K/V's size outside the kernels, forward and forward+backward. Called with arguments in the contract's
shape, the only moves are the TPU's relayout between ``[.., heads, head_dim]`` (tiled over heads and
head_dim) and ``[.., heads * head_dim]`` (tiled over sequence and lanes): at most one per Q, K, V, O
(dO, dQ, dK, dV), none of the statistics. Compile times are in the stage's --durations, not asserted.

Needs libtpu; the test command's ``compile`` stage runs it with ``TPUATTN_REQUIRE_TPU_COMPILER=1``.
"""

from __future__ import annotations

import pytest
from helpers import require_tpu_compiler

from tpuattn.measure import aot

require_tpu_compiler()

T, D = 4096, 128
HEADS = {"mha": (8, 8), "gqa": (16, 2)}


def _compile(mode, heads, projected):
    import jax
    import jax.numpy as jnp

    import tpuattn

    q_heads, kv_heads = HEADS[heads]

    def attend(q, k, v):
        if projected:  # [b, T, H * D] in and out, as a projection makes and takes them
            split = lambda x: x.reshape(x.shape[0], T, -1, D)
            return tpuattn.attention(split(q), split(k), split(v), causal=True, impl="pallas").reshape(q.shape)
        return tpuattn.attention(q, k, v, causal=True, impl="pallas")

    shape = (lambda h: (1, T, h * D)) if projected else (lambda h: (1, T, h, D))
    q = jax.ShapeDtypeStruct(shape(q_heads), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct(shape(kv_heads), jnp.bfloat16)
    loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32))
    fn = attend if mode == "fwd" else jax.grad(loss, argnums=(0, 1, 2))
    return aot.compile_for("v5e", fn, [q, kv, kv]), kv_heads


@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_nothing_moves_outside_the_kernels_between_projections(mode, heads):
    compiled, kv_heads = _compile(mode, heads, projected=True)
    text = compiled.as_text()
    # The Mosaic kernels: forward; row sums, dQ, dK/dV (JAX 0.7 does not name them in the HLO).
    kernels = text.count('custom_call_target="tpu_custom_call"')
    assert kernels == (1 if mode == "fwd" else 4), kernels
    assert aot.data_movement_ops(text, min_bytes=T * kv_heads * D * 2) == []


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_with_contract_shaped_arguments_only_the_tpu_relayout_moves(mode):
    compiled, kv_heads = _compile(mode, "gqa", projected=False)
    moves = aot.data_movement_ops(compiled.as_text(), min_bytes=T * kv_heads * D * 2)
    assert all(shape.startswith("bf16") for _, _, shape, _ in moves), moves  # no statistics
    # Q, K, V in and O out; or Q, K, V in and dQ, dK, dV out (dO, the gradient of a sum, is a broadcast).
    assert len(moves) <= (4 if mode == "fwd" else 6), moves
