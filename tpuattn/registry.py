"""The registry of implementations: one record per implementation, everything else reads it.

An implementation module builds an :class:`Implementation` and calls :func:`register` once.
The record carries what every other layer needs, so no other module names an implementation:
the contract (``fn``, ``supports``), the ``auto`` rule (``auto_rank``), the bench
(``interpreted_off_tpu``) and the roofline (``schedule``, ``default_blocks``).

This module imports only the spec layer; the implementations import it (not :mod:`tpuattn.api`),
so there is no import cycle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from tpuattn.spec import AttentionSpec

BACKENDS = ("cpu", "gpu", "tpu")


def _always(*_args) -> bool:
    return True


def _supports_everything(spec: AttentionSpec, backend: str | None = None) -> str | None:
    return None


def _never_auto(spec: AttentionSpec, backend: str) -> float | None:
    return None


@dataclasses.dataclass(frozen=True)
class Implementation:
    """A registered implementation and what it can do.

    Attributes:
      name: the ``impl=`` string.
      fn: ``fn(q, k, v, segment_ids, spec, **options)``: inputs already validated (``segment_ids`` is
        ``None`` or an int32 pair ``(q_ids [batch, q_len], kv_ids [batch, kv_len])``); returns an array
        of q's shape and dtype.
      description: one line for listings.
      available: ``available() -> bool``: can it run on this machine at all (its modules import)?
      supports: ``supports(spec, backend) -> None or a reason``: ``None`` when it serves ``spec`` on
        ``backend`` ("cpu", "gpu", "tpu"), else a sentence saying why not and what to use instead.
      auto_rank: ``auto_rank(spec, backend) -> float or None``: the ``impl="auto"`` preference (lower
        wins); ``None`` keeps it out of the automatic choice.
      interpreted_off_tpu: a Pallas TPU kernel that runs in interpret mode elsewhere (its timings there
        are not kernel speed).
      schedule: the roofline model of its schedule ("materialised", "flash", "flash (row-sum pass)",
        "blockwise (XLA loop)"),
        ``None`` when not modelled.
      default_blocks: ``default_blocks(spec, chip) -> (block_q, block_kv)``: the blocks it runs by
        default on ``chip`` (a chip name; ``None``: the target chip, or this machine), for the model.
      options: the option names ``fn`` accepts.
      model: parameters of its schedule's model, read by :mod:`tpuattn.model.roofline` (what the
        compiler showed this implementation does): ``live_scores`` ``{mode: f(p) -> bytes}`` per score
        element live at the peak (materialised; ``p`` = bytes of P), ``lse_row_bytes`` (flash: bytes
        per query row of the saved logsumexp as the kernel writes it), ``kernel_layout_copies``
        (flash: the wrapper copies Q, K, V and O to and from ``[batch, heads, seq, head_dim]``).
    """

    name: str
    fn: Callable
    description: str
    available: Callable[[], bool] = _always
    supports: Callable[[AttentionSpec, str], str | None] = _supports_everything
    auto_rank: Callable[[AttentionSpec, str], float | None] = _never_auto
    interpreted_off_tpu: bool = False
    schedule: str | None = None
    default_blocks: Callable[[AttentionSpec, str | None], tuple[int, int]] | None = None
    options: tuple[str, ...] = ()
    model: Mapping[str, object] = dataclasses.field(default_factory=dict)
    partial: PartialOps | None = None


@dataclasses.dataclass(frozen=True)
class PartialOps:
    """What an implementation offers to attend one block of a larger problem (ring attention).

    All in the contract layout, float32 results; ``spec`` is a block's spec
    (:func:`tpuattn.spec.block_spec`); ``(m, log_l)`` are float32 ``[batch, heads, q_len]``, the
    row max and the log of the row sum of ``exp(s - m)``, a row that sees nothing having
    ``m = -inf`` and ``log_l = 0``:

    * ``forward(q, k, v, segment_ids, spec, **options) -> (out, m, log_l)``: ``out`` normalised by
      its own row sum (zeros for a row that sees nothing);
    * ``row_sums(q, k, v, segment_ids, spec, m, log_l, d_out, **options) -> delta``: this block's
      share of ``rowsum(P * dP)``, with ``P`` taken from the given (whole-problem) ``(m, log_l)``;
    * ``backward(q, k, v, segment_ids, spec, m, log_l, d_out, delta, **options) -> (dq, dk, dv)``:
      this block's shares of the gradients, from the whole problem's ``(m, log_l)`` and ``delta``.

    Summed over the blocks of a row, the shares are the whole problem's values.
    """

    forward: Callable
    row_sums: Callable
    backward: Callable


_REGISTRY: dict[str, Implementation] = {}


def register(name: str, fn: Callable, *, description: str, replace: bool = False,
             **fields) -> Implementation:
    """Register an implementation under ``name`` (see :class:`Implementation` for ``fields``).

    A second registration of the same name raises unless ``replace=True``.
    """
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"name: expected a non-empty string other than 'auto', got {name!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"name: an implementation named {name!r} is already registered "
                         "(pass replace=True to replace it)")
    record = Implementation(name=name, fn=fn, description=description, **fields)
    _REGISTRY[name] = record
    return record


def unregister(name: str) -> None:
    """Remove ``name`` from the registry (for tests and experiments)."""
    _REGISTRY.pop(name, None)


def registered() -> dict[str, Implementation]:
    """The registry as it stands (implementation modules not yet loaded are absent: use the api)."""
    return _REGISTRY
