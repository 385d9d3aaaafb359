"""Benchmark: the Pallas kernel's two backwards against the float64 oracle, side by side as ratios.

Not a test. ``impl="pallas"`` takes ``backward="exact"`` (delta = rowsum(P * dP) from a pass of its
own: 9 matmuls per visible tile) or ``backward="fast"`` (delta = rowsum(dO * O) from the forward's
float32 output: 7). On the cases that once broke a delta from the output, and on ordinary inputs,
it prints each gradient's largest error against ``tests/oracle.py`` (float64) for

* ``exact`` and ``fast`` (Pallas, interpret mode on CPU: the same arithmetic as on a TPU up to the
  order of float32 sums), and ``reference`` (autodiff of the materialised softmax) as the yardstick;
* the ratios fast / exact and fast / reference. ``tests/test_hardening.py`` demands at most 4x the
  reference on the near-one-hot bf16 rows; the oracle suite demands 1e-4 on the float32 cases.

    python benchmarks/backward_accuracy.py            # about a minute on 2 CPU cores
    python benchmarks/backward_accuracy.py --json rows.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the float64 oracle and the oracle suite's cases

from cases import CASES, GRAD_TOL, nearly_one_hot_rows  # noqa: E402
from oracle import oracle_grads  # noqa: E402

import tpuattn  # noqa: E402

BACKWARDS = ("exact", "fast")
DRAWS = 6  # cotangents dO drawn for the large-logit cases, whose error depends on the draw
HARDENING_RATIO = 4.0  # tests/test_hardening.py: near-one-hot bf16 rows, at most 4x the reference's error


@dataclasses.dataclass
class Problem:
    name: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    d_outs: list  # cotangents: each gradient's error is the worst over them
    kwargs: dict
    dtype: str
    criterion: str  # what the test suites demand of it


def _one_hot_rows() -> Problem:
    """The nearly one-hot bf16 rows of tests/test_hardening.py (cases.nearly_one_hot_rows): orthogonal keys,
    query i aims at key a(i) with logit 20 and at key b(i) with logit 13, every other logit ~0."""
    q, k, v, d_out = nearly_one_hot_rows()
    return Problem("bf16 near-one-hot rows", q, k, v, [d_out], {}, "bfloat16",
                   f"hardening: <= {HARDENING_RATIO:g}x reference")


def _from_case(name: str, label: str, k_factor: float = 1.0, draws: int = DRAWS) -> Problem:
    case = next(c for c in CASES if c.name == name)
    rng = np.random.default_rng(case.seed)
    q, k, v = case.inputs(rng)
    kwargs = case.kwargs(rng)
    d_outs = [np.random.default_rng(100 + i).standard_normal(q.shape) for i in range(draws)]
    return Problem(f"{label}, {draws} dO", q, k * k_factor, v, d_outs, kwargs, case.dtype,
                   f"oracle suite: <= {GRAD_TOL:g}" if k_factor == 1.0 else "none (beyond the suite)")


def _random(dtype: str) -> Problem:
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((2, 256, h, 128)) for h in (4, 2, 2))
    d_out = rng.standard_normal(q.shape)
    return Problem(f"{dtype} random, causal GQA 4/2, T=256", q, k, v, [d_out], {"causal": True}, dtype,
                   "none (ordinary inputs)")


def problems() -> list[Problem]:
    return [
        _one_hot_rows(),
        # Integer q and k, scale 1: logits up to ~1.2e3 (x10: ~1.2e4) computed exactly in float32.
        _from_case("logits-1e3-spread-causal", "f32 logits ~1e3 (exact integers, causal)"),
        _from_case("logits-1e3-spread-causal", "f32 logits ~1e4 (exact integers, causal)", k_factor=10.0),
        _random("float32"),
        _random("bfloat16"),
    ]


def _grads(problem: Problem, impl: str, **options):
    dtype = jnp.dtype(problem.dtype)
    q, k, v = (jnp.asarray(x, dtype) for x in (problem.q, problem.k, problem.v))
    loss = lambda q, k, v, d_out: jnp.sum(
        tpuattn.attention(q, k, v, impl=impl, **problem.kwargs, **options).astype(jnp.float32) * d_out)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return [grad(q, k, v, jnp.asarray(d_out, jnp.float32)) for d_out in problem.d_outs]


def measure(problem: Problem) -> dict:
    """Max |gradient - oracle| per gradient (dq, dk, dv), worst over the dO draws, for exact, fast and
    reference."""
    dtype = jnp.dtype(problem.dtype)
    # The oracle sees the inputs as the kernels do (rounded to the dtype), in float64.
    inputs64 = [np.asarray(jnp.asarray(x, dtype), np.float64) for x in (problem.q, problem.k, problem.v)]
    wants = [oracle_grads(*inputs64, np.asarray(d, np.float32), **problem.kwargs) for d in problem.d_outs]
    runs = {name: _grads(problem, "pallas", backward=name) for name in BACKWARDS}
    runs["reference"] = _grads(problem, "reference")
    errors = {name: [max(float(np.abs(np.asarray(got[i], np.float64) - want[i]).max())
                         for got, want in zip(draws, wants, strict=True)) for i in range(3)]
              for name, draws in runs.items()}
    return {"case": problem.name, "dtype": problem.dtype, "criterion": problem.criterion, "errors": errors}


def report(rows: list[dict]) -> str:
    lines = [f"{'case':50s} {'grad':4s} {'exact':>9s} {'fast':>9s} {'reference':>9s} "
             f"{'fast/exact':>10s} {'fast/ref':>9s} {'exact/ref':>9s}"]
    for row in rows:
        e = row["errors"]
        for i, grad in enumerate(("dq", "dk", "dv")):
            exact, fast, ref = e["exact"][i], e["fast"][i], e["reference"][i]
            ratio = lambda a, b: a / b if b > 0 else float("inf") if a > 0 else 1.0
            lines.append(f"{row['case'] if i == 0 else '':50s} {grad:4s} {exact:9.2e} {fast:9.2e} {ref:9.2e} "
                         f"{ratio(fast, exact):10.2f} {ratio(fast, ref):9.2f} {ratio(exact, ref):9.2f}")
        lines.append(f"{'':50s} demanded: {row['criterion']}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    print(f"JAX {jax.__version__}, backend {jax.default_backend()} (Pallas in interpret mode off TPU)")
    rows = [measure(p) for p in problems()]
    print(report(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
