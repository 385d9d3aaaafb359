"""Attention timings measured on real TPUs and published, with their configurations.

The roofline (:mod:`tpuattn.model.roofline`) is a lower bound: for the same work on the same chip it
must never predict slower than any of these (``tests/test_roofline.py`` holds it to that), and no
constant of the model was fitted to them. Notebook 05 reads them against the roofline. ``impl``
names the registered implementation whose schedule the measured program runs (JAX's splash kernel
is ``splash``; JAX's Pallas flash kernel and axlearn's run the same flash schedule, modelled with
splash's record at the blocks they ran; plain XLA attention is the materialised schedule of
``reference``).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    label: str  # short, for tables
    source: str  # where it was published
    chip: str
    impl: str
    batch: int
    heads: int
    seq_len: int
    head_dim: int
    dtype: str
    causal: bool
    mode: str
    block: int | None  # block size (flash schedules); None: materialised
    precision: str  # matmul precision the run used ("highest", or JAX's "default")
    seconds: float


_MARIN = "marin-community/marin .agents/logbooks/splash-prefixlm-block-skipping.md"
_AXLEARN = "apple/axlearn axlearn/common/flash_attention/tpu_attention_benchmark.py (261.7b layer)"
_JAX_ISSUE = "jax-ml/jax#24633 (Pallas flash_attention, default 128 blocks; B=32, H=8, D=64)"
_WRITE_UP = ("Forcing Flash Attention onto a TPU and Learning the Hard Way (2026; quoted from its "
             "translation, ahastudio/til ai/flash-attention-on-tpu.md): plain jitted softmax(QK^T)V, float32 "
             "at JAX's default precision, one head of 64, Colab v5e; causal not stated, and the "
             "materialised schedule computes every score either way")

RUNS = (
    PublishedRun("marin splash logbook", _MARIN + " (v4-8, block 512)", "v4", "splash", 1, 8, 8192, 128,
                 "bfloat16", True, "fwd", 512, "highest", 1.837e-3),
    PublishedRun("marin splash logbook", _MARIN + " (v4-8, 16384 tokens)", "v4", "splash", 1, 8, 16384, 128,
                 "bfloat16", True, "fwd", 512, "highest", 5.809e-3),
    PublishedRun("marin splash logbook", _MARIN + " (v5p-8)", "v5p", "splash", 1, 8, 8192, 128, "bfloat16",
                 True, "fwd", 512, "highest", 1.204e-3),
    PublishedRun("marin splash logbook", _MARIN + " (v5p-8, 16384 tokens)", "v5p", "splash", 1, 8, 16384,
                 128, "bfloat16", True, "fwd", 512, "highest", 3.297e-3),
    PublishedRun("marin PR #6330", "marin-community/marin PR #6330: 20 stacked layers, per layer", "v5p",
                 "splash", 1, 8, 8192, 128, "bfloat16", True, "fwd", 512, "highest", 0.778e-3),
    PublishedRun("axlearn benchmark", _AXLEARN + ", v4, flash", "v4", "splash", 2, 110, 2048, 128, "bfloat16",
                 True, "fwd", 512, "highest", 3.5e-3),
    PublishedRun("axlearn benchmark", _AXLEARN + ", forward + backward", "v4", "splash", 2, 110, 2048, 128,
                 "bfloat16", True, "fwd+bwd", 512, "highest", 18.2e-3),
    PublishedRun("axlearn benchmark", _AXLEARN + ", XLA reference (mha_reference)", "v4", "reference", 2,
                 110, 2048, 128, "bfloat16", True, "fwd", None, "highest", 10.5e-3),
    PublishedRun("jax-ml/jax#24633", _JAX_ISSUE + ", v5e", "v5e", "splash", 32, 8, 4096, 64, "bfloat16",
                 False, "fwd", 128, "highest", 144.97e-3),
    PublishedRun("jax-ml/jax#24633", _JAX_ISSUE + ", float32 on a TPU v2-8 (one device is one TensorCore)",
                 "v2", "splash", 32, 8, 4096, 64, "float32", False, "fwd", 128, "highest", 326.28e-3),
    PublishedRun("Zhang 2026", _WRITE_UP + " (4096 tokens)", "v5e", "reference", 1, 1, 4096, 64, "float32",
                 False, "fwd", None, "default", 0.072e-3),
    PublishedRun("Zhang 2026", _WRITE_UP + " (16384 tokens)", "v5e", "reference", 1, 1, 16384, 64, "float32",
                 False, "fwd", None, "default", 4.445e-3),
)


def bf16_runs() -> tuple[PublishedRun, ...]:
    """The runs drawn on bf16 rooflines (every chip but v2, whose run is float32)."""
    return tuple(r for r in RUNS if r.chip != "v2")
