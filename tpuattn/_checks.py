"""Argument checks and integer arithmetic shared by every layer (imports nothing from tpuattn).

One rule for integer arguments everywhere: a Python ``int`` or a NumPy integer, never a ``bool``.
Every error names the argument, what was expected and what was given.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def is_int(value) -> bool:
    """True for Python and NumPy integers, False for bools (``True`` is not a block size)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def positive_int(name: str, value, *, multiple_of: int = 1) -> int:
    """``value`` as a Python int if it is a positive integer (a multiple of ``multiple_of``)."""
    if not is_int(value) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if value % multiple_of:
        raise ValueError(f"{name}: expected a multiple of {multiple_of}, got {int(value)}")
    return int(value)


def one_of(name: str, value, choices: Iterable):
    """``value`` if it is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name}: expected one of {list(choices)}, got {value!r}")
    return value


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is at least ``n``."""
    return -(-n // multiple) * multiple
