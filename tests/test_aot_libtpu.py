"""Mosaic kernels compiled ahead of time are serialized in a version the installed libtpu reads.

JAX chooses the serialization version from the libtpu build date its backend reports; libtpu 0.0.21.1
(Colab's TPU runtime's) reports a date after JAX 0.7.2's cut-off yet reads only older versions, so
``tpuattn.pallas.compat`` holds lowering to what the installed libtpu says it reads. Runs in the
compile stages and in the colab stage (Colab's published stack, libtpu 0.0.21.1).
"""

from __future__ import annotations

import pytest
from helpers import require_tpu_compiler

require_tpu_compiler()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from tpuattn import chips  # noqa: E402
from tpuattn.measure import aot  # noqa: E402
from tpuattn.pallas import compat  # noqa: E402


def test_the_probe_agrees_with_the_table_of_known_libtpus():
    """What the installed libtpu refuses, asked by compiling a kernel, is what the package's table says
    of that release (None: it reads what JAX writes)."""
    device = aot.topology_device(chips.get("v5e"))
    assert compat.match_installed_libtpu(device) == compat.KNOWN_LIBTPU_READS.get(compat.installed_libtpu())


@pytest.mark.parametrize("chip", ["v4", "v5e", "v5p", "v6e"])
def test_a_kernel_compiles_and_its_facts_are_read(chip):
    """A Pallas kernel compiles for each chip the installed libtpu knows, and the compiled program
    answers what the reports read (memory, cost), with no crash in JAX's layout query afterwards."""
    if not aot.chip_known(chip):
        pytest.skip(f"the installed libtpu does not know {chip}")

    def double(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    tile = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    compiled = aot.compile_for(chip, pl.pallas_call(double, out_shape=tile), [tile])
    assert "tpu_custom_call" in compiled.as_text()
    assert aot.memory_facts(compiled)["output_bytes"] == 8 * 128 * 4
