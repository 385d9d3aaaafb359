"""``impl="tokamax"``: Google's maintained kernel library for JAX, ``tokamax.dot_product_attention``,
behind the contract.

tokamax (https://github.com/openxla/tokamax) dispatches one attention API to several implementations:
``"mosaic"`` (its Pallas TPU flash kernel, forward and backward), ``"xla"`` (materialised scores, like
``jax.nn``), ``"xla_chunked"`` (query chunks, linear memory), and GPU kernels. It needs JAX 0.9.2 or
newer; on an older JAX this implementation is unavailable with that reason and nothing else changes.

What the adapter translates (checked against the float64 oracle in ``tests/test_oracle_suite.py``):

* layout and GQA: tokamax takes the contract's ``[batch, seq, heads, head_dim]`` with fewer kv heads
  (query head ``h`` reads kv head ``h // group``), so nothing is copied;
* scale: passed as ``scale=``; softcap: ``logits_soft_cap=`` (the same ``c * tanh(s / c)``);
* causal, window: ``is_causal`` and ``local_window_size`` align top-left, like ``jax.nn``'s, which is
  the contract's bottom-right only when ``q_len == kv_len``; any other mask, and segment ids, become
  one boolean ``mask`` built from the contract's :class:`~tpuattn.spec.MaskSpec`;
* rows that see no key: tokamax returns the mean of ``v`` there (masked logits are large and finite);
  the adapter selects zeros, as the contract says, which also zeroes their gradients;
* float32: ``precision=HIGHEST`` (a TPU's default is bfloat16 passes);
* the implementation: option ``implementation=`` (``"mosaic"``, ``"xla"``, ``"xla_chunked"``); by
  default ``"mosaic"`` when the call is for a TPU, ``"xla"`` elsewhere;
* sinks: not taken (tokamax 0.0.12's API has no sink argument), so ``sinks=`` is refused by name.

Compiled for a TPU on a machine without one (:func:`tpuattn.measure.aot.compile_for`), the call
needs the target's device as JAX's default device: tokamax checks the default device's platform
while tracing, and refuses ``"mosaic"`` on a CPU.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from tpuattn import chips
from tpuattn.numerics import boolean_mask, zero_rows_without_keys
from tpuattn.options import TOKAMAX_IMPLEMENTATIONS, TokamaxOptions
from tpuattn.registry import register

MIN_JAX = (0, 9, 2)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:3] if part.isdigit())


if _version(jax.__version__) < MIN_JAX:
    raise ImportError(f"tokamax needs JAX {'.'.join(map(str, MIN_JAX))} or newer; this is JAX "
                      f"{jax.__version__}")
try:
    import tokamax
except ImportError as error:
    raise ImportError("tokamax is not installed: pip install tokamax (JAX 0.9.2 or newer)") from error

IMPLEMENTATIONS = TOKAMAX_IMPLEMENTATIONS
_BEFORE_V5 = ("v2", "v3", "v4")
MOSAIC_BLOCK = 128  # tokamax's TPU kernel's default block (its q_block_size / kv_block_size)


class _NoCacheMissWarnings(logging.Filter):
    """tokamax logs a warning (through absl) for every shape it has no tuned configuration for, then
    uses its default configuration: every shape here. Kept out of the notebooks' output."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Autotuning cache miss")


logging.getLogger("absl").addFilter(_NoCacheMissWarnings())


@functools.cache
def _topology_device(topology: str):
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name=topology, platform="tpu").devices[0]


def _absl_flags_parsed() -> None:
    """tokamax reads its options through absl flags and, on first use, parses ``sys.argv`` for them:
    under pytest or a Jupyter kernel that command line is not absl's (``Unknown command line flag``).
    A library call should not parse its host's command line: take the flags' defaults instead."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _compile_only_device():
    """A compile-only device of the target chip (:func:`tpuattn.chips.target`) for JAX's default."""
    return _topology_device(chips.target_chip().topology)


def _mask_arguments(segment_ids, spec) -> tuple[dict, object]:
    """tokamax's mask keywords for the contract's mask, and the boolean mask built (or None)."""
    mask = spec.mask
    if mask.is_trivial and not spec.has_segments:
        return {}, None
    if mask.offset == 0 and not spec.has_segments:
        # Square: top-left alignment is the contract's bottom-right. An unbounded side of a window
        # reaches the whole sequence.
        kwargs = {"is_causal": mask.causal}
        if mask.window is not None:
            reach = max(spec.q_len, spec.kv_len)
            left = reach if mask.left_reach is None else mask.left_reach
            right = reach if mask.right_reach is None else mask.right_reach
            kwargs["local_window_size"] = (left, right)
        return kwargs, None
    keep = boolean_mask(segment_ids, spec)
    return {"mask": keep}, keep


