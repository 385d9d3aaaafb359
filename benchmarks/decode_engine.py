"""A serving engine's attention step compiled for TPU v5e and v6e (compiled, not run), side by side.

The package's decode kernel (``tpuattn.decode.attention(..., impl="pallas")``: split-K over the cache
for the dense serving batch, the token-major grid for the ragged mixed batch) and JAX's ragged
paged attention kernel (``jax.experimental.pallas.ops.tpu.ragged_paged_attention``, its cache in its own
layout, its tuned block sizes for the chip) at notebook 07's serving batch (8 sequences, 1 new token
each) and a mixed batch (4 prefill chunks of 256 tokens beside 60 single-token decodes), 32 query heads
on 8 kv heads of 128, 16 pages of 64 rows per sequence, over bfloat16, int8 and fp8 (e4m3) caches
(:func:`tpuattn.measure.aot.decode_engine_rows`). For each: XLA's bytes accessed (cost analysis), the
ratio to the decode model's bytes (:mod:`tpuattn.model.decode_roofline`, modelled, every sequence's
cache full), peak HBM (``memory_analysis()``), and whether it compiled (the compiler's error if not)::

    JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 .venv/bin/python benchmarks/decode_engine.py \\
        [--chips v5e,v6e] [--json out/decode_engine.json] [--tpu-inference DIR]

``--tpu-inference DIR`` adds tpu-inference's ragged paged attention v3 (vLLM's TPU backend). The
``tpu-inference`` package does not install beside the project's pins (its dependencies replace numpy,
flax and optax), so it is put, without its dependencies, in a scratch directory outside the project::

    .venv-uv/bin/uv pip install --no-deps --target /tmp/tpu-inference tpu-inference==0.25.0

and only its kernel module is imported from there (it needs JAX alone); the package's ``__init__``,
which sets environment variables for vLLM, is not run.

Needs libtpu (the compile-only TPU devices). The table is book/decode-engine.md's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def model_bytes(chip_names) -> dict:
    """``{(chip, shape, cache_dtype): modelled bytes}`` at every case (each sequence's cache full)."""
    from tpuattn.measure import aot
    from tpuattn.model import decode_roofline as roofline

    out = {}
    for chip in chip_names:
        for shape, s in aot.DECODE_ENGINE_SHAPES.items():
            lengths = [s["page"] * s["pages_per_sequence"]] * len(s["q_lens"])
            ragged = dict(q_len=s["q_lens"][0]) if len(set(s["q_lens"])) == 1 else dict(q_lens=s["q_lens"])
            for cache_dtype in aot.DECODE_CACHE_DTYPES:
                out[chip, shape, cache_dtype] = roofline.decode_roofline(
                    lengths, **ragged, **aot.DECODE_ENGINE_HEADS, chip=chip,
                    pages_per_sequence=s["pages_per_sequence"], cache_dtype=cache_dtype,
                    scales=None if cache_dtype == "bfloat16" else "tensor").bytes
    return out


def use_tpu_inference(directory: str) -> None:
    """Import ``tpu_inference``'s modules from ``directory/tpu_inference`` without running its
    ``__init__`` (an empty package standing in for it)."""
    import types

    root = Path(directory) / "tpu_inference"
    if not (root / "kernels" / "ragged_paged_attention" / "v3" / "kernel.py").exists():
        raise SystemExit(f"--tpu-inference: expected a directory holding tpu_inference/kernels/"
                         f"ragged_paged_attention/v3/kernel.py, got {directory!r}")
    package = types.ModuleType("tpu_inference")
    package.__path__ = [str(root)]
    sys.modules["tpu_inference"] = package


def main(argv=None) -> list:
    from tpuattn.measure import aot

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chips", default="v5e,v6e")
    parser.add_argument("--json", default=None, help="also write the rows and versions here")
    parser.add_argument("--tpu-inference", default=None, metavar="DIR",
                        help="also compile tpu-inference's kernel, from a --no-deps --target install in DIR")
    args = parser.parse_args(argv)
    chip_names = [c for c in args.chips.split(",") if c]
    engines, setup = aot.DECODE_ENGINES, ""
    if args.tpu_inference:
        use_tpu_inference(args.tpu_inference)  # checks the directory here; each child does the same
        engines += ("tpu_inference",)
        setup = (f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\nimport decode_engine\n"
                 f"decode_engine.use_tpu_inference({args.tpu_inference!r})")
    rows = aot.decode_engine_rows(chip_names, engines, progress=True, setup=setup)
    print(f"\n{aot.LABEL}; {aot.versions_text()}; model: tpuattn.model.decode_roofline (modelled)\n")
    print(aot.decode_engine_table(rows, model_bytes(chip_names)))
    if args.json:
        doc = dict(command=["python", "benchmarks/decode_engine.py", *(argv or sys.argv[1:])],
                   versions=aot.versions(), label=aot.LABEL, rows=rows)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
    return rows


if __name__ == "__main__":
    main()
