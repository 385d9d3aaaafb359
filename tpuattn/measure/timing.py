"""Wall-clock timing done right: compile separately, warm up, median of repeats.

Every call is synchronised with ``jax.block_until_ready``; compile time is
reported on its own (``jit(...).lower(...).compile()``), never mixed into the
steady-state numbers.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import jax


@dataclasses.dataclass(frozen=True)
class Timing:
    compile_s: float
    median_s: float
    min_s: float
    max_s: float
    repeats: int

    @property
    def spread(self) -> float:
        """(max - min) / median: how much the repeats disagree."""
        return (self.max_s - self.min_s) / self.median_s if self.median_s > 0 else float("nan")


def time_jitted(fn: Callable, *args, warmup: int = 1, repeats: int = 5, min_total_s: float = 0.0) -> Timing:
    """Compile ``jax.jit(fn)`` for ``args``, warm up, then time ``repeats`` calls.

    ``min_total_s`` adds repeats (up to 10x) until the timed calls add up to at least that
    long, so that very fast calls are not dominated by timer resolution.
    """
    if repeats < 1:
        raise ValueError(f"repeats: expected at least 1, got {repeats}")
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - start
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    samples: list[float] = []
    while len(samples) < repeats or (sum(samples) < min_total_s and len(samples) < 10 * repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        samples.append(time.perf_counter() - start)
    return Timing(compile_s=compile_s, median_s=statistics.median(samples), min_s=min(samples),
                  max_s=max(samples), repeats=len(samples))
