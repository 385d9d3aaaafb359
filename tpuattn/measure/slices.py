"""Sharded and ring attention compiled for real TPU slices, without a TPU (compiled, not run).

``jax.experimental.topologies`` describes a whole slice (``v5e:2x4``: eight v5e chips; ``v5p:2x2x2``:
eight v5p chips); :func:`slice_row` compiles :func:`tpuattn.parallel.attention` for it with the
sequence sharded over all its chips and reads, from the compiled SPMD program (one per device):

* the memory one device needs (arguments, outputs, temporaries; their sum is its peak HBM);
* the collectives: collective-permutes (the ring's sends), all-gathers and reduce-scatters;
* whether each asynchronous collective overlaps compute: in the compiler's schedule, is there
  work (a fusion, a custom call such as a Pallas kernel, or a conditional) between its ``-start``
  and its ``-done``?

``python -m tpuattn.aot --slices`` writes the rows; ``compiled_slices.json`` next to this module is
the committed table notebook 06 shows, made by the command it records (``--preset notebook``: four
sweeps in one invocation) and checked by ``python -m tpuattn.aot --reproduce``.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from tpuattn.measure.aot import _topology, _versions, compile_failure, memory_facts

REPORT = Path(__file__).with_name("compiled_slices.json")
LABEL = "compiled for a TPU slice (not run)"
COLUMNS = ("topology", "chip", "devices", "strategy", "layout", "mode", "seq_len", "batch", "heads",
           "kv_heads", "head_dim", "dtype", "causal", "status", "error", "argument_bytes", "output_bytes",
           "temp_bytes", "peak_hbm_bytes", "collective_permutes", "all_gathers", "reduce_scatters",
           "async_collectives", "overlapped_collectives", "compile_s", "label", "jax_version",
           "libtpu_version")
# Topologies JAX describes for eight chips, and the chip each is made of.
SLICES = {"v5e:2x4": "v5e", "v5p:2x2x2": "v5p"}

_COMPUTE = re.compile(r"\b(fusion|custom-call|conditional|convolution|dot|while)\(")
# "%name = <type> op(%operand, ...)": the op is the word before the first "(%" or "()".
_DEFINE = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*? ([a-z][\w\-]*)\((?:%|\))")


def collectives(hlo_text: str) -> dict:
    """Counts of the collectives in a compiled (scheduled) HLO module, and how many of the
    asynchronous ones have compute scheduled between their start and their done."""
    counts = {"collective_permutes": 0, "all_gathers": 0, "reduce_scatters": 0, "async_collectives": 0,
              "overlapped_collectives": 0}
    kinds = {"collective-permute": "collective_permutes", "all-gather": "all_gathers",
             "reduce-scatter": "reduce_scatters"}
    for block in re.split(r"\n(?=\S)", hlo_text):  # one computation per block, in schedule order
        lines = block.splitlines()
        open_starts: dict[str, int] = {}
        for index, line in enumerate(lines):
            match = _DEFINE.match(line)
            if not match:
                continue
            name, op = match.groups()
            base = op.removesuffix("-start").removesuffix("-done")
            if base not in kinds or op.endswith("-done"):
                if op.endswith("-done") and base in kinds:
                    start = re.search(r"-done\(%?([\w.\-]+)", line)
                    begin = open_starts.pop(start.group(1), None) if start else None
                    if begin is not None and any(_COMPUTE.search(x) for x in lines[begin + 1:index]):
                        counts["overlapped_collectives"] += 1
                continue
            counts[kinds[base]] += 1
            if op.endswith("-start"):
                counts["async_collectives"] += 1
                open_starts[name] = index
    return counts


def slice_row(topology: str, strategy: str, mode: str, seq_len: int, *, layout: str = "natural",
              batch: int = 1, heads: int = 8, kv_heads: int = 8, head_dim: int = 128, dtype: str = "bfloat16",
              causal: bool = True, impl: str = "auto") -> dict:
    """Compile one sequence-sharded attention for ``topology``; return its row (see :data:`COLUMNS`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpuattn import chips, parallel
    from tpuattn.measure.flops import check_mode

    check_mode(mode)
    chip = chips.get(topology.split(":")[0]).name  # "v5e:2x4" is made of v5e chips
    jax_version, libtpu_version = _versions()
    row = {key: None for key in COLUMNS}
    row.update(topology=topology, chip=chip, strategy=strategy, layout=layout, mode=mode, seq_len=seq_len,
               batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, causal=causal,
               label=LABEL, jax_version=jax_version, libtpu_version=libtpu_version)
    devices = np.array(_topology(topology).devices)
    row["devices"] = len(devices)
    mesh = Mesh(devices, ("seq",))
    sharding = NamedSharding(mesh, P(None, "seq", None, None))
    q = jax.ShapeDtypeStruct((batch, seq_len, heads, head_dim), jnp.dtype(dtype), sharding=sharding)
    kv = jax.ShapeDtypeStruct((batch, seq_len, kv_heads, head_dim), jnp.dtype(dtype), sharding=sharding)

    def attend(q, k, v):
        return parallel.attention(q, k, v, mesh=mesh, seq_axis="seq", strategy=strategy, layout=layout,
                                  causal=causal, impl=impl)

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v).astype(jnp.float32))

    fn = attend if mode == "fwd" else jax.grad(loss, argnums=(0, 1, 2))
    start = time.perf_counter()
    try:
        with chips.target(chip):
            compiled = jax.jit(fn).lower(q, kv, kv).compile()
    except Exception as error:  # noqa: BLE001 - the compiler's own errors have many types
        row.update(compile_failure(error), compile_s=time.perf_counter() - start)
        return row
    row["compile_s"] = time.perf_counter() - start
    row.update(status="ok", **memory_facts(compiled), **collectives(compiled.as_text()))
    return row


