"""tpuattn: attention on TPUs, from naive to a Pallas kernel, behind one contract."""

from tpuattn.api import (
    AttentionSpec,
    attention,
    choose_implementation,
    implementations,
    known_implementations,
    make_spec,
    register,
)
from tpuattn.masks import MaskSpec

__all__ = [
    "AttentionSpec",
    "MaskSpec",
    "attention",
    "choose_implementation",
    "implementations",
    "known_implementations",
    "make_spec",
    "register",
]
__version__ = "0.1.0"
