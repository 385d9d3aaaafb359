"""tpuattn.parallel.attention across two real processes on localhost, against the float64 oracle.

Two copies of tests/multiprocess_worker.py join one JAX job (``jax.distributed.initialize``, the
coordinator on a free local port), each with 4 CPU devices, talking through gloo over TCP: one
mesh of 8 devices spans both, so the ring's permutes and the all-gather cross the process
boundary. Ring and all-gather, with and without segment ids, forward and gradients, are each
checked inside the workers against the oracle on the global arrays (see the worker's docstring).
This test starts them, waits (with a timeout), and asserts both exit 0 having passed every case.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("multiprocess_worker.py")
NUM_PROCESSES = 2
TIMEOUT_S = 540  # both workers together: 40-50 s on 2 idle cores, 70-100 s on 2 busy ones


def _gloo_available() -> bool:
    """Does the installed jaxlib have gloo's TCP collectives (where JAX 0.7.2 and 0.10.2 keep them)?"""
    from jax._src import lib

    homes = (getattr(lib, "_jax", None), getattr(getattr(lib, "xla_client", None), "_xla", None))
    return any(hasattr(home, "make_gloo_tcp_collectives") for home in homes)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_workers(port: int) -> tuple[list[int | None], list[str], float]:
    """Start the workers, wait for both (stopping the other soon after one fails), return their exit
    codes (None: killed, at the timeout or after the other failed), their outputs and the wall time."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    procs: list[subprocess.Popen] = []
    start = time.monotonic()
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile(mode="w+")) for _ in range(NUM_PROCESSES)]
        try:
            for i, log in enumerate(logs):
                command = [sys.executable, str(WORKER), str(i), str(NUM_PROCESSES), str(port)]
                procs.append(subprocess.Popen(command, cwd=WORKER.parent.parent, env=env, stdout=log,
                                              stderr=subprocess.STDOUT))
            deadline = start + TIMEOUT_S
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if any(p.poll() not in (None, 0) for p in procs):
                    # One failed: the other may be waiting for it in a collective; give it a moment.
                    deadline = min(deadline, time.monotonic() + 15)
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
    codes = [p.returncode if p.returncode >= 0 else None for p in procs]
    return codes, outputs, time.monotonic() - start


def test_ring_and_allgather_across_two_processes_equal_the_oracle():
    if not _gloo_available():
        import jaxlib

        pytest.skip(f"jaxlib {jaxlib.__version__} has no gloo CPU collectives (make_gloo_tcp_collectives)")
    for _attempt in range(2):  # a second port if another program took the first before process 0 bound it
        codes, outputs, wall = _run_workers(_free_port())
        if "Failed to start RPC server" not in outputs[0]:
            break
    report = "\n".join(f"----- process {i}: exit {'killed' if code is None else code} after {wall:.0f} s\n"
                       f"{out}" for i, (code, out) in enumerate(zip(codes, outputs, strict=True)))
    assert codes == [0] * NUM_PROCESSES, report
    for i, out in enumerate(outputs):
        # Every case ran and passed (the worker prints how many), none skipped silently.
        assert re.search(rf"^\[process {i}\] (\d+) of \1 cases passed", out, re.MULTILINE), report
    print(f"two processes, {wall:.1f} s:\n" + report)