def committed() -> dict:
    """The committed slice report (``{"command", "rows", ...}``)."""
    return json.loads(REPORT.read_text())


def table(rows) -> str:
    lines = [f"{'slice':<11} {'strategy':<9} {'layout':<8} {'mode':<8} {'T':>8} {'status':<14} "
             f"{'peak HBM/device GiB':>19} {'permutes':>8} {'gathers':>7} {'async':>5} {'overlap':>7}"
             f"  ({LABEL})"]
    for r in rows:
        peak = f"{r['peak_hbm_bytes'] / 2**30:19.2f}" if r["peak_hbm_bytes"] is not None else f"{'-':>19}"
        counts = "".join(f"{r[k] if r[k] is not None else '-':>{w}} " for k, w in (
            ("collective_permutes", 8), ("all_gathers", 7), ("async_collectives", 5),
            ("overlapped_collectives", 7)))
        lines.append(f"{r['topology']:<11} {r['strategy']:<9} {r['layout']:<8} {r['mode']:<8} "
                     f"{r['seq_len']:>8} {r['status']:<14} {peak} {counts}")
    return "\n".join(lines)


# The committed report (notebook 06's table) in one invocation: ``--preset notebook``. Each sweep is the
# cross product of its lists; the rows come in this order.
PRESETS = {"notebook": (
    dict(topologies=list(SLICES), strategies=["ring"], seq_lens=[32768, 131072, 524288, 1048576]),
    dict(topologies=list(SLICES), strategies=["allgather"], seq_lens=[32768, 131072, 524288, 1048576]),
    dict(topologies=["v5e:2x4"], modes=["fwd+bwd"], seq_lens=[131072]),
    dict(topologies=["v5e:2x2"], seq_lens=[131072]),
)}
SWEEP_DEFAULTS = dict(topologies=list(SLICES), strategies=["ring", "allgather"], layouts=["natural"],
                      modes=["fwd"], seq_lens=[32768], batch=1, heads=8, kv_heads=None, head_dim=128,
                      dtype="bfloat16", causal=True)


def slice_jobs(problems: dict) -> list[tuple]:
    """``(topology, strategy, mode, seq_len, options)`` for every row of ``problems["sweeps"]``, in row
    order (``options``: the keyword arguments of :func:`slice_row`)."""
    jobs = []
    for sweep in problems["sweeps"]:
        sweep = {**SWEEP_DEFAULTS, **sweep}
        options = dict(batch=sweep["batch"], heads=sweep["heads"],
                       kv_heads=sweep["kv_heads"] or sweep["heads"], head_dim=sweep["head_dim"],
                       dtype=sweep["dtype"], causal=sweep["causal"])
        jobs += [(topology, strategy, mode, int(t), dict(options, layout=layout))
                 for topology in sweep["topologies"] for strategy in sweep["strategies"]
                 for layout in sweep["layouts"] for mode in sweep["modes"] for t in sweep["seq_lens"]]
    return jobs


def _parser():
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tpuattn.aot --slices",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--slices", action="store_true", help="(selects this report)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="instead of the options below: a named list of sweeps, all in one report "
                             "(notebook: the committed compiled_slices.json)")
    parser.add_argument("--topologies", default=",".join(SLICES))
    parser.add_argument("--strategies", default="ring,allgather")
    parser.add_argument("--layouts", default="natural")
    parser.add_argument("--modes", default="fwd")
    parser.add_argument("--seq-lens", default="32768")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--causal", choices=("true", "false"), default="true")
    parser.add_argument("--out", default="out/aot")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def parse(argv) -> tuple[dict, object]:
    """``(problems, args)`` of a ``--slices`` command line: ``problems["sweeps"]``, each complete."""
    args = _parser().parse_args(argv)
    if args.preset:
        return {"sweeps": [{**SWEEP_DEFAULTS, **sweep} for sweep in PRESETS[args.preset]]}, args
    split = lambda text: [item for item in text.split(",") if item]
    sweep = dict(topologies=split(args.topologies), strategies=split(args.strategies),
                 layouts=split(args.layouts), modes=split(args.modes),
                 seq_lens=[int(t) for t in split(args.seq_lens)],
                 batch=args.batch, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                 dtype=args.dtype, causal=args.causal == "true")
    return {"sweeps": [sweep]}, args


def main(argv=None) -> list:
    """``python -m tpuattn.aot --slices``: the slice report (see the module docstring); one invocation
    writes one whole report, every sweep of ``--preset`` included."""
    import sys

    from tpuattn.measure.aot import document, save, tpu_available

    argv = sys.argv[1:] if argv is None else list(argv)
    problems, args = parse(argv)
    if not tpu_available():
        _parser().error('libtpu is not installed: pip install "jax[tpu]==<your JAX version>"')
    rows = []
    for topology, strategy, mode, t, options in slice_jobs(problems):
        row = slice_row(topology, strategy, mode, t, **options)
        rows.append(row)
        if not args.no_progress:
            print(f"{topology} {strategy} {options['layout']} {mode} T={t}: {row['status']} "
                  f"{row['compile_s']:.0f} s", flush=True)
    print(table(rows))
    command = ["python", "-m", "tpuattn.aot", *argv]
    print("wrote", *save(document("slices", rows, command=command, problems=problems, label=LABEL),
                         args.out, COLUMNS))
    return rows
