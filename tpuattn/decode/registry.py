"""The decode contract's registry: its own record and problem type, the machinery of
:class:`tpuattn.registry.Registry` (the same ``register``, ``choose`` with refusals, ``resolve`` and
errors as :func:`tpuattn.attention`'s).

The contract: ``fn(q, k_cache, v_cache, lengths, page_table, spec, **options)``, with ``sinks=``,
``cu_q_lens=``/``num_seqs=`` and ``k_scale=``/``v_scale=`` passed only to the records that take them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tpuattn.decode.spec import DecodeSpec
from tpuattn.options import Options
from tpuattn.registry import DEFAULT_PRIORITY, Registry, _always, _never_auto, _supports_everything


@dataclasses.dataclass(frozen=True)
class DecodeImplementation:
    """A registered decode implementation.

    Attributes:
      name: the ``impl=`` string.
      fn: ``fn(q, k_cache, v_cache, lengths, page_table, spec, **options)``: inputs already validated
        (``lengths`` int32 ``[batch]``, ``page_table`` int32 or None); returns an array of q's shape
        and dtype.
      description: one line for listings.
      available: ``available() -> bool``: can it run on this machine (do its modules import on this JAX)?
      supports: ``supports(spec, backend) -> None or a reason`` (a sentence naming what it cannot express).
      auto_rank: the ``impl="auto"`` preference (lower wins); ``None``: never chosen automatically.
      interpreted_off_tpu: a Pallas TPU kernel that runs in interpret mode elsewhere (timings there are
        not kernel speed).
      options: the :class:`tpuattn.options.Options` record type ``fn`` reads its options through
        (the split-K kernel's :class:`~tpuattn.options.DecodeKernelOptions`; it reads as the tuple of
        names it takes), or a plain tuple of names (JAX's kernels, a registration of your own); listed
        by :func:`tpuattn.decode.options_of`, and ``impl="auto"`` refuses an option its choice does not
        take (:func:`tpuattn.options.option_names`).
      takes_sinks: ``fn`` accepts ``sinks=`` (float32 ``[heads]``, :mod:`tpuattn.sinks`): one logit per
        query head in each row's softmax denominator, with no value.
      takes_ragged: ``fn`` accepts ``cu_q_lens=`` and ``num_seqs=`` (a ragged batch: ``q [total_tokens,
        heads, d]``, see :mod:`tpuattn.decode.spec`; ``cu_q_lens`` already normalised, so ``num_seqs``
        may be ignored).
      takes_scales: ``fn`` accepts ``k_scale=`` and ``v_scale=`` (float32 ``[kv_heads]``: a quantized
        or scaled cache, entries times their kv head's scale).
      priority: breaks ``auto`` ties (lower wins); a built-in takes its declared one.
    """

    name: str
    fn: Callable
    description: str
    available: Callable[[], bool] = _always
    supports: Callable[[DecodeSpec, str], str | None] = _supports_everything
    auto_rank: Callable[[DecodeSpec, str], float | None] = _never_auto
    interpreted_off_tpu: bool = False
    options: type[Options] | tuple[str, ...] = ()
    takes_sinks: bool = False
    takes_ragged: bool = False
    takes_scales: bool = False
    priority: int = DEFAULT_PRIORITY


# The built-ins are declared by the package (:data:`tpuattn.decode.IMPLEMENTATION_MODULES`): their
# modules import this one.
REGISTRY: Registry[DecodeImplementation] = Registry(DecodeImplementation, noun="decode implementation")


def register(name: str, fn: Callable, *, description: str, replace: bool = False,
             **fields) -> DecodeImplementation:
    """Register a decode implementation under ``name``; a second registration raises unless ``replace``."""
    return REGISTRY.register(name, fn, description=description, replace=replace, **fields)


def unregister(name: str) -> None:
    """Remove ``name`` (for tests and experiments)."""
    REGISTRY.unregister(name)


def registered() -> dict[str, DecodeImplementation]:
    """Every decode implementation's record, loading the built-ins not loaded yet."""
    return REGISTRY.records()
