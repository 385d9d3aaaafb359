"""Block sizes tuned by the compiler: the package's Pallas kernel compiled at a few candidate blocks per
chip and problem class, each program estimated from libtpu's final bundles
(:mod:`tpuattn.measure.estimate`, **compiled (static estimate, not run)**), the fastest kept.

A problem class is a sequence length (2K, 8K, 32K tokens), bfloat16, head_dim 128, causal, 8 heads.
The forward's blocks are chosen on the forward alone (``fwd``); the backward's on the forward and
backward together (``fwd+bwd``) with the forward at the blocks just chosen, so the two sweeps add
rather than multiply. A candidate is tried only where it is legal for the chip (:func:`fits`: accepted
by the compiler's block table, ``compiled_blocks.json``, where that has the chip's rows, else within the
VMEM model's budget of :mod:`tpuattn.pallas.blocks`). Where the estimator reads a kernel's masked and
unmasked branches as two computing branches, :func:`tpuattn.measure.estimate.split_branches` weighs them
apart (the bundle reading lives in :mod:`tpuattn.measure.estimate`).

``python -m tpuattn.aot --tune --chips v5e,v6e,v5p [--seq-lens 2048,8192,32768] [--candidates ...]``
writes ``tuned_blocks.json`` (the rows, the command, the date and the versions that made it, as every
report file does); ``python -m tpuattn.aot --tune --reproduce FILE`` compiles the file's problems again
and diffs the chosen blocks (exit status 1 on a difference). :func:`tpuattn.pallas.blocks.default_block_sizes`
takes its defaults from ``tpuattn/pallas/tuned_blocks.json`` where that file has the chip's entry.

The package kernel against splash (:func:`compare_row`) is estimated the same way (benchmarks/vs_splash.py).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

from tpuattn.measure import estimate
from tpuattn.measure.estimate import EveryKernel as _every_kernel
from tpuattn.measure.estimate import split_branches  # noqa: F401 - read here, kept in estimate

LABEL = estimate.LABEL
SEQ_LENS = (2048, 8192, 32768)
# (block_q, block_kv) tried for each pass: few, since every one is a compile (seconds each on a
# shared machine): square blocks from 256 to 1024.
CANDIDATES = ((256, 256), (512, 512), (1024, 1024))
CLASS = dict(batch=1, heads=8, kv_heads=8, head_dim=128, dtype="bfloat16", causal=True)
TUNED = Path(__file__).resolve().parents[1] / "pallas" / "tuned_blocks.json"
WHAT = ("The Pallas kernel's blocks chosen per chip and sequence length by the compiled static estimate "
        "(compiled (static estimate, not run))")

PALLAS_CODE = """
import jax, jax.numpy as jnp
import tpuattn
from tpuattn.options import Blocks
blocks = Blocks(block_q={block_q}, block_kv={block_kv}, backward_block_q={backward_block_q},
                backward_block_kv={backward_block_kv})
def attend(q, k, v):
    return tpuattn.attention(q, k, v, causal={causal}, impl="pallas", blocks=blocks)
def FN(q, k, v):
    if {backward}:
        loss = lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    return attend(q, k, v)
ARGS = [jax.ShapeDtypeStruct(({batch}, {seq_len}, {heads}, {head_dim}), jnp.{dtype}),
        jax.ShapeDtypeStruct(({batch}, {seq_len}, {kv_heads}, {head_dim}), jnp.{dtype}),
        jax.ShapeDtypeStruct(({batch}, {seq_len}, {kv_heads}, {head_dim}), jnp.{dtype})]
"""

# splash with its heads-first arguments and GQA through its MQA kernel per kv head group.
SPLASH_GQA_CODE = """
import jax, jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as sa
group = {heads} // {kv_heads}
mask = sa.MultiHeadMask([sa.CausalMask(({seq_len}, {seq_len}))] * group)
blocks = sa.BlockSizes(block_q={block}, block_kv={block}, block_kv_compute={block},
                       block_q_dkv={block}, block_kv_dkv={block}, block_kv_dkv_compute={block},
                       block_q_dq={block}, block_kv_dq={block})
kernel = sa.make_splash_mqa_single_device(mask, block_sizes=blocks)
def attend(q, k, v):
    q = q.reshape(q.shape[0], {kv_heads}, group, *q.shape[2:])
    out = jax.vmap(jax.vmap(kernel))(q, k, v)
    return out.reshape(out.shape[0], {heads}, *out.shape[3:])
def FN(q, k, v):
    if {backward}:
        loss = lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    return attend(q, k, v)
