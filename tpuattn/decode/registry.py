"""The decode implementations' own registry (the same idea as :mod:`tpuattn.registry`, for the
decode contract: ``fn(q, k_cache, v_cache, lengths, page_table, spec, **options)``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tpuattn.decode.spec import DecodeSpec


def _always(*_args) -> bool:
    return True


def _supports_everything(spec: DecodeSpec, backend: str | None = None) -> str | None:
    return None


def _never_auto(spec: DecodeSpec, backend: str) -> float | None:
    return None


@dataclasses.dataclass(frozen=True)
class DecodeImplementation:
    """A registered decode implementation.

    Attributes:
      name: the ``impl=`` string.
      fn: ``fn(q, k_cache, v_cache, lengths, page_table, spec, **options)``: inputs already validated
        (``lengths`` int32 ``[batch]``, ``page_table`` int32 or None); returns an array of q's shape
        and dtype.
      description: one line for listings.
      available: ``available() -> bool``: do its modules import on this JAX?
      supports: ``supports(spec, backend) -> None or a reason`` (a sentence naming what it cannot express).
      auto_rank: the ``impl="auto"`` preference (lower wins); ``None``: never chosen automatically.
      interpreted_off_tpu: a Pallas TPU kernel that runs in interpret mode elsewhere (timings there are
        not kernel speed).
      options: the option names ``fn`` accepts.
    """

    name: str
    fn: Callable
    description: str
    available: Callable[[], bool] = _always
    supports: Callable[[DecodeSpec, str], str | None] = _supports_everything
    auto_rank: Callable[[DecodeSpec, str], float | None] = _never_auto
    interpreted_off_tpu: bool = False
    options: tuple[str, ...] = ()


_REGISTRY: dict[str, DecodeImplementation] = {}


def register(name: str, fn: Callable, *, description: str, replace: bool = False,
             **fields) -> DecodeImplementation:
    """Register a decode implementation under ``name``; a second registration raises unless ``replace``."""
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"name: expected a non-empty string other than 'auto', got {name!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"name: a decode implementation named {name!r} is already registered "
                         "(pass replace=True to replace it)")
    record = DecodeImplementation(name=name, fn=fn, description=description, **fields)
    _REGISTRY[name] = record
    return record


def unregister(name: str) -> None:
    """Remove ``name`` (for tests and experiments)."""
    _REGISTRY.pop(name, None)


def registered() -> dict[str, DecodeImplementation]:
    """The registry as it stands."""
    return _REGISTRY
