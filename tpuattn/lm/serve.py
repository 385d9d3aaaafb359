"""Serving: prefill, a paged KV cache, and continuous batching of greedy decoding.

How it works, one loop iteration at a time (:func:`serve`):

1. **Admit.** While a batch slot is empty and a prompt waits, the prompt takes the pages it will need
   (``ceil((prompt + new tokens) / page_size)``) from the :class:`PageAllocator`'s free list, is run
   through the model once (*prefill*, :func:`tpuattn.attention` over the whole prompt), and its keys
   and values are written into those pages. Its first new token is the argmax of the last logits.
2. **Decode.** Every occupied slot advances by one token in one call of the model's
   :meth:`~tpuattn.lm.transformer.Transformer.decode_step` (:func:`tpuattn.decode.attention` with the page
   table). Empty slots ride along with length 0 and a page table of the *scratch page* (page 0, never
   handed out), so the step's shapes never change and it compiles once.
3. **Retire.** A sequence that has its tokens gives its pages back; the next prompt takes them.

With ``chunk=C`` the server steps as TPU inference engines do (continuous batching with chunked
prefill): an admitted prompt is not prefilled in a call of its own but fed ``C`` tokens a step beside
the running decodes, all in one call of :meth:`~tpuattn.lm.transformer.Transformer.mixed_step` (a ragged
batch: :func:`tpuattn.decode.attention` with ``cu_q_lens``), so a new prompt never stalls the others.
``cache_dtype="int8"`` or ``"float8_e4m3fn"`` (with ``chunk``) keeps the KV cache quantized, one byte
an entry, with per-layer, per-kv-head scales from :func:`calibrate`.

:func:`recompute` is the check: greedy decoding that runs the whole sequence through the model at
every step, with no cache at all.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tpuattn._checks import is_int, positive_int
from tpuattn.decode.quant import QMAX
from tpuattn.lm.transformer import VOCAB, PagedCache

__all__ = ["SCRATCH_PAGE", "PageAllocator", "Served", "calibrate", "recompute", "serve"]

SCRATCH_PAGE = 0  # empty slots write here; never handed to a sequence


class PageAllocator:
    """A free list of KV-cache pages ``1 .. num_pages - 1`` (page 0 is the scratch page).

    ``take(n)`` hands out ``n`` free pages, most recently returned first (so freed pages are reused at
    once); ``give_back(pages)`` returns them. Taking more than is free, or giving back a page that is
    not in use, raises ``ValueError``. ``reused`` counts pages handed out again after being returned.
    """

    def __init__(self, num_pages: int):
        num_pages = positive_int("num_pages", num_pages)
        if num_pages < 2:
            raise ValueError(f"num_pages: expected at least 2 (page 0 is the scratch page), got {num_pages}")
        self.num_pages = num_pages
        self.free = list(range(num_pages - 1, 0, -1))  # a stack: pop() gives the last returned page
        self.in_use: set[int] = set()
        self.returned: set[int] = set()
        self.reused = 0

    def take(self, n: int) -> list[int]:
        n = positive_int("n", n)
        if n > len(self.free):
            raise ValueError(f"n: asked for {n} pages, {len(self.free)} free of {self.num_pages - 1}")
        pages = [self.free.pop() for _ in range(n)]
        assert not self.in_use.intersection(pages), "the free list held a page in use"
        self.in_use.update(pages)
        self.reused += len(self.returned.intersection(pages))
        return pages

    def give_back(self, pages) -> None:
        pages = [int(p) for p in pages]
        stray = [p for p in pages if p not in self.in_use]
        if stray or len(set(pages)) != len(pages):
            raise ValueError(f"pages: expected distinct pages in use, got {pages} (not in use: {stray})")
        self.in_use.difference_update(pages)
        self.returned.update(pages)
        self.free.extend(reversed(pages))


@dataclasses.dataclass
class Served:
    """What :func:`serve` did: ``tokens[i]`` the new tokens of prompt ``i``; ``events`` one tuple per
    admission or retirement ``(step, "admit" | "retire", prompt index, slot, pages)``; ``steps`` the
    number of decode steps; ``reused`` pages handed out again; ``logits[i]`` (when asked for)
    ``[new tokens, 256]``, the logits each new token was chosen from."""

    tokens: list
    events: list
    steps: int
    reused: int
    logits: list | None = None


def _check_prompts(prompts, max_new_tokens):
    if not isinstance(prompts, list | tuple) or not prompts:
        raise ValueError(f"prompts: expected a non-empty list of 1-D byte-id arrays, got "
                         f"{type(prompts).__name__}")
    checked = []
    for i, prompt in enumerate(prompts):
        prompt = np.asarray(prompt)
        if prompt.ndim != 1 or len(prompt) == 0 or not np.issubdtype(prompt.dtype, np.integer):
            raise ValueError(f"prompts[{i}]: expected a non-empty 1-D integer array, got {prompt.dtype} "
                             f"{prompt.shape}")
        if prompt.min() < 0 or prompt.max() >= VOCAB:
            raise ValueError(f"prompts[{i}]: byte ids must be in [0, {VOCAB}), got [{prompt.min()}, "
                             f"{prompt.max()}]")
        checked.append(prompt.astype(np.int32))
    news = [max_new_tokens] * len(checked) if is_int(max_new_tokens) else list(max_new_tokens)
    if len(news) != len(checked):
        raise ValueError(f"max_new_tokens: expected an int or one per prompt ({len(checked)}), got "
                         f"{len(news)}")
    return checked, [positive_int(f"max_new_tokens[{i}]", n) for i, n in enumerate(news)]


def serve(model, prompts, max_new_tokens, *, slots: int = 2, page_size: int = 8, num_pages: int = 16,
          pages_per_sequence: int | None = None, impl: str | None = None, decode_impl: str | None = None,
          keep_logits: bool = False, chunk: int | None = None, cache_dtype: str | None = None,
          headroom: float = 1.25) -> Served:
    """Greedy decoding of every prompt with continuous batching over a paged KV cache.

    Args:
      model: a :class:`~tpuattn.lm.transformer.Transformer`.
      prompts: a list of 1-D byte-id arrays, any lengths.
      max_new_tokens: how many tokens to generate, one int or one per prompt.
      slots: sequences decoded together (the decode batch).
      page_size, num_pages: the cache's pages (page 0 is the scratch page, so ``num_pages - 1`` are
        handed out).
      pages_per_sequence: the page table's width (default: the most any prompt needs).
      impl, decode_impl: the prefill's and decode's implementations (default: the model's).
      keep_logits: also return the logits each token was chosen from.
      chunk: step mixed batches: each step feeds every prefilling prompt its next ``chunk`` tokens
        beside one token of every decoding sequence, in one call (``slots * chunk`` token rows, so it
        compiles once). ``None``: prefill each prompt in a call of its own, then decode.
      cache_dtype: with ``chunk``, ``"int8"`` or ``"float8_e4m3fn"`` for a quantized KV cache (scales
        from :func:`calibrate` over the prompts, times ``headroom``); ``None``: the model's dtype.
    """
    prompts, news = _check_prompts(prompts, max_new_tokens)
    slots, page_size = positive_int("slots", slots), positive_int("page_size", page_size)
    if cache_dtype is not None and chunk is None:
        raise ValueError(f"cache_dtype: a quantized cache needs the mixed-batch server (chunk=...), got "
                         f"cache_dtype={cache_dtype!r} with chunk=None")
    if cache_dtype is not None and cache_dtype not in QMAX:
        raise ValueError(f"cache_dtype: expected None, 'int8' or 'float8_e4m3fn', got {cache_dtype!r}")
    pages = PageAllocator(num_pages)
    need = [-(-(len(p) + n) // page_size) for p, n in zip(prompts, news, strict=True)]
    width = (max(need) if pages_per_sequence is None
             else positive_int("pages_per_sequence", pages_per_sequence))
    for i, n in enumerate(need):
        if n > width or n > num_pages - 1:
            raise ValueError(f"prompts[{i}]: needs {n} pages of {page_size} for {len(prompts[i])} + "
                             f"{news[i]} tokens; pages_per_sequence={width}, num_pages - 1={num_pages - 1}")

    if chunk is not None:
        chunk = positive_int("chunk", chunk)
        cache = _mixed_cache(model, prompts, num_pages, page_size, cache_dtype, headroom)
        return _serve_mixed(model, prompts, news, need, width, slots, pages, cache, chunk,
                            decode_impl, keep_logits)
    graphdef, state = nnx.split(model)  # jit the functions of the weights (Flax 0.11 and 0.12 alike)
    prefill = jax.jit(lambda state, tokens: nnx.merge(graphdef, state).prefill(tokens, impl=impl))
    step = jax.jit(lambda state, *args: nnx.merge(graphdef, state).decode_step(*args, impl=decode_impl))
    cache = PagedCache.empty(model.config, num_pages, page_size)
    table = np.full((slots, width), SCRATCH_PAGE, np.int32)
    positions = np.zeros(slots, np.int32)  # the next token's position (the sequence's length so far)
    last = np.zeros(slots, np.int32)  # the next token, not yet in the cache
    owner = [None] * slots  # prompt index in each slot
    out = [[] for _ in prompts]
    kept = [[] for _ in prompts] if keep_logits else None
    waiting, events, steps = deque(range(len(prompts))), [], 0

    def emit(i, logits):
        token = int(np.argmax(logits))
        out[i].append(token)
        if keep_logits:
            kept[i].append(np.asarray(logits, np.float32))
        return token

    while waiting or any(o is not None for o in owner):
        for slot in range(slots):  # 1. admit
            if owner[slot] is None and waiting and need[waiting[0]] <= len(pages.free):
                i = waiting.popleft()
                taken = pages.take(need[i])
                logits, kvs = prefill(state, prompts[i][None])
                rows = np.arange(len(prompts[i]))
                page_ids = jnp.asarray(np.asarray(taken)[rows // page_size])
                k = jnp.stack([kv[0][0] for kv in kvs])  # [layers, prompt, kv_heads, D]
                v = jnp.stack([kv[1][0] for kv in kvs])
                cache = PagedCache(cache.k.at[:, page_ids, rows % page_size].set(k),
                                   cache.v.at[:, page_ids, rows % page_size].set(v))
                table[slot] = SCRATCH_PAGE
                table[slot, :len(taken)] = taken
                owner[slot], positions[slot] = i, len(prompts[i])
                last[slot] = emit(i, logits[0, -1])
                events.append((steps, "admit", i, slot, tuple(taken)))
        for slot in range(slots):  # 3. retire (a sequence may be done right after its prefill)
            i = owner[slot]
            if i is not None and len(out[i]) == news[i]:
                taken = [int(p) for p in table[slot] if p != SCRATCH_PAGE]
                pages.give_back(taken)
                events.append((steps, "retire", i, slot, tuple(taken)))
                owner[slot], table[slot], positions[slot], last[slot] = None, SCRATCH_PAGE, 0, 0
        if not any(o is not None for o in owner):
            continue
        logits, cache = step(state, jnp.asarray(last), jnp.asarray(positions), cache,  # 2. decode
                             jnp.asarray(table))
        logits, steps = np.asarray(logits), steps + 1
        for slot in range(slots):
            if owner[slot] is not None:
                positions[slot] += 1
                last[slot] = emit(owner[slot], logits[slot])
    return Served([np.asarray(t, np.int32) for t in out], events, steps, pages.reused,
                  [np.stack(k) for k in kept] if keep_logits else None)


def calibrate(model, prompts, dtype: str, *, headroom: float = 1.25, impl: str | None = None):
    """A quantized cache's fixed scales: ``(k_scale, v_scale)``, float32 ``[layers, kv_heads]``.

    Each is the largest ``|key|`` (``|value|``) the prompts' prefill writes per layer and kv head, times
    ``headroom`` (room for the decoded tokens' keys, which may be larger; beyond it an entry saturates),
    over ``QMAX[dtype]`` (127 for int8, 448 for float8_e4m3fn), as engines calibrate KV-cache scales
    offline. A head that only ever holds zeros gets scale 1."""
    if dtype not in QMAX:
        raise ValueError(f"dtype: expected 'int8' or 'float8_e4m3fn', got {dtype!r}")
    if not (isinstance(headroom, int | float) and headroom >= 1):
        raise ValueError(f"headroom: expected a number >= 1, got {headroom!r}")
    prompts, _ = _check_prompts(prompts, 1)
    # One prefill of every prompt, padded at the end to the longest (causal: padding after a prompt
    # changes none of its keys and values); the padding's rows are left out of the maximum.
    tokens = np.zeros((len(prompts), max(len(p) for p in prompts)), np.int32)
    for i, prompt in enumerate(prompts):
        tokens[i, :len(prompt)] = prompt
    valid = np.arange(tokens.shape[1])[None] < np.array([len(p) for p in prompts])[:, None]
    amax = np.zeros((2, model.config.layers, model.config.kv_heads))
    for layer, kv in enumerate(model.prefill(jnp.asarray(tokens), impl=impl)[1]):
        for which in (0, 1):
            x = np.abs(np.asarray(kv[which], np.float32))  # [prompts, seq, kv_heads, head_dim]
            amax[which, layer] = np.where(valid[:, :, None, None], x, 0).max(axis=(0, 1, 3))
    scales = np.where(amax > 0, amax * headroom / QMAX[dtype], 1.0).astype(np.float32)
    return jnp.asarray(scales[0]), jnp.asarray(scales[1])


def _mixed_cache(model, prompts, num_pages, page_size, cache_dtype, headroom):
    if cache_dtype is None:
        return PagedCache.empty(model.config, num_pages, page_size)
    k_scale, v_scale = calibrate(model, prompts, cache_dtype, headroom=headroom)
    return PagedCache.empty(model.config, num_pages, page_size, dtype=cache_dtype, k_scale=k_scale,
                            v_scale=v_scale)


def _serve_mixed(model, prompts, news, need, width, slots, pages, cache, chunk, decode_impl,
                 keep_logits) -> Served:
    """:func:`serve` with ``chunk``: every step one ragged batch of prompt chunks and decoded tokens."""
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda state, *args: nnx.merge(graphdef, state).mixed_step(*args, impl=decode_impl))
    total = slots * chunk  # token rows a step: every slot may feed a whole chunk
    table = np.full((slots, width), SCRATCH_PAGE, np.int32)
    length = np.zeros(slots, np.int32)  # tokens of the sequence in the cache
    last = np.zeros(slots, np.int32)  # a decoding sequence's next token, not yet in the cache
    owner = [None] * slots
    out = [[] for _ in prompts]
    kept = [[] for _ in prompts] if keep_logits else None
    waiting, events, steps = deque(range(len(prompts))), [], 0

    while waiting or any(o is not None for o in owner):
        for slot in range(slots):  # admit: pages now, the prompt's tokens a chunk a step from here on
            if owner[slot] is None and waiting and need[waiting[0]] <= len(pages.free):
                i = waiting.popleft()
                taken = pages.take(need[i])
                table[slot] = SCRATCH_PAGE
                table[slot, :len(taken)] = taken
                owner[slot], length[slot] = i, 0
                events.append((steps, "admit", i, slot, tuple(taken)))
        tokens = np.zeros(total, np.int32)
        positions = np.full(total, -1, np.int32)  # -1: padding, never written
        seq = np.zeros(total, np.int32)
        cu = np.zeros(slots + 1, np.int32)
        ends = length.copy()
        for slot in range(slots):  # one ragged batch: each slot's new tokens, one after the other
            i, start = owner[slot], cu[slot]
            if i is None:
                new = np.zeros(0, np.int32)
            elif length[slot] < len(prompts[i]):  # prefilling: the prompt's next chunk
                new = prompts[i][length[slot]:length[slot] + chunk]
            else:  # decoding: the last emitted token
                new = last[slot:slot + 1]
            n = len(new)
            tokens[start:start + n] = new
            positions[start:start + n] = length[slot] + np.arange(n)
            seq[start:start + n] = slot
            cu[slot + 1] = start + n
            ends[slot] = length[slot] + n
        logits, cache = step(state, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(seq),
                             jnp.asarray(cu), jnp.asarray(ends), cache, jnp.asarray(table))
        logits, steps = np.asarray(logits), steps + 1
        for slot in range(slots):
            i = owner[slot]
            if i is None:
                continue
            length[slot] = ends[slot]
            if length[slot] < len(prompts[i]):
                continue  # mid-prompt: nothing to emit yet
            row = logits[cu[slot + 1] - 1]  # the sequence's last token predicts the next
            out[i].append(int(np.argmax(row)))
            if keep_logits:
                kept[i].append(row.astype(np.float32))
            last[slot] = out[i][-1]
            if len(out[i]) == news[i]:  # retire
                taken = [int(p) for p in table[slot] if p != SCRATCH_PAGE]
                pages.give_back(taken)
                events.append((steps, "retire", i, slot, tuple(taken)))
                owner[slot], table[slot], length[slot], last[slot] = None, SCRATCH_PAGE, 0, 0
    return Served([np.asarray(t, np.int32) for t in out], events, steps, pages.reused,
                  [np.stack(k) for k in kept] if keep_logits else None)


def recompute(model, prompt, max_new_tokens: int, *, impl: str | None = None, keep_logits: bool = False):
    """Greedy decoding without a cache: the whole sequence through the model at every step.

    Returns the new tokens, ``int32 [max_new_tokens]`` (and their logits ``[max_new_tokens, 256]``
    when ``keep_logits``)."""
    (prompt,), (n,) = _check_prompts([prompt], max_new_tokens)
    # Causal attention: tokens after position t change nothing at t, so one padded length serves every
    # step (one compile), and the logits at the last real position are those of the sequence alone.
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens, impl=impl)[0])
    tokens, logits, padded = list(prompt), [], len(prompt) + n - 1
    for _ in range(n):
        row = np.zeros(padded, np.int32)
        row[:len(tokens)] = tokens
        last = np.asarray(forward(state, jnp.asarray(row)[None])[len(tokens) - 1])
        logits.append(last)
        tokens.append(int(np.argmax(last)))
    new = np.asarray(tokens[len(prompt):], np.int32)
    return (new, np.stack(logits)) if keep_logits else new
