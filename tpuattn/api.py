"""The contract: one public function that every implementation sits behind.

:func:`attention` validates and normalises its inputs once (:func:`tpuattn.spec.make_spec`),
picks an implementation (by name, or by the ``auto`` rule: :func:`choose`) and calls it. The
implementations live in :mod:`tpuattn.impl` and :mod:`tpuattn.pallas`; each registers one
:class:`~tpuattn.registry.Implementation` record when its module is imported, on first use, from
:data:`IMPLEMENTATION_MODULES`. The machinery (:class:`~tpuattn.registry.Registry`) is the one the
decode contract uses too.
"""

from __future__ import annotations

from tpuattn import sinks as attention_sinks
from tpuattn.errors import UnavailableImplementation, UnsupportedInput
from tpuattn.options import option_descriptions
from tpuattn.registry import REGISTRY, Choice, Implementation, Subset, register
from tpuattn.spec import AttentionSpec, make_spec, normalise_sinks

# The built-in implementations: name -> (the module that registers it, its priority). A module is
# imported the first time its implementation is asked for; the priority breaks ``auto`` ties (lower
# wins), whatever order the modules happen to load in. A module of your own can call
# ``tpuattn.register`` directly instead.
IMPLEMENTATION_MODULES = {
    "reference": ("tpuattn.impl.reference", 10),
    "xla": ("tpuattn.impl.xla", 20),
    "blockwise": ("tpuattn.impl.blockwise", 30),
    "pallas": ("tpuattn.pallas", 40),
    "splash": ("tpuattn.impl.splash", 50),
    "tokamax": ("tpuattn.impl.tokamax", 60),
    "lesson": ("tpuattn.lesson.flash", 70),  # notebook 03's kernel: by name only, never by auto
}
for _name, (_module, _priority) in IMPLEMENTATION_MODULES.items():
    REGISTRY.declare(_name, _module, priority=_priority)

# The implementations :mod:`tpuattn.parallel` can run as its local kernel, ranked by ``partial_rank``.
RETURNS_PARTIALS = Subset("returns partial results", lambda record: record.partial is not None,
                          rank="partial_rank")
# The implementations that take ``sinks``: those whose function takes them itself (splash), and those
# that return partial results, with which the sink is merged as one more (:mod:`tpuattn.sinks`);
# ``"auto"`` ranks them as it does without sinks.
TAKES_SINKS = Subset("takes sinks (itself, or by returning partial results the sink is merged with)",
                     lambda record: record.takes_sinks or record.partial is not None)

__all__ = ["RETURNS_PARTIALS", "TAKES_SINKS", "AttentionSpec", "Choice", "Implementation",
           "UnavailableImplementation", "UnsupportedInput", "attention", "choose", "choose_implementation",
           "get_implementation", "implementations", "known_implementations", "make_spec", "options_of",
           "register", "resolve", "unavailable_implementations"]


def _load() -> dict[str, Implementation]:
    """Every record, the built-ins imported (those whose module failed stand in as unavailable)."""
    return REGISTRY.records()


def known_implementations() -> tuple[str, ...]:
    """Every implementation name, available here or not (imports nothing)."""
    return REGISTRY.known()


def implementations(subset: Subset | None = None) -> tuple[str, ...]:
    """Names of the implementations usable on this machine (in ``subset``, if given)."""
    return REGISTRY.available(subset)


def unavailable_implementations() -> dict[str, str]:
    """``{name: why}`` for the implementations that cannot run here (an import error, for instance)."""
    return REGISTRY.unavailable()


def get_implementation(name: str) -> Implementation:
    """The registered record for ``name`` (importing its module on first use)."""
    return REGISTRY.get(name)


def options_of(impl: str) -> dict[str, str]:
    """``{option: what it is}`` for the implementation named ``impl`` (importing its module on first use):
    the fields of its :mod:`tpuattn.options` record with their types and defaults, then the old
    spellings it still reads, each with the field it is read into. ``{}``: it takes no options.

    ``tpuattn.options_of("pallas")`` -> ``{"blocks": "Blocks | None = None", "backward": ...,
    "interpret": ..., "block_q": "old spelling, read as blocks.block_q", ...}``.
    """
    return option_descriptions(REGISTRY.get(impl).options)


def choose(spec: AttentionSpec, backend: str | None = None, *, subset: Subset | None = None) -> Choice:
    """The ``impl="auto"`` rule, with its reason and the refused implementations.

    Each available implementation that supports ``spec`` on ``backend`` (default: the target's,
    :func:`tpuattn.chips.target_backend`) offers a rank (:attr:`Implementation.auto_rank`); the
    lowest wins, ties going to the lower :attr:`~Implementation.priority` (never the order of
    registration). The ranks encode the project's evidence, documented with each implementation:
    on a TPU the maintained flash kernel (``splash``) from 512 keys and 128 queries, else
    ``jax.nn.dot_product_attention`` (``xla``); on GPU ``xla`` (cuDNN when it applies); on CPU
    ``xla`` until its float32 score matrix passes 1 GiB, then ``blockwise``; ``reference`` last.
    With ``subset`` (:data:`RETURNS_PARTIALS`), only its implementations, ranked by its field.
    """
    return REGISTRY.choose(spec, backend, subset=subset)


def choose_implementation(spec: AttentionSpec, backend: str | None = None) -> str:
    """The name :func:`choose` picks (``impl="auto"``)."""
    return choose(spec, backend).impl


def resolve(impl: str, spec: AttentionSpec, backend: str | None = None, *,
            subset: Subset | None = None, options=()) -> Implementation:
    """The implementation that will serve ``spec``: checks availability and support, raising
    :class:`~tpuattn.errors.UnavailableImplementation` or :class:`~tpuattn.errors.UnsupportedInput`
    (also for ``"auto"`` when its choice takes none of the option names in ``options``, the
    implementation's knobs, which never steer the choice)."""
    return REGISTRY.resolve(impl, spec, backend, subset=subset, options=options)


def attention(q, k, v, *, causal=False, scale=None, segment_ids=None, window=None, softcap=None,
              sinks=None, impl="auto", **options):
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
      sinks: ``[num_q_heads]`` floats: one logit per query head in every row's softmax denominator
        that adds no value (attention sinks, :mod:`tpuattn.sinks`); differentiable. Taken by the
        implementations that return partial results (``reference``, ``blockwise``, ``pallas``) and
        by ``splash`` (JAX's kernel has its own); ``"auto"`` chooses among them; ``xla`` refuses.
      impl: an implementation name from :func:`implementations`, or ``"auto"``
        (see :func:`choose`; the choice is logged at debug level on the ``tpuattn`` logger).
      **options: passed to the implementation (block sizes, for example). They never steer
        ``"auto"``: an option its choice does not take is refused (``UnsupportedInput``) with the
        choice and the implementations that take it; name one of those as ``impl``.

    Returns:
      An array of q's shape and dtype. A query that sees no key returns zeros.
    """
    q, k, v, segments, spec = make_spec(q, k, v, causal=causal, scale=scale, segment_ids=segment_ids,
                                        window=window, softcap=softcap)
    if sinks is None:
        return resolve(impl, spec, options=options).fn(q, k, v, segments, spec, **options)
    sinks = normalise_sinks(sinks, spec.num_q_heads)
    record = resolve(impl, spec, subset=TAKES_SINKS, options=options)
    if record.takes_sinks:
        return record.fn(q, k, v, segments, spec, sinks=sinks, **options)
    return attention_sinks.attention(record.partial, q, k, v, segments, spec, sinks, **options)
