"""tpuattn: attention on TPUs, from naive to a Pallas kernel, behind one contract."""

# Beyond one call on one chip: attention over a device mesh, and decode over a KV cache.
from tpuattn import decode, parallel
from tpuattn.api import (
    attention,
    choose,
    choose_implementation,
    implementations,
    known_implementations,
)
from tpuattn.errors import UnavailableImplementation, UnsupportedInput
from tpuattn.registry import Implementation, register
from tpuattn.spec import AttentionSpec, MaskSpec, make_spec, spec_from_shapes

__all__ = [
    "AttentionSpec",
    "Implementation",
    "MaskSpec",
    "UnavailableImplementation",
    "UnsupportedInput",
    "attention",
    "choose",
    "choose_implementation",
    "decode",
    "implementations",
    "known_implementations",
    "make_spec",
    "parallel",
    "register",
    "spec_from_shapes",
]
__version__ = "0.2.0"
