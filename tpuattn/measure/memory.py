"""Peak memory of one call, measured in a fresh child process.

On CPU, ``compiled.memory_analysis()`` under-counts loops and fused code, so the honest number is
what the operating system saw: run the call (:mod:`tpuattn.measure.workload`) in a fresh Python
process and read its high-water mark. The child reports the peak before the call (JAX runtime,
inputs) and after it; the difference is what the call itself needed, compilation included.

On an accelerator the host's resident set says nothing about the device: there the child reads the
device's own allocator statistics (``jax.Device.memory_stats()["peak_bytes_in_use"]``, HBM on a
TPU) before and after the call. :attr:`PeakMemory.method` says which was measured.

From Python::

    peak = measure_peak_memory("blockwise", 4096, mode="fwd")

or from a shell: ``python -m tpuattn.measure.memory --impl blockwise --seq-len 4096 --mode fwd``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

from tpuattn.measure.flops import MODES, check_mode
from tpuattn.measure.workload import Shape


@dataclasses.dataclass(frozen=True)
class PeakMemory:
    impl: str
    seq_len: int
    mode: str
    causal: bool
    baseline_mib: float  # peak RSS before compiling and running the call
    peak_mib: float  # peak RSS after running it
    ok: bool = True
    error: str = ""
    method: str = "child process peak RSS (host memory)"

    @property
    def call_mib(self) -> float:
        """Memory the call itself added on top of the runtime and inputs."""
        return max(self.peak_mib - self.baseline_mib, 0.0)


def _max_rss_mib() -> float:
    """Peak resident set of this process's own address space (``VmHWM``), in MiB.

    Not ``ru_maxrss``: Linux carries the parent's peak at fork time into a child's ``ru_maxrss``
    across ``exec``, so a child started from a large process (a notebook kernel that has already
    run benchmarks) would report at least the parent's size. ``VmHWM`` starts afresh at ``exec``.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0  # kB
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # kB on Linux


def _reset_peak() -> float | None:
    """Reset this process's ``VmHWM`` to its current ``VmRSS``; return that RSS in MiB (None: unsupported)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def _child(impl: str, shape: Shape, mode: str, options: dict) -> dict:
    import jax

    from tpuattn.measure.workload import function, inputs

    q, k, v = inputs(shape)
    fn = jax.jit(function(impl, shape, mode, options))
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "peak_bytes_in_use" in stats:  # an accelerator: its own allocator's peak
        jax.block_until_ready((q, k, v))
        baseline = device.memory_stats()["peak_bytes_in_use"] / 2**20
        jax.block_until_ready(fn(q, k, v))
        return {"baseline_mib": baseline, "peak_mib": device.memory_stats()["peak_bytes_in_use"] / 2**20,
                "method": f"device peak_bytes_in_use ({device.device_kind} memory)"}
    # Start the high-water mark afresh at the current resident set, so a call smaller than
    # JAX's own start-up peak is still seen (Linux: writing 5 to clear_refs resets VmHWM).
    baseline = _reset_peak() or _max_rss_mib()
    jax.block_until_ready(fn(q, k, v))
    return {"baseline_mib": baseline, "peak_mib": _max_rss_mib(), "method": PeakMemory.method}


def measure_shape(impl: str, shape: Shape, mode: str = "fwd", options: dict | None = None,
                  timeout: float = 600.0) -> PeakMemory:
    """Run one call of ``impl`` on ``shape`` in a child process; return its peak memory."""
    check_mode(mode)
    cmd = [sys.executable, "-m", "tpuattn.measure.memory", "--impl", impl, "--seq-len", str(shape.seq_len),
           "--kv-len", str(shape.kv_len), "--mode", mode, "--batch", str(shape.batch),
           "--heads", str(shape.heads), "--kv-heads", str(shape.kv_heads), "--head-dim", str(shape.head_dim),
           "--dtype", shape.dtype]
    if shape.causal:
        cmd.append("--causal")
    if options:
        cmd += ["--options", json.dumps(options)]
    env = dict(os.environ)
    # One device is enough and keeps the runtime's own footprint small and comparable.
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return PeakMemory(impl, shape.seq_len, mode, shape.causal, float("nan"), float("nan"), ok=False,
                          error=last)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return PeakMemory(impl, shape.seq_len, mode, shape.causal, result["baseline_mib"], result["peak_mib"],
                      method=result["method"])


def measure_peak_memory(impl: str, seq_len: int, *, mode: str = "fwd", causal: bool = False, batch: int = 1,
                        heads: int = 4, kv_heads: int | None = None, head_dim: int = 64,
                        dtype: str = "float32", kv_len: int | None = None, options: dict | None = None,
                        timeout: float = 600.0) -> PeakMemory:
    """:func:`measure_shape` for the :class:`~tpuattn.measure.workload.Shape` these sizes describe."""
    shape = Shape(seq_len=seq_len, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                  dtype=dtype, causal=causal, kv_len=kv_len)
    return measure_shape(impl, shape, mode, options, timeout)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--kv-len", type=int, default=None, help="default: --seq-len")
    parser.add_argument("--mode", choices=MODES, default="fwd")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--options", default="", help="JSON options for the implementation")
    args = parser.parse_args(argv)
    shape = Shape(seq_len=args.seq_len, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
                  head_dim=args.head_dim, dtype=args.dtype, causal=args.causal, kv_len=args.kv_len)
    options = json.loads(args.options) if args.options else {}
    print(json.dumps(_child(args.impl, shape, args.mode, options)))


if __name__ == "__main__":
    main()
