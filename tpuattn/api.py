"""The contract: one public function that every implementation sits behind.

``attention`` validates and normalises its inputs once, builds an
:class:`AttentionSpec` and hands it to a registered implementation. An
implementation is a function ``fn(q, k, v, segment_ids, spec, **options)``
where ``segment_ids`` is ``None`` or a pair ``(q_segment_ids [batch, q_len],
kv_segment_ids [batch, kv_len])`` of int32 arrays; it returns an array of q's
shape and dtype. Adding an implementation touches one new module and one line
in :data:`IMPLEMENTATION_MODULES`.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tpuattn.masks import MaskSpec

# Every implementation module, imported lazily on first use. Each module calls
# ``register`` at import time. One line per implementation.
IMPLEMENTATION_MODULES = (
    "tpuattn.reference",
    "tpuattn.blockwise",
    "tpuattn.pallas",
    "tpuattn.native",
)

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """An already-validated description of one attention problem.

    Shapes follow ``[batch, seq, heads, head_dim]`` everywhere.
    """

    batch: int
    q_len: int
    kv_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: Any
    scale: float
    softcap: float | None
    mask: MaskSpec

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (1 = MHA, num_q_heads = MQA)."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def causal(self) -> bool:
        return self.mask.causal

    @property
    def window(self):
        return self.mask.window

    @property
    def has_segments(self) -> bool:
        return self.mask.has_segments


@dataclasses.dataclass(frozen=True)
class Implementation:
    """A registered implementation and what it can do."""

    name: str
    fn: Callable
    description: str
    available: Callable[[], bool] = lambda: True
    # Return None if the implementation supports ``spec``, else a reason string.
    supports: Callable[[AttentionSpec], str | None] = lambda spec: None


_REGISTRY: dict[str, Implementation] = {}
_LOADED = False


def register(name: str, fn: Callable, *, description: str, available=None, supports=None) -> None:
    """Register an implementation under ``name`` (called by implementation modules)."""
    kwargs = {}
    if available is not None:
        kwargs["available"] = available
    if supports is not None:
        kwargs["supports"] = supports
    _REGISTRY[name] = Implementation(name=name, fn=fn, description=description, **kwargs)


def _load() -> dict[str, Implementation]:
    global _LOADED
    if not _LOADED:
        for module in IMPLEMENTATION_MODULES:
            importlib.import_module(module)
        _LOADED = True
    return _REGISTRY


def known_implementations() -> tuple[str, ...]:
    """Every registered implementation name, available here or not."""
    return tuple(_load())


def implementations() -> tuple[str, ...]:
    """Names of the implementations usable on this machine's default backend."""
    return tuple(name for name, impl in _load().items() if impl.available())


def get_implementation(name: str) -> Implementation:
    registry = _load()
    if name not in registry:
        raise ValueError(f"impl: expected one of {sorted(registry) + ['auto']}, got {name!r}")
    return registry[name]


# ---------------------------------------------------------------------------- validation
def _shape_of(name: str, x) -> tuple[int, ...]:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
    return tuple(x.shape)


def _check_number(name: str, value, *, allow_none: bool = True) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ValueError(f"{name}: expected a positive Python number or None, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: expected a positive finite number, got {value!r}")
    return value


def _normalise_window(window) -> tuple[int | None, int | None] | None:
    if window is None:
        return None
    if isinstance(window, int | np.integer) and not isinstance(window, bool):
        window = (int(window), int(window))
    if not isinstance(window, tuple | list) or len(window) != 2:
        raise ValueError(f"window: expected an int or a pair (left, right) of ints or None, got {window!r}")
    out = []
    for side, w in zip(("left", "right"), window, strict=True):
        if w is None:
            out.append(None)
            continue
        if isinstance(w, bool) or not isinstance(w, int | np.integer):
            raise ValueError(f"window: expected the {side} extent to be an int or None, got {w!r}")
        if w < 0:
            raise ValueError(f"window: expected a non-negative {side} extent, got {int(w)}")
        out.append(int(w))
    return (out[0], out[1])


