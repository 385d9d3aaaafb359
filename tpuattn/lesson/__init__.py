"""The kernels notebook 03 builds, step by step, as package code.

* :mod:`tpuattn.lesson.steps`: each step's kernel and the ``pallas_call`` around it, in the order the
  notebook writes them (one block; the grid; the online softmax over kv blocks; a causal mask with
  skipped blocks; GQA through the index maps; the schedule as scalar-prefetched tables);
* :mod:`tpuattn.lesson.flash`: the finished lesson kernel, the scheduled flash forward with its
  statistics and a FlashAttention-2 backward (a dK/dV kernel and a dQ kernel) joined by
  ``jax.custom_vjp``, registered as the contract's ``impl="lesson"`` (offered by name, never by
  ``auto``).

:func:`show` prints a function's source, which is how the notebook shows each step's code.
"""

from __future__ import annotations

import inspect


def show(*functions) -> None:
    """Print the source of each function (as written in this package), one after another."""
    for function in functions:
        print(inspect.getsource(function))
