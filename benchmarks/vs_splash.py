"""The package's Pallas kernel against JAX's splash kernel (and tokamax where it imports), each compiled for
a TPU chip and estimated from libtpu's final bundles: **compiled (static estimate, not run)**.

Causal, bfloat16, head_dim 128, batch 1, at 2K, 8K and 32K tokens, forward and forward+backward, 8 heads
(``mha``) and 16 query heads on 2 kv heads (``gqa``). The package's kernel runs at its default blocks for
the chip, splash at 512 x 512 (:func:`tpuattn.measure.tune.compare_row`). Prints the table (estimate per
implementation, ratio package / splash) and writes every row, with the versions, to JSON::

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/vs_splash.py [--chips v5e,v5p,v6e]
        [--seq-lens 2048,8192,32768] [--modes fwd,fwd+bwd] [--heads mha,gqa] [--impls pallas,splash,tokamax]
        [--json out/vs_splash.json]
    .venv/bin/python benchmarks/vs_splash.py --merge out/a.json,out/b.json   # one table of several runs

A tuned table (``python -m tpuattn.aot --tune``) among the merged files gives the package's ``mha``
cells: its chosen candidates are the same programs at the blocks the defaults take from it.

Each cell is one compile in a child process (about 20 s on a loaded 2-core machine). The table is
book/vs-splash.md's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def table(rows) -> str:
    from tpuattn.measure import tune

    cells = {}
    for r in rows:
        cells.setdefault((r["chip"], r["seq_len"], r["mode"], r["heads"]), {})[r["impl"]] = r
    impls = [i for i in ("pallas", "splash", "tokamax") if any(r["impl"] == i for r in rows)]
    lines = [f"{tune.LABEL}; milliseconds",
             f"{'chip':<5}{'T':>6} {'mode':<8}{'heads':<6}" + "".join(f"{i:>10}" for i in impls)
             + f"{'pkg/splash':>11}"]
    for key in sorted(cells, key=lambda k: (k[0], k[1], k[2], k[3])):
        got = cells[key]
        shown = []
        for i in impls:
            r = got.get(i)
            missing = r is None or r["seconds"] is None
            shown.append(f"{'-':>10}" if missing else f"{r['seconds'] * 1e3:>10.3f}")
        p, s = got.get("pallas"), got.get("splash")
        ratio = (f"{p['seconds'] / s['seconds']:>11.2f}" if p and s and p["seconds"] and s["seconds"]
                 else f"{'-':>11}")
        lines.append(f"{key[0]:<5}{key[1]:>6} {key[2]:<8}{key[3]:<6}" + "".join(shown) + ratio)
    for r in rows:
        if r["error"]:
            lines.append(f"  {r['chip']} {r['impl']} T={r['seq_len']} {r['mode']} {r['heads']}: {r['error']}")
    return "\n".join(lines)


def _ms(value) -> str:
    return "-" if value is None else f"{value * 1e3:.3f}"


def markdown(rows) -> str:
    """The side-by-side table as Markdown, then, for every cell where the package is slower than splash,
    where the time goes: each program's estimate split by kernel (outside the kernels: XLA's ops and the
    program's own bundles and copies) and each Pallas kernel's grid step read from the bundles."""
    cells = {}
    for r in rows:
        cells.setdefault((r["chip"], r["seq_len"], r["mode"], r["heads"]), {})[r["impl"]] = r
    has_tokamax = any(r["impl"] == "tokamax" for r in rows)
    head = ("| chip | tokens | mode | heads | package ms (blocks) | splash ms |"
            + (" tokamax ms |" if has_tokamax else "") + " package / splash |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    slower = []
    for key in sorted(cells):
        got = cells[key]
        p, s, t = got.get("pallas"), got.get("splash"), got.get("tokamax")
        blocks = ""
        if p and p.get("blocks"):
            b = p["blocks"]
            backward = "backward_block_q" in b and key[2] != "fwd"
            blocks = (f" ({b['block_q']}x{b['block_kv']}"
                      + (f", bwd {b['backward_block_q']}x{b['backward_block_kv']})" if backward else ")"))
        ratio = p["seconds"] / s["seconds"] if p and s and p["seconds"] and s["seconds"] else None
        heads = "8 / 8" if key[3] == "mha" else "16 / 2"
        line = (f"| {key[0]} | {key[1]} | {key[2]} | {heads} | {_ms(p and p['seconds'])}{blocks} | "
                f"{_ms(s and s['seconds'])} |")
        if has_tokamax:
            line += f" {_ms(t and t['seconds'])} |"
        lines.append(line + (f" {ratio:.2f} |" if ratio else " - |"))
        if ratio and ratio > 1.0:
            slower.append((key, p, s, ratio))
    if slower:
        lines += ["", "| cell | program | kernel or part | estimate ms | loop bundles | vmatmul (ideal) "
                      "| valu | eup |", "|---|---|---|---|---|---|---|---|"]
        for key, p, s, ratio in slower:
            cell = f"{key[0]} {key[1]} {key[2]} {key[3]} ({ratio:.2f}x)"
            for name, r in (("package", p), ("splash", s)):
                for kernel, secs in sorted((r.get("kernels") or {}).items(), key=lambda kv: -kv[1]):
                    c = (r.get("static") or {}).get(kernel)
                    counts = "- | - | - | -"
                    if c:
                        vmatmul = f"{c['vmatmul']} ({c['ideal_vmatmul']})"
                        counts = f"{c['loop_bundles']} | {vmatmul} | {c['valu']} | {c['eup']}"
                    lines.append(f"| {cell} | {name} | {kernel} | {secs * 1e3:.3f} | {counts} |")
    return "\n".join(lines)


def main(argv=None):
    from tpuattn.measure import aot, tune

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chips", default="v5e,v5p,v6e")
    parser.add_argument("--seq-lens", default="2048,8192,32768")
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--heads", default="mha,gqa")
    parser.add_argument("--impls", default="pallas,splash", help="from pallas, splash, tokamax")
    parser.add_argument("--markdown", action="store_true", help="--merge: print the book's Markdown tables")
    parser.add_argument("--merge", default=None, metavar="FILES",
                        help="instead: print the table of these comma-separated JSON files' rows together")
    parser.add_argument("--json", default="out/vs_splash.json")
    args = parser.parse_args(argv)
    split = lambda text: [x for x in text.split(",") if x]
    if args.merge:
        rows = []
        for f in split(args.merge):
            doc = json.loads(Path(f).read_text())
            rows += tune.package_rows(doc) if doc.get("kind") == "tuned" else doc["rows"]
        print(markdown(rows) if args.markdown else table(rows))
        return rows
    impls = split(args.impls)
    rows = []
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write():
        command = ["python", "benchmarks/vs_splash.py", *(sys.argv[1:] if argv is None else argv)]
        out.write_text(json.dumps({"label": tune.LABEL, "command": command,
                                   "created": datetime.datetime.now(datetime.UTC).date().isoformat(),
                                   "versions": aot.versions(), "rows": rows}, indent=1) + "\n")

    for chip in split(args.chips):
        for seq_len in map(int, split(args.seq_lens)):
            for mode in split(args.modes):
                for heads in split(args.heads):
                    for impl in impls:
                        rows.append(tune.compare_row(chip, impl, seq_len, mode, heads))
                        r = rows[-1]
                        shown = f"{r['seconds'] * 1e3:.3f} ms" if r["seconds"] is not None else r["error"]
                        print(f"{chip} {impl} T={seq_len} {mode} {heads}: {shown} ({r['compile_s']} s)",
                              flush=True)
                        write()
    print(aot.versions_text())
    print(table(rows))
    write()
    print("wrote", out)
    return rows


if __name__ == "__main__":
    main()
