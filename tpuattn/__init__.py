"""tpuattn: attention on TPUs, from naive to a Pallas kernel, behind one contract.

Importing the package loads no implementation: each registers itself when first asked for (see
:mod:`tpuattn.registry`). :mod:`tpuattn.decode` and :mod:`tpuattn.parallel` load on first access.
"""

import importlib

from tpuattn.api import (
    attention,
    choose,
    choose_implementation,
    implementations,
    known_implementations,
    options_of,
    unavailable_implementations,
)
from tpuattn.errors import TpuattnError, UnavailableImplementation, UnsupportedInput
from tpuattn.registry import Choice, Implementation, register
from tpuattn.spec import AttentionSpec, MaskSpec, make_spec, spec_from_shapes

# Beyond one call on one chip: attention over a device mesh, and decode over a KV cache (lazy).
_LAZY_SUBPACKAGES = ("decode", "parallel")


def __getattr__(name):
    if name in _LAZY_SUBPACKAGES:
        return importlib.import_module(f"tpuattn.{name}")
    raise AttributeError(f"module 'tpuattn' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_SUBPACKAGES))


__all__ = [
    "AttentionSpec",
    "Choice",
    "Implementation",
    "MaskSpec",
    "TpuattnError",
    "UnavailableImplementation",
    "UnsupportedInput",
    "attention",
    "choose",
    "choose_implementation",
    "decode",
    "implementations",
    "known_implementations",
    "make_spec",
    "options_of",
    "parallel",
    "register",
    "spec_from_shapes",
    "unavailable_implementations",
]
__version__ = "0.2.0"
