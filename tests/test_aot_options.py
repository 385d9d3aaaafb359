"""tpuattn.parallel's options reach its local kernel on a TPU, compiled for a compile-only v5e slice by
the TPU compiler (not run). On a TPU the local kernel is ``pallas``; ``block_q=`` (the old spelling
the parallel docstring offered) and ``blocks=Blocks(...)`` both reach it as its own ``blocks``, seen in
the traced Pallas grid (``q_len // block_q`` query blocks), and the program compiles. Before, pallas
refused ``block_q`` ("pallas: unknown option(s) ['block_q']").

Needs libtpu; the test command's ``compile`` stage runs it with ``TPUATTN_REQUIRE_TPU_COMPILER=1``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import require_tpu_compiler
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_options import _pallas_grids

from tpuattn import chips, parallel
from tpuattn.errors import TpuattnError
from tpuattn.measure import aot
from tpuattn.options import Blocks

require_tpu_compiler()

SEQ, HEADS, HEAD_DIM = 1024, 4, 128


def _abstract_inputs():
    devices = np.array(aot._topology(chips.get("v5e").topology).devices)
    mesh = Mesh(devices, ("h",))
    sharding = NamedSharding(mesh, P(None, None, "h", None))
    x = jax.ShapeDtypeStruct((1, SEQ, HEADS * len(devices), HEAD_DIM), jnp.bfloat16, sharding=sharding)
    return mesh, x


@pytest.mark.parametrize("impl", ["auto", "pallas"])
@pytest.mark.parametrize("kwargs,block_q", [(dict(block_q=256), 256),
                                            (dict(blocks=Blocks(block_q=128, block_kv=512)), 128)])
def test_parallel_block_sizes_reach_pallas_compiled_for_v5e(impl, kwargs, block_q):
    mesh, x = _abstract_inputs()

    def attend(q, k, v):
        return parallel.attention(q, k, v, mesh=mesh, head_axis="h", impl=impl, causal=True, **kwargs)

    with chips.target("v5e"):
        grids = _pallas_grids(attend, x, x, x)
        compiled = jax.jit(attend).lower(x, x, x).compile()
    assert len(grids) == 1 and grids[0][2] == SEQ // block_q, grids
    assert "tpu_custom_call" in compiled.as_text()  # the Mosaic kernel, compiled


def test_parallel_refuses_a_block_pallas_cannot_tile_before_compiling():
    mesh, x = _abstract_inputs()
    with chips.target("v5e"), pytest.raises(TpuattnError, match=r"^blocks\.block_kv: expected a multiple of "
                                                                  r"128, got 200 \(impl='pallas'"):
        jax.jit(lambda q, k, v: parallel.attention(q, k, v, mesh=mesh, head_axis="h", causal=True,
                                                   block_kv=200)).lower(x, x, x)