def _normalise_segments(segment_ids, batch: int, q_len: int, kv_len: int):
    if segment_ids is None:
        return None
    if isinstance(segment_ids, tuple | list):
        if len(segment_ids) != 2:
            raise ValueError(
                "segment_ids: expected an array [batch, seq] or a pair (q_segment_ids, kv_segment_ids), "
                f"got a sequence of length {len(segment_ids)}"
            )
        q_seg, kv_seg = segment_ids
    else:
        if q_len != kv_len:
            raise ValueError(
                "segment_ids: a single array needs q_len == kv_len; pass (q_segment_ids, kv_segment_ids) "
                f"for q_len={q_len}, kv_len={kv_len}"
            )
        q_seg = kv_seg = segment_ids
    result = []
    for name, seg, length in (("q_segment_ids", q_seg, q_len), ("kv_segment_ids", kv_seg, kv_len)):
        shape = _shape_of(f"segment_ids ({name})", seg)
        if not jnp.issubdtype(seg.dtype, jnp.integer):
            raise ValueError(f"segment_ids ({name}): expected an integer dtype, got {seg.dtype}")
        if shape != (batch, length):
            raise ValueError(f"segment_ids ({name}): expected shape {(batch, length)}, got {shape}")
        result.append(jnp.asarray(seg, jnp.int32))
    return tuple(result)


def make_spec(q, k, v, *, causal=False, scale=None, segment_ids=None, window=None, softcap=None):
    """Validate the contract's inputs; return ``(q, k, v, segment_ids, spec)`` normalised."""
    q_shape, k_shape, v_shape = _shape_of("q", q), _shape_of("k", k), _shape_of("v", v)
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(shape) != 4:
            raise ValueError(f"{name}: expected rank 4 [batch, seq, heads, head_dim], got shape {shape}")
    if k_shape != v_shape:
        raise ValueError(f"k and v: expected the same shape, got k {k_shape} and v {v_shape}")
    batch, q_len, num_q_heads, head_dim = q_shape
    kb, kv_len, num_kv_heads, kd = k_shape
    if kb != batch:
        raise ValueError(f"k: expected batch {batch} (q's batch), got {kb}")
    if kd != head_dim:
        raise ValueError(f"k: expected head_dim {head_dim} (q's head_dim), got {kd}")
    for name, n in (("q", q_len), ("k", kv_len)):
        if n < 1:
            raise ValueError(f"{name}: expected a sequence length of at least 1, got {n}")
    if min(batch, num_q_heads, num_kv_heads, head_dim) < 1:
        raise ValueError(f"q, k: expected non-empty batch, heads and head_dim, got q {q_shape}, k {k_shape}")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"q: expected a number of heads divisible by k's {num_kv_heads} heads (GQA), got {num_q_heads}"
        )
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1:
        raise TypeError(f"q, k, v: expected one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    dtype = dtypes.pop()
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q, k, v: expected a dtype in {[str(d) for d in SUPPORTED_DTYPES]}, got {dtype}")
    if not isinstance(causal, bool | np.bool_):
        raise ValueError(f"causal: expected a bool, got {causal!r}")
    scale = _check_number("scale", scale)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    softcap = _check_number("softcap", softcap)
    window = _normalise_window(window)
    segments = _normalise_segments(segment_ids, batch, q_len, kv_len)
    mask = MaskSpec(q_len=q_len, kv_len=kv_len, causal=bool(causal), window=window,
                    has_segments=segments is not None)
    spec = AttentionSpec(batch=batch, q_len=q_len, kv_len=kv_len, num_q_heads=num_q_heads,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, scale=scale,
                         softcap=softcap, mask=mask)
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), segments, spec


