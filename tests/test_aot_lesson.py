"""impl="lesson" (notebook 03's finished kernel) compiled for v5e by the TPU compiler, not run: its
forward and its forward + backward (three Pallas kernels: forward, dQ, dK/dV), float32 and bfloat16,
head_dim 128 and 64, a length that is not a multiple of its blocks (1000: padded to 1024), causal GQA
and a two-sided window. Interpret mode cannot show that Mosaic accepts the kernels' blocks (the
statistics as ``[..., block_q, 1]`` columns, 8-row blocks of a short input); the compiler can.

Needs libtpu; the test command's ``compile`` stage runs it with ``TPUATTN_REQUIRE_TPU_COMPILER=1``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import require_tpu_compiler

import tpuattn
from tpuattn.measure import aot

require_tpu_compiler()

PROBLEMS = {  # (q_len, q heads, kv heads, head_dim, contract keywords)
    "causal-gqa-1000-d128": (1000, 4, 2, 128, dict(causal=True)),
    "window-512-d64": (512, 2, 2, 64, dict(window=(100, 20))),
    "short-causal-13": (13, 2, 1, 128, dict(causal=True)),  # one 16-row block
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", PROBLEMS)
def test_lesson_compiles_for_v5e_forward_and_backward(name, dtype):
    q_len, q_heads, kv_heads, head_dim, kw = PROBLEMS[name]
    q = jax.ShapeDtypeStruct((1, q_len, q_heads, head_dim), jnp.dtype(dtype))
    kv = jax.ShapeDtypeStruct((1, q_len, kv_heads, head_dim), jnp.dtype(dtype))

    def attend(q, k, v):
        return tpuattn.attention(q, k, v, impl="lesson", **kw)

    def gradients(q, k, v):
        loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    for fn, kernels in ((attend, 1), (gradients, 3)):
        compiled = aot.compile_for("v5e", fn, (q, kv, kv))
        assert aot.compiled_facts(compiled)["custom_calls"] == kernels  # the Mosaic kernels, no fallback
