"""The Pallas kernels compiled for v5e (compiled, not run) at 4096 tokens, MHA (8 query heads on 8 kv
heads) and GQA (16 on 2 at head_dim 128, 8 on 2 at 64), bf16, head_dim 128 and 64 (two heads to a
128-lane tile), causal: what is left outside the kernels.

The kernels read and write ``[batch, seq, heads * head_dim]`` (lane columns per head) and keep the
per-row statistics as compact rows ``[batch, heads, 8, seq]``. Where Q, K, V come from a projection
(``[batch, seq, heads * head_dim]``, reshaped to the contract's ``[batch, seq, heads, head_dim]``) and
O goes into one, the optimised program has no copy, transpose or reshape of any array of at least a
K/V's size outside the kernels, forward and forward+backward. Called with arguments in the contract's
shape, the only moves are the TPU's relayout between ``[.., heads, head_dim]`` (tiled over heads and
head_dim) and ``[.., heads * head_dim]`` (tiled over sequence and lanes): at most one per Q, K, V, O
(dQ, dK, dV), none of the statistics. Compile times are in the stage's --durations, not asserted.

Needs libtpu; the test command's ``compile`` stage runs it with ``TPUATTN_REQUIRE_TPU_COMPILER=1``.
"""

from __future__ import annotations

import pytest
from helpers import require_tpu_compiler

from tpuattn.measure import aot

require_tpu_compiler()

# What the optimised program moves is the newest compiler's: JAX 0.7.2's compile stage compiles these
# kernels in tests/test_aot.py and leaves this analysis out (ci/test.py; Colab's own libtpu is
# not 0.7.2's pinned one either, and notebook 03 prints its moves on Colab's stack).
pytestmark = pytest.mark.newest_compiler

PROBLEMS = {"mha": aot.Problem(seq_len=4096, heads=8, kv_heads=8),
            "gqa": aot.Problem(seq_len=4096, heads=16, kv_heads=2),
            # head_dim 64: heads paired in 128-lane tiles, still the free view (tpuattn.pallas.layout)
            "mha-d64": aot.Problem(seq_len=4096, heads=8, kv_heads=8, head_dim=64),
            # 8 on 2 rather than 16: a step serves a kv pair's query heads, 16 of them at 16/2, an
            # unrolled loop that takes 37 s to compile forward+backward here; 8/2 takes 9 s and rolls
            # half its heads onto the other half just the same (groups of 4)
            "gqa-d64": aot.Problem(seq_len=4096, heads=8, kv_heads=2, head_dim=64)}


@pytest.mark.parametrize("heads", sorted(PROBLEMS))
@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_nothing_moves_outside_the_kernels_between_projections(mode, heads):
    compiled, moves = aot.wrapper_moves("v5e", PROBLEMS[heads], mode, projected=True)
    # The Mosaic kernels: forward; row sums, dQ, dK/dV (JAX 0.7 does not name them in the HLO).
    kernels = compiled.as_text().count('custom_call_target="tpu_custom_call"')
    assert kernels == (1 if mode == "fwd" else 4), kernels
    assert moves == []


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_with_contract_shaped_arguments_only_the_tpu_relayout_moves(mode):
    _, moves = aot.wrapper_moves("v5e", PROBLEMS["gqa"], mode)
    assert moves, "expected the relayout of [.., heads, head_dim] arguments"
    assert all(shape.startswith("bf16") for _, _, shape, _ in moves), moves  # no statistics
    # Q, K, V in and O out; or Q, K, V in and dQ, dK, dV out (dO, the gradient of a sum, is a broadcast).
    assert len(moves) <= (4 if mode == "fwd" else 6), moves
