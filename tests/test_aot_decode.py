"""tpuattn.decode through the real TPU compiler for v5e and v6e, without a TPU (compiled, not run).

Run with ``JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1`` (as the CI's compile stage does). Each
implementation must compile what it claims to support (status ``ok``) or refuse in words
(``unsupported``); peak HBM is printed (``-s``). The decode roofline's bytes (a lower bound: K and V of
every position plus q and the output) must not exceed what the compiler counts.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest

from tpuattn import decode
from tpuattn.errors import UnsupportedInput
from tpuattn.measure import aot
from tpuattn.model import decode as roofline

if not aot.tpu_available():
    if os.environ.get("TPUATTN_REQUIRE_TPU_COMPILER"):
        raise RuntimeError('libtpu is not installed: the compile stage needs pip install "jax[tpu]"')
    pytest.skip("libtpu not installed", allow_module_level=True)

CHIPS = ("v5e", "v6e")
IMPLS = decode.known_implementations()
# A serving-like shape kept small enough to compile in seconds: 8 sequences of up to 1024 positions,
# 32 query heads on 8 kv heads (group 4), head_dim 128, bf16, pages of 64 rows.
BATCH, HEADS, KV_HEADS, HEAD_DIM, PAGE, PAGES_PER_SEQ = 8, 32, 8, 128, 64, 16
CAPACITY = PAGE * PAGES_PER_SEQ
SHAPES = {"paged-tq1": (True, 1), "paged-tq4": (True, 4), "contiguous-tq1": (False, 1)}
# JAX 0.10.2 lowers the ``sign`` inside ragged_paged_attention's kernel by asking the *local* device for
# its TPU generation (jax/_src/pallas/mosaic/lowering.py, _sign_lowering_rule -> tpu_info.get_tpu_info()),
# so it cannot be compiled for a TPU from a CPU machine; it is refused off a TPU for running too.
NEEDS_LOCAL_TPU = {"jax_ragged": "Unsupported TPU device kind"}


def _args(paged: bool, q_len: int, dtype=jnp.bfloat16):
    q = jax.ShapeDtypeStruct((BATCH, q_len, HEADS, HEAD_DIM), dtype)
    lengths = jax.ShapeDtypeStruct((BATCH,), jnp.int32)
    if paged:
        cache = jax.ShapeDtypeStruct((BATCH * PAGES_PER_SEQ, PAGE, KV_HEADS, HEAD_DIM), dtype)
        return [q, cache, cache, lengths, jax.ShapeDtypeStruct((BATCH, PAGES_PER_SEQ), jnp.int32)]
    cache = jax.ShapeDtypeStruct((BATCH, CAPACITY, KV_HEADS, HEAD_DIM), dtype)
    return [q, cache, cache, lengths]


def compile_row(chip: str, impl: str, paged: bool, q_len: int) -> dict:
    """Compile one implementation for one chip: a row with status, peak HBM and the compiler's bytes."""
    def fn(q, k, v, lengths, table=None):
        return decode.attention(q, k, v, lengths, page_table=table, impl=impl)

    row = dict(chip=chip, impl=impl, paged=paged, q_len=q_len, label=aot.LABEL)
    try:
        facts = aot.compiled_facts(aot.compile_for(chip, fn, _args(paged, q_len)))
    except UnsupportedInput as error:
        return {**row, "status": "unsupported", "error": str(error)}
    except Exception as error:  # noqa: BLE001 - the compiler's errors vary by version
        return {**row, "status": "compile_error", "error": aot.first_error_line(error)}
    return {**row, "status": "ok", "error": None, **facts}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("chip", CHIPS)
def test_every_implementation_compiles(chip, impl, shape):
    paged, q_len = SHAPES[shape]
    row = compile_row(chip, impl, paged, q_len)
    if impl in NEEDS_LOCAL_TPU and row["status"] == "compile_error":
        assert NEEDS_LOCAL_TPU[impl] in row["error"], row["error"]
        pytest.xfail(f"{impl}: JAX's lowering needs a local TPU ({row['error'][:120]})")
    assert row["status"] in ("ok", "unsupported"), row["error"]
    if impl in ("reference", "pallas"):
        assert row["status"] == "ok", row["error"]
    if row["status"] == "unsupported":
        assert "does not support this input" in row["error"]
        return
    if impl == "pallas":
        assert row["custom_calls"] >= 1  # a Mosaic kernel, not interpret mode
    model = roofline.decode_roofline([CAPACITY] * BATCH, q_len=q_len, heads=HEADS, kv_heads=KV_HEADS,
                                     head_dim=HEAD_DIM, chip=chip,
                                     pages_per_sequence=PAGES_PER_SEQ if paged else 0)
    # The compiler cannot know the lengths: its argument bytes hold the whole cache, the model's lower
    # bound the cache of full sequences (equal up to q and the output), and its bytes accessed more.
    assert model.bytes - model.io_bytes <= row["argument_bytes"], (model.bytes, row["argument_bytes"])
    assert model.bytes <= row["bytes_accessed"], (model.bytes, row["bytes_accessed"])
    print(f"\n{chip} {impl} {shape}: peak HBM {row['peak_hbm_bytes'] / 2**20:.1f} MiB, compiler bytes "
          f"accessed {row['bytes_accessed'] / 2**20:.1f} MiB, modelled bytes {model.bytes / 2**20:.1f} MiB "
          f"({aot.LABEL}; model {roofline.LABEL})")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pallas_compiles_every_option_with_all_kv_heads_in_a_block(dtype):
    # head_dim 64 (not a lane multiple): one block holds every kv head and the kernel loops over them;
    # q_len 2, a window and a soft-cap on top.
    def fn(q, k, v, lengths, table):
        return decode.attention(q, k, v, lengths, page_table=table, impl="pallas", window=40, softcap=20.0)

    cache = jax.ShapeDtypeStruct((32, 32, 2, 64), dtype)
    args = [jax.ShapeDtypeStruct((4, 2, 8, 64), dtype), cache, cache,
            jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((4, 8), jnp.int32)]
    for chip in CHIPS:
        facts = aot.compiled_facts(aot.compile_for(chip, fn, args))
        assert facts["custom_calls"] >= 1 and facts["peak_hbm_bytes"] > 0
