"""The contract: one public function that every implementation sits behind.

:func:`attention` validates and normalises its inputs once (:func:`tpuattn.spec.make_spec`),
picks an implementation (by name, or by the ``auto`` rule: :func:`choose`) and calls it. The
implementations live in :mod:`tpuattn.impl` and :mod:`tpuattn.pallas`; each registers one
:class:`~tpuattn.registry.Implementation` record, loaded on first use from
:data:`IMPLEMENTATION_MODULES`.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging

import jax

from tpuattn import chips, registry
from tpuattn.errors import UnavailableImplementation, UnsupportedInput
from tpuattn.registry import BACKENDS, Implementation, register
from tpuattn.spec import AttentionSpec, make_spec

# The modules that register the built-in implementations, imported on first use. A module of
# your own can call ``tpuattn.register`` directly instead.
IMPLEMENTATION_MODULES = (
    "tpuattn.impl.reference",
    "tpuattn.impl.xla",
    "tpuattn.impl.blockwise",
    "tpuattn.pallas",
    "tpuattn.impl.splash",
)

log = logging.getLogger("tpuattn")
_LOADED = False

__all__ = ["AttentionSpec", "Choice", "Implementation", "attention", "choose", "choose_implementation",
           "get_implementation", "implementations", "known_implementations", "make_spec", "register"]


def _load() -> dict[str, Implementation]:
    global _LOADED
    if not _LOADED:
        for module in IMPLEMENTATION_MODULES:
            importlib.import_module(module)
        _LOADED = True
    return registry.registered()


def known_implementations() -> tuple[str, ...]:
    """Every registered implementation name, available here or not."""
    return tuple(_load())


def implementations() -> tuple[str, ...]:
    """Names of the implementations usable on this machine."""
    return tuple(name for name, impl in _load().items() if impl.available())


def get_implementation(name: str) -> Implementation:
    """The registered record for ``name``."""
    known = _load()
    if name not in known:
        raise ValueError(f"impl: expected one of {sorted(known) + ['auto']}, got {name!r}")
    return known[name]


def _backend(backend: str | None) -> str:
    backend = chips.target_backend() if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {list(BACKENDS)}, got {backend!r}")
    return backend


@dataclasses.dataclass(frozen=True)
class Choice:
    """What ``impl="auto"`` picks for one problem on one backend, and why."""

    impl: str
    backend: str
    reason: str
    refused: tuple[tuple[str, str], ...]  # (implementation, why it was not picked)

    def __str__(self) -> str:
        return f"{self.impl} on {self.backend}: {self.reason}"


def choose(spec: AttentionSpec, backend: str | None = None) -> Choice:
    """The ``impl="auto"`` rule, with its reason.

    Each available implementation that supports ``spec`` on ``backend`` (default: this machine's)
    offers a rank (:attr:`Implementation.auto_rank`); the lowest wins, ties going to the earlier
    registration. The ranks encode the project's evidence, documented with each implementation:
    on a TPU the maintained flash kernel (``splash``) from 512 keys and 128 queries, else
    ``jax.nn.dot_product_attention`` (``xla``); on GPU ``xla`` (cuDNN when it applies); on CPU
    ``xla`` until its float32 score matrix passes 1 GiB, then ``blockwise``; ``reference`` last.
    """
    backend = _backend(backend)
    ranked, refused = [], []
    for order, (name, impl) in enumerate(_load().items()):
        if not impl.available():
            refused.append((name, "not available on this machine"))
            continue
        reason = impl.supports(spec, backend)
        if reason is not None:
            refused.append((name, reason))
            continue
        rank = impl.auto_rank(spec, backend)
        if rank is None:
            refused.append((name, f"not an automatic choice on {backend}"))
            continue
        ranked.append((rank, order, name))
    if not ranked:
        raise UnsupportedInput(f"impl: no registered implementation supports this input on {backend}: "
                               + "; ".join(f"{n}: {r}" for n, r in refused))
    ranked.sort()
    name = ranked[0][2]
    others = ", ".join(f"{n} ({r:g})" for r, _, n in ranked[1:])
    reason = f"lowest auto rank ({ranked[0][0]:g}) among the candidates"
    if others:
        reason += f"; then {others}"
    return Choice(impl=name, backend=backend, reason=reason, refused=tuple(refused))


def choose_implementation(spec: AttentionSpec, backend: str | None = None) -> str:
    """The name :func:`choose` picks (``impl="auto"``)."""
    return choose(spec, backend).impl


def resolve(impl: str, spec: AttentionSpec, backend: str | None = None) -> Implementation:
    """The implementation that will serve ``spec``: checks availability and support, raising
    :class:`~tpuattn.errors.UnavailableImplementation` or :class:`~tpuattn.errors.UnsupportedInput`."""
    if not isinstance(impl, str):
        raise ValueError(f"impl: expected a string, got {impl!r}")
    backend = _backend(backend)
    if impl == "auto":
        choice = choose(spec, backend)
        log.debug("impl='auto' chose %s", choice)
        impl = choice.impl
    implementation = get_implementation(impl)
    if not implementation.available():
        raise UnavailableImplementation(
            f"impl: {impl!r} is not available on backend {jax.default_backend()!r}; "
            f"available here: {list(implementations())}")
    reason = implementation.supports(spec, backend)
    if reason is not None:
        raise UnsupportedInput(f"impl: {impl!r} does not support this input: {reason}")
    return implementation


def attention(q, k, v, *, causal=False, scale=None, segment_ids=None, window=None, softcap=None,
              impl="auto", **options):
    """Scaled dot-product attention behind one contract.

    Args:
      q: ``[batch, q_len, num_q_heads, head_dim]``.
      k, v: ``[batch, kv_len, num_kv_heads, head_dim]``; ``num_q_heads`` must be a multiple
        of ``num_kv_heads`` (GQA; MQA when it is 1). Query head ``h`` reads key/value head
        ``h // (num_q_heads // num_kv_heads)``.
      causal: keep keys ``j <= p_i`` where ``p_i = i + kv_len - q_len`` (bottom-right
        alignment; ``jax.nn.dot_product_attention`` aligns top-left).
      scale: logits are ``scale * q.k``; default ``1 / sqrt(head_dim)``.
      segment_ids: ``[batch, seq]`` ints (q_len == kv_len) or a pair
        ``(q_segment_ids [batch, q_len], kv_segment_ids [batch, kv_len])``.
      window: ``(left, right)`` keeps keys ``p_i - left <= j <= p_i + right``; an int ``w``
        means ``(w, w)``; ``None`` on one side leaves it unbounded.
      softcap: replace each logit ``s`` by ``softcap * tanh(s / softcap)`` before masking.
      impl: an implementation name from :func:`implementations`, or ``"auto"``
        (see :func:`choose`; the choice is logged at debug level on the ``tpuattn`` logger).
      **options: passed to the implementation (block sizes, for example).

    Returns:
      An array of q's shape and dtype. A query that sees no key returns zeros.
    """
    q, k, v, segments, spec = make_spec(q, k, v, causal=causal, scale=scale, segment_ids=segment_ids,
                                        window=window, softcap=softcap)
    return resolve(impl, spec).fn(q, k, v, segments, spec, **options)
