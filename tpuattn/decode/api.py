"""The decode contract: :func:`attention` over a KV cache, :func:`implementations`, the ``auto`` rule."""

from __future__ import annotations

import importlib

from tpuattn import chips
from tpuattn.decode import registry
from tpuattn.decode.spec import DecodeSpec, make_decode_spec
from tpuattn.errors import UnavailableImplementation, UnsupportedInput

IMPLEMENTATION_MODULES = ("tpuattn.decode.reference", "tpuattn.decode.kernel", "tpuattn.decode.native")
_LOADED = False


def _load() -> dict[str, registry.DecodeImplementation]:
    global _LOADED
    if not _LOADED:
        for module in IMPLEMENTATION_MODULES:
            importlib.import_module(module)
        _LOADED = True
    return registry.registered()


def known_implementations() -> tuple[str, ...]:
    """Every registered decode implementation, available here or not."""
    return tuple(_load())


def implementations() -> tuple[str, ...]:
    """The decode implementations usable on this machine."""
    return tuple(name for name, impl in _load().items() if impl.available())


def get_implementation(name: str) -> registry.DecodeImplementation:
    known = _load()
    if name not in known:
        raise ValueError(f"impl: expected one of {sorted(known) + ['auto']}, got {name!r}")
    return known[name]


def choose(spec: DecodeSpec, backend: str | None = None) -> str:
    """``impl="auto"``: ``pallas`` on a TPU (the target chip's, see :func:`tpuattn.chips.target`),
    ``reference`` elsewhere (the kernel only interprets off a TPU); the lowest ``auto_rank`` wins."""
    backend = chips.target_backend() if backend is None else backend
    ranked = []
    for order, (name, impl) in enumerate(_load().items()):
        if not impl.available() or impl.supports(spec, backend) is not None:
            continue
        rank = impl.auto_rank(spec, backend)
        if rank is not None:
            ranked.append((rank, order, name))
    if not ranked:
        raise UnsupportedInput(f"impl: no decode implementation supports this input on {backend}")
    return min(ranked)[2]


def resolve(impl: str, spec: DecodeSpec, backend: str | None = None) -> registry.DecodeImplementation:
    if not isinstance(impl, str):
        raise ValueError(f"impl: expected a string, got {impl!r}")
    backend = chips.target_backend() if backend is None else backend
    if impl == "auto":
        impl = choose(spec, backend)
    record = get_implementation(impl)
    if not record.available():
        raise UnavailableImplementation(f"impl: {impl!r} is not available with this JAX; available here: "
                                        f"{list(implementations())}")
    reason = record.supports(spec, backend)
    if reason is not None:
        raise UnsupportedInput(f"impl: {impl!r} does not support this input: {reason}")
    return record


def attention(q, k_cache, v_cache, lengths, *, page_table=None, scale=None, window=None, softcap=None,
              impl="auto", **options):
    """Attention of a few new queries per sequence over a KV cache (one decode step), forward only.

    Args:
      q: ``[batch, q_len, heads, head_dim]``; ``q_len`` is small (1 for plain decode; more for
        speculative decoding or chunked prefill).
      k_cache, v_cache: contiguous ``[batch, max_len, kv_heads, head_dim]``, or with ``page_table``
        paged ``[num_pages, page_size, kv_heads, head_dim]``. ``heads`` must be a multiple of
        ``kv_heads`` (GQA): query head ``h`` reads kv head ``h // (heads // kv_heads)``.
      lengths: int ``[batch]``: valid positions per sequence, in ``[0, capacity]``. The queries are the
        last ``q_len`` of them: query ``t`` sits at position ``lengths[b] - q_len + t`` and sees keys
        ``j <= `` its position (bottom-right causal); positions ``>= lengths[b]`` never contribute. A
        query row at a negative position (``lengths[b] < q_len``) and every row of a sequence of
        length 0 return zeros.
      page_table: int32 ``[batch, pages_per_sequence]``: sequence ``b``'s position ``j`` is row
        ``j % page_size`` of page ``page_table[b, j // page_size]``. Entries past a sequence's last used
        page are never read.
      scale: logits are ``scale * q.k``; default ``1 / sqrt(head_dim)``.
      window: an int ``w`` or ``(left, right)`` as in :func:`tpuattn.attention`, relative to each
        query's position (with the causal mask only ``left`` narrows anything).
      softcap: logits ``s`` become ``softcap * tanh(s / softcap)``.
      impl: ``"auto"`` (``pallas`` on a TPU, ``reference`` elsewhere), ``"reference"``, ``"pallas"``,
        ``"jax_paged"``, ``"jax_ragged"`` (see :func:`implementations`).
      **options: for the implementation (``pallas``: ``block_size``, ``chunk_blocks``, ``interpret``).

    Bad shapes, dtypes, lengths outside ``[0, capacity]`` and page ids in use outside
    ``[0, num_pages)`` raise ``ValueError``/``TypeError``; the value checks need concrete arrays (under
    ``jax.jit`` lengths are clamped into range and page ids into ``[0, num_pages)`` instead, see
    :mod:`tpuattn.decode.spec`). Decode is inference: no implementation defines a backward pass for
    ``pallas``/``jax_*`` (differentiating them fails inside ``pallas_call``); ``reference`` is plain JAX.

    Returns:
      An array of q's shape and dtype.
    """
    q, k_cache, v_cache, lengths, page_table, spec = make_decode_spec(
        q, k_cache, v_cache, lengths, page_table, scale=scale, window=window, softcap=softcap)
    return resolve(impl, spec).fn(q, k_cache, v_cache, lengths, page_table, spec, **options)
