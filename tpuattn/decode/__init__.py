"""Decode over a KV cache: a few new queries per sequence against a contiguous or paged cache.

``tpuattn.decode.attention(q, k_cache, v_cache, lengths, *, page_table=None, scale=None, window=None,
softcap=None, impl="auto")`` -- see :func:`tpuattn.decode.api.attention` for the contract and
:mod:`tpuattn.decode.spec` for what is checked when. Implementations (a registry of their own,
:mod:`tpuattn.decode.registry`):

* ``reference``: gather pages, mask, materialised float32 softmax (:mod:`.reference`);
* ``pallas``: a split-K flash-decoding Pallas kernel that neither fetches nor computes blocks past a
  sequence's length (:mod:`.kernel`; interpret mode off a TPU);
* ``jax_paged`` / ``jax_ragged``: JAX's own ``paged_attention`` / ``ragged_paged_attention`` kernels,
  translated or refused (:mod:`.native`).

``impl="auto"`` picks ``pallas`` on a TPU and ``reference`` elsewhere. :func:`schedule` counts the
blocks the kernel fetches and skips; :mod:`tpuattn.decode.roofline` models a decode step's bytes, FLOPs
and time per chip (modelled numbers).
"""

from tpuattn.decode.api import attention, choose, get_implementation, implementations, known_implementations
from tpuattn.decode.kernel import merge_partials, schedule
from tpuattn.decode.reference import plain_decode
from tpuattn.decode.spec import DecodeSpec, decode_spec_from_shapes, make_decode_spec

__all__ = ["DecodeSpec", "attention", "choose", "decode_spec_from_shapes", "get_implementation",
           "implementations", "known_implementations", "make_decode_spec", "merge_partials", "plain_decode",
           "schedule"]
