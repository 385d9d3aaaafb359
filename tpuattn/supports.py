"""Refusal and ranking rules several implementations share (read by their ``supports`` and
``auto_rank``), so that the Pallas kernel, splash and the decode kernels refuse a chip in one voice."""

from __future__ import annotations

import jax.numpy as jnp

from tpuattn import chips


def long_enough_for_flash(spec) -> bool:
    """At least one 128-row query tile and 512 keys: below that a flash kernel pads most of its tile."""
    return spec.q_len >= 128 and spec.kv_len >= 512


def low_precision_matmul_refused(spec, backend: str | None, impl: str) -> str | None:
    """Why a Pallas TPU kernel cannot take ``spec`` on the target chip, or None.

    Mosaic on TPU v2 and v3 (Colab's legacy "TPU v2-8") has no bf16/f16 matmul operands
    ("E2001: CompileTimeMosaicUnsupportedRhsType ... vector<128x128xbf16>"); float32 inputs compile.
    """
    chip = chips.target_chip()
    if (backend or chips.target_backend()) != "tpu" or chip is None or chip.bf16_matmul:
        return None
    if jnp.dtype(spec.dtype) == jnp.float32:
        return None
    return (f"{spec.dtype} on TPU {chip.name}: Mosaic there has no {spec.dtype} matmul operands (the kernel "
            f"would not compile); cast q, k, v to float32 for impl='{impl}', or use impl='xla'")


