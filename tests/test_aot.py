"""Every implementation through the real TPU compiler, for every chip (compiled, not run).

Needs libtpu (``pip install "jax[tpu]==<version>"``); the test command's ``compile`` stage runs this
file in ``.venv-tpu-compile`` with ``TPUATTN_REQUIRE_TPU_COMPILER=1``, where a missing libtpu fails
instead of skipping. An implementation must compile whatever it claims to support: a row may be
``unsupported`` (a clear refusal), never ``compile_error``.
"""

from __future__ import annotations

import os

import pytest

from tpuattn import chips
from tpuattn.measure import aot

if not aot.tpu_available():
    if os.environ.get("TPUATTN_REQUIRE_TPU_COMPILER"):
        raise RuntimeError('libtpu is not installed: the compile stage needs pip install "jax[tpu]"')
    pytest.skip("libtpu not installed (the test command's compile stage installs it)",
                allow_module_level=True)

IMPLS = ("reference", "xla", "blockwise", "pallas", "splash")
MODES = ("fwd", "fwd+bwd")

# One configuration on every chip (bf16, causal, GQA, a length that is not a block multiple) ...
EVERY_CHIP = aot.Problem(seq_len=200, heads=4, kv_heads=2, head_dim=128, dtype="bfloat16")
# ... and the contract's options on one chip per VMEM size (v5e: 128 MiB, v4: 16 MiB).
OPTIONS = {
    "f32-window": aot.Problem(seq_len=256, heads=2, head_dim=128, dtype="float32", causal=False,
                              window=(64, 16)),
    "bf16-segments-softcap": aot.Problem(seq_len=256, heads=2, head_dim=128, softcap=30.0, segments=True),
    "bf16-d64-mqa": aot.Problem(seq_len=384, heads=4, kv_heads=1, head_dim=64),
    "bf16-d256": aot.Problem(seq_len=256, heads=2, head_dim=256),
    "f32-d256-qlen<kvlen": aot.Problem(seq_len=128, kv_len=300, heads=2, head_dim=256, dtype="float32"),
}


def _check(row):
    where = f"{row['chip']} {row['impl']} {row['mode']}"
    assert row["status"] in ("ok", "unsupported"), f"{where}: {row['error']}"
    if row["status"] == "ok":
        assert row["label"] == aot.LABEL and row["peak_hbm_bytes"] > 0 and row["compile_s"] > 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("chip", chips.NAMES)
def test_every_implementation_compiles_for_every_chip(chip, impl, mode):
    row = aot.compile_row(chip, impl, mode, EVERY_CHIP)
    _check(row)
    if impl in ("reference", "xla", "blockwise"):  # plain XLA: every chip takes it
        assert row["status"] == "ok", row["error"]
    if impl in ("pallas", "splash") and not chips.get(chip).bf16_matmul:
        # Colab's legacy TPU v2-8: Mosaic has no bf16 matmul there. Refused, in words.
        assert row["status"] == "unsupported" and "cast q, k, v to float32" in row["error"]


@pytest.mark.parametrize("name", sorted(OPTIONS))
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("chip", ["v5e", "v4"])
def test_contract_options_compile(chip, impl, name):
    _check(aot.compile_row(chip, impl, "fwd+bwd", OPTIONS[name]))


def test_float32_serves_the_kernels_on_v2():
    for impl in ("pallas", "splash"):
        row = aot.compile_row("v2", impl, "fwd", aot.Problem(seq_len=256, heads=2, dtype="float32"))
        assert row["status"] == "ok", row["error"]
        assert row["custom_calls"] >= 1  # a Mosaic kernel, not interpret mode