ARGS = [jax.ShapeDtypeStruct(({batch}, {heads}, {seq_len}, {head_dim}), jnp.{dtype}),
        jax.ShapeDtypeStruct(({batch}, {kv_heads}, {seq_len}, {head_dim}), jnp.{dtype}),
        jax.ShapeDtypeStruct(({batch}, {kv_heads}, {seq_len}, {head_dim}), jnp.{dtype})]
"""

TOKAMAX_CODE = """
import jax, jax.numpy as jnp
import tpuattn
def attend(q, k, v):
    return tpuattn.attention(q, k, v, causal={causal}, impl="tokamax")
def FN(q, k, v):
    if {backward}:
        loss = lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    return attend(q, k, v)
ARGS = [jax.ShapeDtypeStruct(({batch}, {seq_len}, {heads}, {head_dim}), jnp.{dtype}),
        jax.ShapeDtypeStruct(({batch}, {seq_len}, {kv_heads}, {head_dim}), jnp.{dtype}),
        jax.ShapeDtypeStruct(({batch}, {seq_len}, {kv_heads}, {head_dim}), jnp.{dtype})]
"""

PALLAS_KERNELS = ("tpuattn_flash_forward", "tpuattn_flash_row_sums", "tpuattn_flash_dq", "tpuattn_flash_dkv")


def grid_weights(seq_len: int, block_q: int, block_kv: int, causal: bool = True, *,
                 transposed: bool = False) -> estimate.Weights:
    """The package kernel's grid shares (:class:`~tpuattn.measure.estimate.Weights`): its grid steps
    over the outer blocks and, per outer block, as many steps as the row with the most visible tiles
    (:func:`tpuattn.pallas.plan.schedule`), so a causal grid of ``n`` query blocks takes ``n`` steps
    per row and computes on the visible ones. ``transposed``: the dK/dV grid (kv blocks outer)."""
    from tpuattn import spec as spec_module

    mask = spec_module.spec_from_shapes(seq_len, seq_len, causal=causal).mask
    codes = mask.block_map(block_q, block_kv)
    codes = codes.T if transposed else codes
    visible = codes != spec_module.EMPTY
    steps = max(1, int(visible.sum(axis=1).max()))
    total = codes.shape[0] * steps
    return estimate.Weights(compute=int(visible.sum()) / total,
                            partial=int((codes == spec_module.PARTIAL).sum()) / total, edge=1 / steps)


def pallas_weights(seq_len: int, blocks: dict, causal: bool = True) -> dict:
    """The weights of each of the package's kernels by name, at these blocks (clamped to the length)."""
    fq, fk = (min(blocks[n], seq_len) for n in ("block_q", "block_kv"))
    bq, bk = (min(blocks[n], seq_len) for n in ("backward_block_q", "backward_block_kv"))
    backward = grid_weights(seq_len, bq, bk, causal)
    return {"tpuattn_flash_forward": grid_weights(seq_len, fq, fk, causal),
            "tpuattn_flash_row_sums": backward, "tpuattn_flash_dq": backward,
            "tpuattn_flash_dkv": grid_weights(seq_len, bq, bk, causal, transposed=True)}


def pallas_code(seq_len: int, mode: str, blocks: dict, **problem) -> str:
    shape = dict(CLASS) | problem
    return PALLAS_CODE.format(seq_len=seq_len, backward=mode == "fwd+bwd", **blocks, **shape)


def fits(chip: str, kernel: str, block_q: int, block_kv: int, head_dim: int = 128,
         dtype: str = "bfloat16") -> bool:
    """Whether the blocks are legal for the chip: accepted by the compiler's committed table where it has
    the chip's rows, else within the VMEM model's budget (:mod:`tpuattn.pallas.blocks`)."""
    import jax.numpy as jnp

    from tpuattn import chips
    from tpuattn.pallas import blocks as pallas_blocks

    accepted = pallas_blocks.compiled_pairs(chip, kernel, head_dim, dtype)
    if accepted:
        return (block_q, block_kv) in accepted
    need = (pallas_blocks.forward_vmem_bytes if kernel == "forward" else pallas_blocks.backward_vmem_bytes)
    budget = pallas_blocks.vmem_budget_bytes(chips.get(chip).vmem_bytes)
    return need(block_q, block_kv, head_dim, jnp.dtype(dtype).itemsize) <= budget


