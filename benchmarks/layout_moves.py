"""What moves outside the Pallas kernels, this checkout against another (compiled for v5e, not run).

For MHA (8 query heads on 8 kv heads) and GQA (16 on 2) at 4096 tokens, bf16, head_dim 128, causal,
forward and forward+backward (the gradient of a sum), with arguments shaped as a projection makes them
(``[batch, seq, heads * head_dim]``, reshaped to the contract's shape) or as the contract takes them
(``[batch, seq, heads, head_dim]``), it prints the copies, transposes and reshapes of at least a K/V's
bytes outside the kernels (:func:`tpuattn.measure.aot.data_movement_ops`: count and MiB written), the
compiler's peak HBM and its bytes accessed, side by side with a baseline checkout and as ratios::

    git worktree add /tmp/baseline e84de79
    python benchmarks/layout_moves.py --baseline /tmp/baseline
    python benchmarks/layout_moves.py --baseline /tmp/baseline --head-dim 64   # the copy path

Each side compiles in a child process that imports its own ``tpuattn`` and writes the optimised
program; this checkout's ``data_movement_ops`` reads both, so the two sides are counted alike. Needs
libtpu (the compile-only TPU devices).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parent.parent
SEQ = 4096
HEAD_DIM = int(os.environ.get("TPUATTN_LAYOUT_MOVES_HEAD_DIM", "128"))  # the child's, from --head-dim
PROBLEMS = {"MHA 8/8": (8, 8), "GQA 16/2": (16, 2)}
MODES = ("fwd", "fwd+bwd")
MIB = 2**20


def compile_cases(out: str) -> None:
    """The child: compile every case with the ``tpuattn`` on ``sys.path`` and write the programs."""
    import jax
    import jax.numpy as jnp

    import tpuattn
    from tpuattn.measure import aot

    results = {}
    for name, (q_heads, kv_heads) in PROBLEMS.items():
        for projected in (True, False):
            def attend(q, k, v, projected=projected):
                if not projected:
                    return tpuattn.attention(q, k, v, causal=True, impl="pallas")
                split = lambda x: x.reshape(x.shape[0], SEQ, -1, HEAD_DIM)
                return tpuattn.attention(split(q), split(k), split(v), causal=True,
                                         impl="pallas").reshape(q.shape)

            shape = (lambda h: (1, SEQ, h * HEAD_DIM)) if projected else (lambda h: (1, SEQ, h, HEAD_DIM))
            args = [jax.ShapeDtypeStruct(shape(h), jnp.bfloat16) for h in (q_heads, kv_heads, kv_heads)]
            loss = lambda q, k, v, attend=attend: jnp.sum(attend(q, k, v).astype(jnp.float32))
            for mode in MODES:
                fn = attend if mode == "fwd" else jax.grad(loss, argnums=(0, 1, 2))
                compiled = aot.compile_for("v5e", fn, args)
                facts = aot.compiled_facts(compiled)
                results[f"{name}|{projected}|{mode}"] = {
                    "hlo": compiled.as_text(), "peak": facts["peak_hbm_bytes"],
                    "bytes_accessed": facts["bytes_accessed"]}
    Path(out).write_text(json.dumps(results))


def run_side(checkout: Path) -> dict:
    """Compile every case in a child process that imports ``tpuattn`` from ``checkout``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "programs.json")
        env = {**os.environ, "PYTHONPATH": str(checkout), "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
               "TPUATTN_LAYOUT_MOVES_HEAD_DIM": str(HEAD_DIM)}
        subprocess.run([sys.executable, __file__, "--child", out], check=True, env=env, cwd=tmp)
        return json.loads(Path(out).read_text())


def summary(program: dict) -> dict:
    from tpuattn.measure import aot

    kv_bytes = SEQ * 2 * HEAD_DIM * 2  # the smallest K/V of the cases (2 kv heads, bf16)
    moves = aot.data_movement_ops(program["hlo"], min_bytes=kv_bytes)
    return {"moves": len(moves), "moved": sum(b for *_, b in moves), "peak": program["peak"],
            "bytes": program["bytes_accessed"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path,
                        help="a checkout of the commit to compare with (e.g. a git worktree)")
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128, 256),
                        help="head_dim of every case (64: the kernels' heads-first copy path)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    global HEAD_DIM
    HEAD_DIM = args.head_dim if not args.child else HEAD_DIM
    if args.child:
        compile_cases(args.child)
        return
    if args.baseline is None:
        parser.error("--baseline: expected a checkout to compare with, got none")
    from tpuattn.measure import aot

    if not aot.tpu_available():
        parser.error("libtpu is not installed (the compile-only TPU devices come with it)")
    new, old = run_side(ROOT), run_side(args.baseline.resolve())
    print(f"impl='pallas' compiled for v5e ({aot.LABEL}; {aot.versions_text()}), T={SEQ}, bf16, "
          f"head_dim {HEAD_DIM}, causal; this checkout against {args.baseline}")
    print(f"{'heads':<9} {'arguments':<11} {'mode':<8} {'moves':>11} {'moved MiB':>13} {'peak MiB':>13} "
          f"{'accessed MB':>15} {'peak ratio':>10} {'bytes ratio':>11}")
    for key in new:
        name, projected, mode = key.split("|")
        n, o = summary(new[key]), summary(old[key])
        shape = "projection" if projected == "True" else "contract"
        print(f"{name:<9} {shape:<11} {mode:<8} {o['moves']:>5} -> {n['moves']:<3} "
              f"{o['moved'] / MIB:>5.0f} -> {n['moved'] / MIB:<5.0f} {o['peak'] / MIB:>5.0f} -> "
              f"{n['peak'] / MIB:<5.0f} {o['bytes'] / 1e6:>6.0f} -> {n['bytes'] / 1e6:<6.0f} "
              f"{n['peak'] / o['peak']:>10.2f} {n['bytes'] / o['bytes']:>11.2f}")


if __name__ == "__main__":
    main()
