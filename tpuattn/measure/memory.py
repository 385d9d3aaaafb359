"""Peak memory measured as a child process's maximum resident set size.

On CPU, ``compiled.memory_analysis()`` under-counts loops and fused code, so the
honest number is what the operating system saw: run one attention call in a
fresh Python process and read ``ru_maxrss``. The child reports the peak before
the call (JAX runtime, inputs) and after it; the difference is what the call
itself needed, compilation included.

Usage from Python::

    peak = measure_peak_memory("blockwise", seq_len=4096, mode="fwd")

or from a shell: ``python -m tpuattn.measure.memory --impl blockwise --seq-len 4096 --mode fwd``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

MODES = ("fwd", "fwd+bwd")


@dataclasses.dataclass(frozen=True)
class PeakMemory:
    impl: str
    seq_len: int
    mode: str
    causal: bool
    baseline_mib: float  # max RSS before compiling and running the call
    peak_mib: float  # max RSS after running it
    ok: bool = True
    error: str = ""

    @property
    def call_mib(self) -> float:
        """Memory the call itself added on top of the runtime and inputs."""
        return max(self.peak_mib - self.baseline_mib, 0.0)


def _max_rss_mib() -> float:
    """Peak resident set of this process's own address space (``VmHWM``), in MiB.

    Not ``ru_maxrss``: Linux carries the parent's peak at fork time into a child's
    ``ru_maxrss`` across ``exec``, so a child started from a large process (a notebook
    kernel that has already run benchmarks) would report at least the parent's size.
    ``VmHWM`` starts afresh with the new address space at ``exec``.
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


def _child(args) -> dict:
    import jax
    import jax.numpy as jnp

    import tpuattn

    options = json.loads(args.options) if args.options else {}
    shape_q = (args.batch, args.seq_len, args.heads, args.head_dim)
    shape_kv = (args.batch, args.seq_len, args.kv_heads or args.heads, args.head_dim)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    dtype = jnp.dtype(args.dtype)
    q = jax.random.normal(keys[0], shape_q, dtype)
    k = jax.random.normal(keys[1], shape_kv, dtype)
    v = jax.random.normal(keys[2], shape_kv, dtype)

    def fwd(q, k, v):
        return tpuattn.attention(q, k, v, causal=args.causal, impl=args.impl, **options)

    if args.mode == "fwd":
        fn = jax.jit(fwd)
    else:
        fn = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fwd(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))
    jax.block_until_ready((q, k, v))
    # Start the high-water mark afresh at the current resident set, so a call smaller than
    # JAX's own start-up peak is still seen (Linux: writing 5 to clear_refs resets VmHWM).
    baseline = _reset_peak() or _max_rss_mib()
    jax.block_until_ready(fn(q, k, v))
    return {"baseline_mib": baseline, "peak_mib": _max_rss_mib()}


def measure_peak_memory(impl: str, seq_len: int, *, mode: str = "fwd", causal: bool = False, batch: int = 1,
                        heads: int = 4, kv_heads: int | None = None, head_dim: int = 64,
                        dtype: str = "float32", options: dict | None = None,
                        timeout: float = 600.0) -> PeakMemory:
    """Run one call in a child process and return its peak memory (see module docstring)."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    cmd = [sys.executable, "-m", "tpuattn.measure.memory", "--impl", impl, "--seq-len", str(seq_len),
           "--mode", mode, "--batch", str(batch), "--heads", str(heads), "--head-dim", str(head_dim),
           "--dtype", dtype]
    if kv_heads:
        cmd += ["--kv-heads", str(kv_heads)]
    if causal:
        cmd.append("--causal")
    if options:
        cmd += ["--options", json.dumps(options)]
    env = dict(os.environ)
    # One device is enough and keeps the runtime's own footprint small and comparable.
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return PeakMemory(impl, seq_len, mode, causal, float("nan"), float("nan"), ok=False, error=last)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return PeakMemory(impl, seq_len, mode, causal, result["baseline_mib"], result["peak_mib"])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--mode", choices=MODES, default="fwd")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=0)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--options", default="")
    args = parser.parse_args(argv)
    print(json.dumps(_child(args)))


if __name__ == "__main__":
    main()
