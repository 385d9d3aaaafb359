"""Decode over a KV cache: a few new queries per sequence against a contiguous or paged cache.

``tpuattn.decode.attention(q, k_cache, v_cache, lengths, *, page_table=None, cu_q_lens=None,
num_seqs=None, k_scale=None, v_scale=None, scale=None, window=None, softcap=None, sinks=None,
impl="auto")`` -- see :func:`tpuattn.decode.api.attention` for the contract (dense or ragged batches,
full-width or quantized caches) and :mod:`tpuattn.decode.spec` for what is checked when.
:func:`quantize` and :func:`write` (:mod:`tpuattn.decode.quant`) make int8 / fp8 entries with their
scales and store new keys and values into pages. Implementations (declared in
:data:`IMPLEMENTATION_MODULES` and imported on first use; their records live in
:mod:`tpuattn.decode.registry`, the machinery of :class:`tpuattn.registry.Registry`):

* ``reference``: gather pages, mask, materialised float32 softmax (:mod:`.reference`);
* ``pallas``: a split-K flash-decoding Pallas kernel that neither fetches nor computes blocks past a
  sequence's length (:mod:`.kernel`; interpret mode off a TPU);
* ``jax_paged`` / ``jax_ragged``: JAX's own ``paged_attention`` / ``ragged_paged_attention`` kernels,
  translated or refused (:mod:`.native`).

:func:`options_of` lists an implementation's options, as :func:`tpuattn.options_of` does the attention
contract's (the split-K kernel's: its record :class:`tpuattn.options.DecodeKernelOptions`).

``impl="auto"`` picks ``pallas`` on a TPU and ``reference`` elsewhere. :func:`schedule` counts the
blocks the kernel fetches and skips; :mod:`tpuattn.model.decode_roofline` models a decode step's bytes, FLOPs
and time per JAX device (modelled numbers).
"""

import importlib

from tpuattn.decode.api import (
    attention,
    choose,
    get_implementation,
    implementations,
    known_implementations,
    options_of,
    unavailable_implementations,
)
from tpuattn.decode.quant import quantize, write
from tpuattn.decode.registry import REGISTRY as _REGISTRY
from tpuattn.decode.spec import (
    QUANTIZED_DTYPES,
    DecodeInputs,
    DecodeSpec,
    decode_spec_from_shapes,
    make_decode_spec,
    validate,
)

# The built-in decode implementations: name -> (the module that registers it, its priority), imported
# on first use; the priority breaks ``auto`` ties (lower wins), whatever order the modules load in.
IMPLEMENTATION_MODULES = {
    "reference": ("tpuattn.decode.reference", 10),
    "pallas": ("tpuattn.decode.kernel", 20),
    "jax_paged": ("tpuattn.decode.native", 30),
    "jax_ragged": ("tpuattn.decode.native", 40),
}
for _name, (_module, _priority) in IMPLEMENTATION_MODULES.items():
    _REGISTRY.declare(_name, _module, priority=_priority)

# Names from implementation modules, imported on first access (importing the package loads none).
_LAZY = {"schedule": "tpuattn.decode.kernel", "plain_decode": "tpuattn.decode.reference"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tpuattn.decode' has no attribute {name!r}")


__all__ = ["QUANTIZED_DTYPES", "DecodeInputs", "DecodeSpec", "attention", "choose", "decode_spec_from_shapes",
           "get_implementation", "implementations", "known_implementations", "make_decode_spec",
           "options_of",
           "plain_decode", "quantize", "schedule", "unavailable_implementations", "validate", "write"]