def estimate_pallas(chip: str, seq_len: int, mode: str, blocks: dict, **problem) -> dict:
    """One candidate's row: the program compiled and estimated, or why not."""
    started = time.perf_counter()
    row = dict(chip=chip, seq_len=seq_len, mode=mode, **blocks, seconds=None, error=None)
    try:
        weights = pallas_weights(seq_len, blocks, (dict(CLASS) | problem)["causal"])
        result, counts = _estimate_with_counts(pallas_code(seq_len, mode, blocks, **problem), chip, weights)
        row["seconds"] = result.seconds
        row["kernels"] = _by_kernel(result)
        row["static"] = counts
    except Exception as error:  # noqa: BLE001 - a candidate that does not compile is a row with its reason
        row["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:200]}"
    row["compile_s"] = round(time.perf_counter() - started, 1)
    row["label"] = LABEL
    return row


def _estimate_with_counts(code: str, chip: str, weights) -> tuple[estimate.Estimate, dict]:
    """:func:`tpuattn.measure.estimate.estimate_with_counts`; the package's kernels (a dict of weights by
    kernel) with their branches weighed apart where the estimator read two computing branches
    (:func:`split_branches`)."""
    split = PALLAS_KERNELS if isinstance(weights, dict) and not isinstance(weights, _every_kernel) else None
    return estimate.estimate_with_counts(code, chip, weights, split=split)


def _by_kernel(result: estimate.Estimate) -> dict:
    totals: dict[str, float] = {}
    for computation in result.computations:
        name = computation.name if computation.kind == "pallas" else f"outside kernels ({computation.kind})"
        totals[name] = totals.get(name, 0.0) + computation.seconds
    return totals


def tune_class(chip: str, seq_len: int, candidates=CANDIDATES, progress: bool = True) -> tuple[dict, list]:
    """``(entry, rows)``: the forward's blocks chosen on the forward, then the backward's on
    forward+backward with the forward at its choice; every candidate's row."""
    rows = []

    def run(mode, blocks):
        rows.append(estimate_pallas(chip, seq_len, mode, blocks))
        if progress:
            r = rows[-1]
            shown = f"{r['seconds'] * 1e3:.3f} ms" if r["seconds"] is not None else r["error"]
            print(f"{chip} T={seq_len} {mode} {blocks}: {shown} ({r['compile_s']} s)", flush=True)
        return rows[-1]

    forward = [c for c in candidates if c[1] <= c[0] <= seq_len and fits(chip, "forward", *c)]
    backward = [c for c in candidates if c[1] <= c[0] <= seq_len and fits(chip, "backward", *c)]
    base = dict(backward_block_q=128, backward_block_kv=128)
    best_f = _best([run("fwd", dict(block_q=q, block_kv=k, **base)) for q, k in forward])
    if best_f is None:
        return None, rows
    fwd = dict(block_q=best_f["block_q"], block_kv=best_f["block_kv"])
    best_b = _best([run("fwd+bwd", dict(fwd, backward_block_q=q, backward_block_kv=k)) for q, k in backward])
    if best_b is None:
        return None, rows
    entry = dict(chip=chip, seq_len=seq_len, head_dim=CLASS["head_dim"], dtype=CLASS["dtype"],
                 causal=CLASS["causal"], block_q=fwd["block_q"], block_kv=fwd["block_kv"],
                 backward_block_q=best_b["backward_block_q"], backward_block_kv=best_b["backward_block_kv"],
                 fwd_seconds=best_f["seconds"], fwd_bwd_seconds=best_b["seconds"], label=LABEL)
    return entry, rows


def _best(rows):
    done = [r for r in rows if r["seconds"] is not None]
    # the fastest; a tie (within 0.5%) goes to the smaller tile, which holds less VMEM
    if not done:
        return None
    fastest = min(r["seconds"] for r in done)
    close = [r for r in done if r["seconds"] <= fastest * 1.005]
    return min(close, key=lambda r: (r.get("backward_block_q", 0) * r.get("backward_block_kv", 0)
                                     if r["mode"] == "fwd+bwd" else r["block_q"] * r["block_kv"]))


def tune(chips_=("v5e", "v6e", "v5p"), seq_lens=SEQ_LENS, candidates=CANDIDATES, progress=True, done=None):
    """Every chip's classes tuned, in order; ``done(entries, rows)`` called after each class (the
    command line writes its file there, so a long sweep cut short keeps the classes it finished)."""
    entries, rows = [], []
    for chip in chips_:
        for seq_len in seq_lens:
            entry, found = tune_class(chip, seq_len, candidates, progress)
            rows += found
            if entry is not None:
                entries.append(entry)
            if done is not None:
                done(entries, rows)
    return entries, rows


# ---------------------------------------------------------------------------- the package against splash
SPLASH_BLOCK = 512
HEADS = {"mha": (8, 8), "gqa": (16, 2)}


def _tokamax_weights(out, *, seq_len: int, row: dict) -> estimate.EveryKernel:
    """tokamax's kernels' shares at the blocks its HLO names
    (:func:`tpuattn.measure.estimate.tokamax_weights`: its forward steps over the visited tiles only, its
    dK/dV kernel over every tile)."""
    blocks = estimate.tokamax_blocks(out)
    if blocks is None:
        return estimate.EveryKernel(None)  # weighed as if every step computed
    row["blocks"] = {"block_q": blocks[0], "block_kv": blocks[1]}
    return estimate.tokamax_weights(seq_len, *blocks)


def compare_row(chip: str, impl: str, seq_len: int, mode: str, heads: str) -> dict:
    """One cell of the side-by-side table: ``impl`` ("pallas": the package's kernel at its default blocks
    for the chip; "splash": JAX's splash kernel at :data:`SPLASH_BLOCK`; "tokamax") compiled and estimated."""
    from tpuattn.pallas import blocks as pallas_blocks

    h, kv = HEADS[heads]
    shape = dict(CLASS, heads=h, kv_heads=kv)
    row = dict(chip=chip, impl=impl, seq_len=seq_len, mode=mode, heads=heads, seconds=None, error=None)
    started = time.perf_counter()
    try:
        if impl == "pallas":
            d = pallas_blocks.default_block_sizes(128, "bfloat16", chip=chip, seq_len=seq_len)
            blocks = dict(block_q=d.forward.block_q, block_kv=d.forward.block_kv,
                          backward_block_q=d.backward.block_q, backward_block_kv=d.backward.block_kv)
            row["blocks"] = blocks
            code = pallas_code(seq_len, mode, blocks, heads=h, kv_heads=kv)
            weights = pallas_weights(seq_len, blocks)
        elif impl == "splash":
            block = min(SPLASH_BLOCK, seq_len)
            row["blocks"] = {"block": block}
            code = SPLASH_GQA_CODE.format(seq_len=seq_len, backward=mode == "fwd+bwd", block=block, **shape)
            weights = estimate.splash_weights(seq_len, block, True)  # its whole body on every visited tile
        elif impl == "tokamax":
            code = TOKAMAX_CODE.format(seq_len=seq_len, backward=mode == "fwd+bwd", **shape)
            weights = functools.partial(_tokamax_weights, seq_len=seq_len, row=row)
        else:
            raise ValueError(f"impl: expected 'pallas', 'splash' or 'tokamax', got {impl!r}")
        if impl == "tokamax":  # its branch pair may sit in the pipeline's DMA-wait branch (v5p)
            result, counts = estimate.estimate_with_counts(code, chip, weights, split=True)
        else:
            result, counts = _estimate_with_counts(code, chip, weights)
        row["seconds"] = result.seconds
        row["kernels"] = _by_kernel(result)
        row["static"] = counts
    except Exception as error:  # noqa: BLE001 - a program that does not compile is a row with its reason
        row["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:200]}"
    row["compile_s"] = round(time.perf_counter() - started, 1)
    row["label"] = LABEL
    return row


def package_rows(doc: dict) -> list[dict]:
    """A tuned file's chosen programs as :func:`compare_row` rows of the package (``mha``): the forward at
    the chosen forward blocks, forward+backward at both (the defaults the table gives)."""
    found = []
    for e in doc["rows"]:
        for mode, fields in (("fwd", ("block_q", "block_kv")),
                             ("fwd+bwd", ("block_q", "block_kv", "backward_block_q", "backward_block_kv"))):
            match = [r for r in doc["candidates_estimated"]
                     if r["chip"] == e["chip"] and r["seq_len"] == e["seq_len"] and r["mode"] == mode
                     and r["seconds"] and all(r[f] == e[f] for f in fields)]
            if match:
                r = match[0]
                found.append(dict(chip=e["chip"], impl="pallas", seq_len=e["seq_len"], mode=mode, heads="mha",
                                  seconds=r["seconds"], error=None, kernels=r.get("kernels"),
                                  static=r.get("static"),
                                  blocks={f: r[f] for f in fields}, label=LABEL))
    return found


def document(entries, rows, *, command, problems) -> dict:
    from tpuattn.measure import aot

    doc = aot.document("blocks", entries, command=command, problems=problems, label=LABEL, what=WHAT)
    doc["kind"] = "tuned"
    doc["candidates_estimated"] = [aot._as_json(r) for r in rows]
    return doc


def load(path=TUNED) -> dict:
    return json.loads(Path(path).read_text())


def diff(old: dict, new_entries) -> list[str]:
    """What differs between a tuned file's entries and entries made again: the blocks exactly, the
    estimates within 1% (the same compiler gives the same bundles)."""
    key = lambda e: (e["chip"], e["seq_len"])
    before = {key(e): e for e in old["rows"]}
    after = {key(e): e for e in new_entries}
    lines = []
    for k in sorted(set(before) | set(after)):
        a, b = before.get(k), after.get(k)
        if a is None or b is None:
            lines.append(f"{k}: {'missing now' if b is None else 'new'}")
            continue
        for field in ("block_q", "block_kv", "backward_block_q", "backward_block_kv"):
            if a[field] != b[field]:
                lines.append(f"{k} {field}: {a[field]} -> {b[field]}")
        for field in ("fwd_seconds", "fwd_bwd_seconds"):
            if abs(a[field] - b[field]) > 0.01 * abs(a[field]):
                lines.append(f"{k} {field}: {a[field]:.6g} -> {b[field]:.6g}")
    return lines


def markdown(doc: dict) -> str:
    """A tuned file as Markdown: per chip and length, every candidate's estimate, the choice marked."""
    lines = ["| chip | tokens | pass | candidate | estimate ms | chosen |", "|---|---|---|---|---|---|"]
    for e in doc["rows"]:
        for r in doc["candidates_estimated"]:
            if r["chip"] != e["chip"] or r["seq_len"] != e["seq_len"]:
                continue
            forward = r["mode"] == "fwd"
            names = ("block_q", "block_kv") if forward else ("backward_block_q", "backward_block_kv")
            pair, chosen = tuple(r[n] for n in names), all(r[n] == e[n] for n in names)
            fixed = f"{r['block_q']}x{r['block_kv']}"
            what = "forward (fwd)" if forward else f"backward (fwd+bwd, forward {fixed})"
            secs = "-" if r["seconds"] is None else f"{r['seconds'] * 1e3:.3f}"
            lines.append(f"| {e['chip']} | {e['seq_len']} | {what} | {pair[0]}x{pair[1]} | {secs} | "
                         f"{'yes' if chosen else ''} |")
    return "\n".join(lines)


def main(argv=None):
    """``python -m tpuattn.aot --tune [--chips ...] [--seq-lens ...] [--candidates 256x256,...] [--out F]``
    or ``--tune --reproduce FILE``."""
    import argparse

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m tpuattn.aot --tune",
                                     description="Pallas blocks chosen by the compiled static estimate.")
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--chips", default="v5e,v6e,v5p")
    parser.add_argument("--seq-lens", default=",".join(map(str, SEQ_LENS)))
    parser.add_argument("--candidates", default=",".join(f"{q}x{k}" for q, k in CANDIDATES))
    parser.add_argument("--out", default="out/tune/tuned_blocks.json")
    parser.add_argument("--reproduce", default=None, metavar="FILE")
    parser.add_argument("--markdown", default=None, metavar="FILE", help="print a tuned file as Markdown")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(load(args.markdown)))
        return load(args.markdown)["rows"]
    if args.reproduce:
        old = load(args.reproduce)
        p = old["problems"]
        entries, _ = tune(p["chips"], p["seq_lens"], [tuple(c) for c in p["candidates"]])
        lines = diff(old, entries)
        print("\n".join(lines) if lines else f"{args.reproduce}: reproduced ({len(entries)} entries)")
        raise SystemExit(1 if lines else 0)
    chips_ = [c for c in args.chips.split(",") if c]
    seq_lens = [int(t) for t in args.seq_lens.split(",") if t]
    candidates = [tuple(int(n) for n in c.split("x")) for c in args.candidates.split(",") if c]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    problems = dict(chips=chips_, seq_lens=seq_lens, candidates=[list(c) for c in candidates], **CLASS)

    def write(entries, rows):
        doc = document(entries, rows, command=["python", "-m", "tpuattn.aot", *argv], problems=problems)
        out.write_text(json.dumps(doc, indent=1) + "\n")

    entries, rows = tune(chips_, seq_lens, candidates, done=write)
    for e in entries:
        print(f"{e['chip']} T={e['seq_len']}: forward {e['block_q']}x{e['block_kv']} "
              f"({e['fwd_seconds'] * 1e3:.3f} ms), backward {e['backward_block_q']}x{e['backward_block_kv']} "
              f"(fwd+bwd {e['fwd_bwd_seconds'] * 1e3:.3f} ms), {LABEL}")
    print("wrote", out)
    return entries
