"""The target chip is part of what JAX caches: running a function on the CPU and compiling the same
function for a TPU, in either order and in one process, gives the CPU run the interpret-mode program
and the TPU compile the Mosaic kernel (compiled, not run).

Each order runs in a fresh interpreter (``subprocess``): the bug this guards against is a cache hit
left behind by the first trace, so the two orders must not share one process's caches. Needs libtpu
(the test command's compile stages).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from helpers import require_tpu_compiler

require_tpu_compiler()

TESTS = os.path.dirname(os.path.abspath(__file__))

# One process: build inputs, then run on the CPU and compile for v5e in the given order. The CPU result
# is compared with the float64 oracle (tests/oracle.py); the compiled program is searched for the
# Mosaic custom call and for the interpret-mode loop's signature (a while loop over the grid).
SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import jax, jax.numpy as jnp
    sys.path.insert(0, {tests!r})
    import oracle
    import tpuattn
    from tpuattn.measure import aot

    order = {order!r}
    shape = (1, 256, 2, 128)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    f = jax.jit(lambda q, k, v: tpuattn.attention(q, k, v, causal=True, impl="pallas"))
    grad = jax.jit(jax.grad(lambda q, k, v: tpuattn.attention(q, k, v, causal=True, impl="pallas").sum(),
                            argnums=(0, 1, 2)))
    shapes = [jax.ShapeDtypeStruct(shape, jnp.float32)] * 3
    result = {{}}

    def run_cpu():
        out = np.asarray(f(q, k, v), np.float64)
        wide = [x.astype(np.float64) for x in (q, k, v)]
        result["cpu_error"] = float(np.max(np.abs(out - oracle.oracle_attention(*wide, causal=True))))
        want = oracle.oracle_grads(*wide, np.ones(shape), causal=True)
        result["cpu_grad_error"] = max(float(np.max(np.abs(np.asarray(g, np.float64) - w)))
                                       for g, w in zip(grad(q, k, v), want))

    def compile_tpu():
        for name, fn in (("fwd", f), ("grad", grad)):
            text = aot.compile_for("v5e", fn, shapes).as_text()
            result[name + "_mosaic"] = text.count('custom_call_target="tpu_custom_call"')
            result[name + "_has_while"] = " while(" in text

    for step in ((run_cpu, compile_tpu) if order == "cpu-first" else (compile_tpu, run_cpu)):
        step()
    print("RESULT " + json.dumps(result))
""")


@pytest.mark.parametrize("order", ["cpu-first", "tpu-first"])
def test_cpu_run_and_tpu_compile_do_not_share_a_trace(order):
    script = SCRIPT.format(tests=TESTS, order=order)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    # The v5e program is the Mosaic kernel: one custom call forward, three more for the backward
    # (row sums, dQ, dK/dV), and no interpret-mode loop over the grid.
    assert result["fwd_mosaic"] >= 1 and not result["fwd_has_while"], result
    assert result["grad_mosaic"] >= 3 and not result["grad_has_while"], result
    # The CPU run is the interpret-mode program and agrees with the float64 oracle (float32 inputs).
    assert result["cpu_error"] < 2e-5, result
    assert result["cpu_grad_error"] < 1e-4, result
