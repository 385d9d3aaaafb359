"""The one FLOP convention every benchmark, figure and model in the package reports.

The standard count (FlashAttention's benchmarks, Triton's fused-attention tutorial): the forward
is two matmuls, ``Q K^T`` and ``P V``, of ``2 * q_len * kv_len * head_dim`` FLOPs each per
(batch, query head); a causal mask halves it; the backward is 2.5x the forward (five matmuls:
dV, dP, dQ, dK and the recomputed S), so forward+backward counts ``1 + 2.5 = 3.5`` times the
forward. It is a convention for comparing runs, not the work a particular schedule executes
(:mod:`tpuattn.model.roofline` counts that).
"""

from __future__ import annotations

from tpuattn._checks import positive_int

MODES = ("fwd", "fwd+bwd")  # what a measurement times: the forward, or the gradient (which runs both)

FORWARD_FLOPS_PER_SCORE = 4  # per (query, key) pair and head_dim element: 2 matmuls x (mul + add)
CAUSAL_FACTOR = 0.5
BACKWARD_FACTOR = 2.5
MODE_FACTOR = {"fwd": 1.0, "fwd+bwd": 1.0 + BACKWARD_FACTOR}


def check_mode(mode) -> str:
    """``mode`` if it is one of :data:`MODES`."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    return mode


def attention_flops(*, batch: int, heads: int, q_len: int, kv_len: int | None = None, head_dim: int,
                    causal: bool = False, mode: str = "fwd") -> float:
    """The standard count: ``4 * batch * heads * q_len * kv_len * head_dim`` (``heads`` = query heads),
    x0.5 when causal, x3.5 for ``"fwd+bwd"``. ``kv_len`` defaults to ``q_len``."""
    kv_len = q_len if kv_len is None else kv_len
    sizes = [positive_int(name, value) for name, value in (
        ("batch", batch), ("heads", heads), ("q_len", q_len), ("kv_len", kv_len), ("head_dim", head_dim))]
    check_mode(mode)
    flops = float(FORWARD_FLOPS_PER_SCORE)
    for size in sizes:
        flops *= size
    if causal:
        flops *= CAUSAL_FACTOR
    return flops * MODE_FACTOR[mode]