def _tokamax(q, k, v, mask, **kwargs):
    return tokamax.dot_product_attention(q, k, v, mask=mask, **kwargs)


def _cross_compiled(call, device, q, k, v, mask):
    """``call(q, k, v, mask)`` traced for a TPU from a machine without one: tokamax checks JAX's default
    device while tracing its forward *and* its backward, and JAX traces a backward after the forward
    has returned, so both run with ``device`` as the default (a custom VJP whose residual is
    tokamax's own VJP function: the gradients are tokamax's)."""

    @jax.custom_vjp
    def run(q, k, v, mask):
        with jax.default_device(device):
            return call(q, k, v, mask)

    def forward(q, k, v, mask):
        with jax.default_device(device):
            out, pullback = jax.vjp(lambda q, k, v: call(q, k, v, mask), q, k, v)
        return out, pullback

    def backward(pullback, d_out):
        with jax.default_device(device):
            return (*pullback(d_out), None)

    run.defvjp(forward, backward)
    return run(q, k, v, mask)


def tokamax_attention(q, k, v, segment_ids, spec, **options):
    """``tokamax.dot_product_attention`` with the contract's masks translated."""
    implementation = TokamaxOptions.parse(options).implementation
    on_tpu = chips.target_backend() == "tpu"
    if implementation is None:
        implementation = "mosaic" if on_tpu else "xla"
    if implementation == "mosaic" and not on_tpu:
        raise ValueError("implementation: 'mosaic' is tokamax's TPU kernel; this call is for "
                         f"{chips.target_backend()!r} (use 'xla' or 'xla_chunked', or compile for a TPU)")
    kwargs, keep = _mask_arguments(segment_ids, spec)
    if spec.softcap is not None:
        kwargs["logits_soft_cap"] = float(spec.softcap)
    if jnp.dtype(spec.dtype) == jnp.float32:
        kwargs["precision"] = jax.lax.Precision.HIGHEST
    _absl_flags_parsed()
    mask = kwargs.pop("mask", None)
    call = functools.partial(_tokamax, scale=spec.scale, implementation=implementation, **kwargs)
    if on_tpu and jax.default_backend() != "tpu":
        out = _cross_compiled(call, _compile_only_device(), q, k, v, mask)
    else:
        out = call(q, k, v, mask)
    if keep is not None and spec.mask.rows_can_be_empty():
        out = zero_rows_without_keys(out, keep)  # tokamax returns the mean of v there
    return out.astype(q.dtype)


def tokamax_supports(spec, backend: str | None = None) -> str | None:
    backend = backend or chips.target_backend()
    if backend == "tpu":
        # What tokamax 0.0.12's TPU kernel ("mosaic") refuses, found by compiling tests/test_aot.py's
        # problems for v5e (tests/test_aot_tokamax.py).
        chip = chips.target_chip()
        if chip is not None and chip.name in _BEFORE_V5:
            return (f"chip: tokamax's TPU kernel ('mosaic') supports TPU v5 and newer (its supported_on: "
                    f"generation >= 5, tokamax 0.0.12); this is {chip.name}")
        if spec.q_len % MOSAIC_BLOCK or spec.kv_len % MOSAIC_BLOCK:
            return (f"q_len, kv_len: tokamax's TPU kernel needs multiples of its {MOSAIC_BLOCK}-row blocks "
                    f"(it does not pad); got {spec.q_len}, {spec.kv_len}; use splash or pallas, which pad")
        if spec.mask.window is not None:
            return ("window: tokamax's TPU kernel does not take local_window_size (tokamax 0.0.12: "
                    "'mask.k_start is not supported'); use splash or pallas")
    if jnp.dtype(spec.dtype) == jnp.float16 and backend == "cpu":
        return ("float16 on CPU: XLA's CPU dot_general has no F16_F16_F32 precision (tokamax's 'xla' "
                "path); use bfloat16 or float32")
    return None


register("tokamax", tokamax_attention, supports=tokamax_supports, options=TokamaxOptions,
         description="tokamax.dot_product_attention (Google's kernel library: 'mosaic' on a TPU, 'xla' "
                     "elsewhere); offered by name, never chosen by auto")
