"""One of two processes running tpuattn.parallel.attention over one mesh that spans both.

    python tests/multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT

Started by tests/test_multiprocess.py, once per process. Each process has 4 CPU devices; the
processes join through ``jax.distributed.initialize`` (coordinator on ``localhost:PORT``, run by
process 0) and exchange data by gloo over TCP. The mesh holds all 8 devices, so every ring step and
every all-gather crosses the process boundary.

Every process builds the same global inputs from a fixed seed, holds only its own devices' shards
of them (``jax.make_array_from_callback``), runs forward and gradients under ``jax.jit``, gathers
the global results (``multihost_utils.process_allgather``) and checks them against the float64
oracle on the global arrays. Each case prints ``PASS name`` or ``FAIL name`` and its error; all run
even if one fails (both processes run the same program, so they stay in step); the exit status is 0
only if every case passed, and the last line says how many did.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

LOCAL_DEVICES = 4

# The flag the test suite's conftest.py sets for its own process (8 devices) is inherited here: drop
# it, each process has LOCAL_DEVICES (set below with jax_num_cpu_devices).
os.environ["XLA_FLAGS"] = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                   if not f.startswith("--xla_force_host_platform_device_count"))
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from oracle import oracle_attention, oracle_grads  # noqa: E402

# Batch 1, 2 heads (1 kv head in one case: GQA), 64 positions over 8 devices (8 each; zigzag: two
# chunks of 4), head_dim 32, float32.
BATCH, SEQ, HEADS, HEAD_DIM = 1, 64, 2, 32
TOL = 5e-5

# (name, call kwargs, mask kwargs, kv heads): both strategies, with and without segment ids, both
# layouts, causal and not, GQA. One compiled program each (forward and gradients together). The
# local kernel is "reference": it compiles fastest, and the point here is the collectives between
# the processes (tests/test_parallel.py runs every local kernel, on 8 devices of one process). Ring
# with zigzag and segments together is left out: it alone compiles for about a minute on 2 cores.
CASES = [
    ("ring-natural-causal-gqa", dict(strategy="ring"), dict(causal=True), 1),
    ("ring-natural-segments", dict(strategy="ring"), dict(segments=True), 2),
    ("allgather-natural-segments", dict(strategy="allgather"), dict(segments=True), 2),
    ("allgather-zigzag-causal-gqa", dict(strategy="allgather", layout="zigzag"), dict(causal=True), 1),
]
IMPL = "reference"


def _segments() -> np.ndarray:
    """``[BATCH, SEQ]`` runs of ids starting at 0, 13, 30, 37 and 52: every boundary inside a device's
    shard of 8, and the run 30..36 crossing from process 0's devices (0..31) to process 1's."""
    row = np.searchsorted(np.array([13, 30, 37, 52]), np.arange(SEQ), side="right")
    return np.broadcast_to(row, (BATCH, SEQ)).astype(np.int32)


def _global(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """``x`` (identical in every process) as a global array: each process supplies its own shards."""
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def _gather(x: jax.Array) -> np.ndarray:
    """The global value of a sharded array, in every process (a cross-process collective)."""
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def run_case(mesh: Mesh, index: int, name: str, call: dict, mask: dict, kv_heads: int) -> None:
    from tpuattn import parallel

    rng = np.random.default_rng(1000 + index)
    q = rng.standard_normal((BATCH, SEQ, HEADS, HEAD_DIM)).astype(np.float32)
    k, v = (rng.standard_normal((BATCH, SEQ, kv_heads, HEAD_DIM)).astype(np.float32) for _ in range(2))
    d_out = rng.standard_normal(q.shape).astype(np.float32)
    mask = dict(mask)
    segs = _segments() if mask.pop("segments", False) else None
    want = oracle_attention(q, k, v, segment_ids=segs, **mask)
    want_grads = oracle_grads(q, k, v, d_out, segment_ids=segs, **mask)

    n = mesh.shape["s"]
    zig = call.get("layout") == "zigzag"
    to = (lambda x: parallel.to_zigzag(x, n)) if zig else (lambda x: x)
    back = (lambda x: parallel.from_zigzag(x, n)) if zig else (lambda x: x)
    x_sharding = NamedSharding(mesh, P(None, "s", None, None))
    seg_sharding = NamedSharding(mesh, P(None, "s"))
    args = [_global(to(x), x_sharding) for x in (q, k, v, d_out)]
    seg_arg = None if segs is None else _global(to(segs), seg_sharding)
    for a in args:
        assert not a.is_fully_addressable, "the inputs should span both processes"

    def loss(q, k, v, d_out, segment_ids):
        out = parallel.attention(q, k, v, mesh=mesh, seq_axis="s", impl=IMPL, segment_ids=segment_ids,
                                 **call, **mask)
        return jnp.sum(out * d_out), out

    grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (_, out), grads = grad_fn(*args, seg_arg)
    assert out.sharding.is_equivalent_to(x_sharding, out.ndim), f"output sharding {out.sharding}"
    got = back(_gather(out))
    got_grads = [back(_gather(g)) for g in grads]
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL, err_msg="forward")
    for grad_name, g, w in zip(("dq", "dk", "dv"), got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=TOL, rtol=TOL, err_msg=grad_name)


def main(process_id: int, num_processes: int, port: int) -> int:
    start = time.perf_counter()
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    # Spelled the same in JAX 0.7.2 and 0.10.2 (gloo is the default in both; 0.7.2 also accepts the
    # deprecated jax_cpu_enable_gloo_collectives).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=num_processes,
                               process_id=process_id, initialization_timeout=60)
    prefix = f"[process {process_id}]"
    print(f"{prefix} jax {jax.__version__}: {jax.process_count()} processes, {jax.device_count()} devices, "
          f"{jax.local_device_count()} local", flush=True)
    assert jax.process_count() == num_processes, jax.process_count()
    assert jax.local_device_count() == LOCAL_DEVICES, jax.local_devices()
    assert jax.device_count() == LOCAL_DEVICES * num_processes, jax.devices()
    # Process 0's devices first, then process 1's: the sequence's first half lives in process 0.
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices), ("s",))

    failed = []
    for index, (name, call, mask, kv_heads) in enumerate(CASES):
        t = time.perf_counter()
        try:
            run_case(mesh, index, name, call, mask, kv_heads)
            print(f"{prefix} PASS {name} ({time.perf_counter() - t:.1f} s)", flush=True)
        except Exception:
            failed.append(name)
            print(f"{prefix} FAIL {name}\n{traceback.format_exc()}", flush=True)
    print(f"{prefix} {len(CASES) - len(failed)} of {len(CASES)} cases passed "
          f"({time.perf_counter() - start:.1f} s)", flush=True)
    jax.distributed.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:4])))