def choose_implementation(spec: AttentionSpec, backend: str | None = None) -> str:
    """The ``impl="auto"`` rule: the platform's maintained attention unless evidence says otherwise.

    ``backend`` is ``"tpu"``, ``"gpu"`` or ``"cpu"`` (default: ``jax.default_backend()``). The
    rule walks a preference list and returns the first implementation that is registered,
    available here and supports ``spec`` (``xla`` refuses softcap, ``splash`` float16);
    ``reference`` is the last resort and supports everything.

    * **TPU**: ``splash`` when ``q_len >= 128`` and ``kv_len >= 512``, else ``xla``.
      Evidence: *modelled* only (``tpuattn.roofline``, v5e and v6e, bf16, 8 heads of 128):
      the flash schedule's lower bound is 4-10x below the materialised one from 512 tokens
      (forward; 3-8x forward+backward), because the scores never reach HBM and causal
      tiles are skipped. Below 512 tokens both take microseconds and splash pads every
      sequence to 128-row tiles; with ``q_len < 128`` (decoding) it would pad the queries
      up to 128 rows, so ``xla`` is kept there. No TPU was measured for this rule:
      notebook 05 on a TPU runtime is the measurement that should replace these numbers.
    * **GPU**: ``xla``, which dispatches to cuDNN's fused kernel when the case allows
      (bf16/f16, no segment ids, square causal); splash and the Pallas kernel are TPU kernels.
    * **CPU**: ``xla``, unless its float32 score matrix (``batch * heads * q_len * kv_len * 4``
      bytes) would pass 1 GiB; then ``blockwise``, whose memory is linear in the length.
      Evidence, *measured* here (2-core CPU shared with other jobs, so +-30%; JAX 0.10.2, f32,
      batch 1, 4 heads of 64, median ms forward / forward+backward): at 128 tokens xla 1.0 /
      2.1, reference 1.3 / 3.2, blockwise 0.9 / 3.4; at 512 xla 15 / 88, reference 22 / 120,
      blockwise 25 / 112; at 1024 xla 228 / 448, reference 446 / 876, blockwise 109 / 521;
      at 2048 xla 918 / 1664, reference 1877 / 3540, blockwise 477 / 2212. So ``xla`` is ~2x
      faster than ``reference`` from 512 tokens (below, differences are within this machine's
      noise); ``blockwise`` is 2-4x faster *forward only* from 1024 tokens
      (its tiles stay in cache, masked tiles are skipped) while ``xla`` is 1.2-1.6x faster
      forward+backward. Neither wins everywhere, so the maintained path stays the default
      and memory decides. Notebook 04 re-measures this on the reader's machine.

    Materialising paths (``xla``, ``reference``) also hold ``batch * heads * q_len * kv_len``
    float32 scores; the streaming paths (``splash``, ``blockwise``, ``pallas``) do not.
    """
    backend = backend or jax.default_backend()
    registry = _load()
    if backend == "tpu":
        long_enough = spec.q_len >= 128 and spec.kv_len >= 512
        preferences = ["splash", "xla"] if long_enough else ["xla", "splash"]
    elif backend == "gpu":
        preferences = ["xla"]
    else:
        score_bytes = 4 * spec.batch * spec.num_q_heads * spec.q_len * spec.kv_len
        preferences = ["xla"] if score_bytes <= 1024**3 else ["blockwise", "xla"]
    preferences += ["blockwise", "reference"]
    for name in preferences:
        impl = registry.get(name)
        if impl is not None and impl.available() and impl.supports(spec) is None:
            return name
    return "reference"


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
        (see :func:`choose_implementation`).
      **options: passed to the implementation (block sizes, for example).

    Returns:
      An array of q's shape and dtype. A query that sees no key returns zeros.
    """
    q, k, v, segments, spec = make_spec(q, k, v, causal=causal, scale=scale, segment_ids=segment_ids,
                                        window=window, softcap=softcap)
    if not isinstance(impl, str):
        raise ValueError(f"impl: expected a string, got {impl!r}")
    if impl == "auto":
        impl = choose_implementation(spec, jax.default_backend())
    implementation = get_implementation(impl)
    if not implementation.available():
        raise ValueError(
            f"impl: {impl!r} is not available on backend {jax.default_backend()!r}; "
            f"available here: {list(implementations())}"
        )
    reason = implementation.supports(spec)
    if reason is not None:
        raise ValueError(f"impl: {impl!r} does not support this input: {reason}")
    return implementation.fn(q, k, v, segments, spec, **options)
