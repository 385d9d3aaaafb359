"""tpuattn.flax: the contract as the attention_fn of Flax's nnx.MultiHeadAttention, against Flax's own
attention (same weights) and a float64 NumPy computation, and the refusals of what the contract cannot
express."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
from flax import nnx  # noqa: E402

import tpuattn  # noqa: E402
import tpuattn.flax as tflax  # noqa: E402
from tpuattn.errors import UnsupportedInput  # noqa: E402

BATCH, SEQ, FEATURES, HEADS = 2, 24, 64, 4
TOL = 2e-5  # relative to the largest output (gradient) entry


def _mha(attention_fn=None, **kwargs):
    """A MultiHeadAttention with the same weights whatever its attention_fn (the same seed)."""
    extra = {} if attention_fn is None else {"attention_fn": attention_fn}
    return nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, decode=False, rngs=nnx.Rngs(0),
                                  **extra, **kwargs)


def _inputs(seq=SEQ, seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((BATCH, seq, FEATURES)), jnp.float32)


def _close(actual, expected, tol=TOL):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    error = np.max(np.abs(actual - expected)) / np.max(np.abs(expected))
    assert error <= tol, f"relative error {error:.2e} > {tol:.0e}"


def _flax_causal(x):
    return _mha()(x, mask=nnx.make_causal_mask(x[..., 0]))


def _jitted(module):
    """The module as a jitted function of its state and the input (one compile per implementation)."""
    graphdef, state = nnx.split(module)
    return jax.jit(lambda state, x: nnx.merge(graphdef, state)(x)), state


@pytest.mark.parametrize("impl", ["reference", "blockwise", "pallas"])
def test_multi_head_attention_matches_flax_causal(impl):
    x = _inputs()
    run, state = _jitted(_mha(tflax.attention_fn(causal=True, impl=impl)))
    _close(run(state, x), _flax_causal(x))


def test_gradients_match_flax():
    x = _inputs()
    d_out = jnp.asarray(np.random.default_rng(2).standard_normal((BATCH, SEQ, FEATURES)), jnp.float32)

    def grads(module, **call):
        graphdef, state = nnx.split(module)
        loss = lambda state: jnp.sum(nnx.merge(graphdef, state)(x, **call) * d_out)
        return jax.jit(jax.grad(loss))(state)

    ours = grads(_mha(tflax.attention_fn(causal=True, impl="blockwise")))
    theirs = grads(_mha(), mask=nnx.make_causal_mask(x[..., 0]))
    leaves = jax.tree_util.tree_leaves_with_path(theirs)
    assert len(leaves) == 8  # query, key, value, out: a kernel and a bias each
    scale = max(float(jnp.max(jnp.abs(leaf))) for _, leaf in leaves)
    for (path, expected), actual in zip(leaves, jax.tree_util.tree_leaves(ours), strict=True):
        if "key" in jax.tree_util.keystr(path) and "bias" in jax.tree_util.keystr(path):
            # Zero in exact arithmetic (a key bias shifts every logit of a row alike): both are rounding.
            assert float(jnp.max(jnp.abs(actual))) <= 1e-5 * scale, path
        else:
            _close(actual, expected)


def _value(variable):
    return np.asarray(variable[...], np.float64)


def test_matches_float64_numpy():
    """softmax(Q K^T / sqrt(d) + causal mask) V, with the module's own projections, in float64."""
    x = _inputs()
    module = _mha(tflax.attention_fn(causal=True, impl="reference"))
    xs = np.asarray(x, np.float64)
    q, k, v = (np.einsum("bti,ihd->bthd", xs, _value(p.kernel)) + _value(p.bias)
               for p in (module.query, module.key, module.value))
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    logits = np.where(np.tril(np.ones((SEQ, SEQ), bool)), logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    heads = np.einsum("bhqk,bkhd->bqhd", weights, v)
    expected = np.einsum("bqhd,hdo->bqo", heads, _value(module.out.kernel)) + _value(module.out.bias)
    _close(module(x), expected)


def test_key_mask_is_computed_as_segment_ids():
    x = _inputs()
    valid = jnp.asarray(np.arange(SEQ)[None, :] < np.array([[SEQ], [SEQ - 7]]))  # padding at the end
    key_mask = valid[:, None, None, :]
    ours = _mha(tflax.attention_fn(causal=True, impl="reference"))(x, mask=key_mask)
    both = nnx.combine_masks(nnx.make_causal_mask(x[..., 0]), key_mask)
    _close(ours, _mha()(x, mask=both))


def test_decode_with_flax_cache_matches_flax():
    """nnx.MultiHeadAttention(decode=True): Flax's cache mask is a key mask, so each step is exact."""
    x = _inputs(seq=6)
    ours = _mha(tflax.attention_fn(causal=True, impl="reference"))
    theirs = _mha()
    for module in (ours, theirs):
        module.init_cache(x.shape)
    for step in range(x.shape[1]):
        token = x[:, step:step + 1]
        _close(ours(token, decode=True), theirs(token, decode=True))
    # A window is placed at the last key by the contract, at the cache index by Flax: refused.
    windowed = _mha(tflax.attention_fn(causal=True, window=(2, 0), impl="reference"))
    windowed.init_cache(x.shape)
    with pytest.raises(UnsupportedInput, match=r"^mask: .*decode=True.*tpuattn\.decode\.attention"):
        windowed(x[:, :1], decode=True)


def _qkv(q_len=8, kv_len=8, batch=(2,)):
    rng = np.random.default_rng(3)
    make = lambda n: jnp.asarray(rng.standard_normal((*batch, n, 2, 16)), jnp.float32)
    return make(q_len), make(kv_len), make(kv_len)


def test_refusals_name_the_argument():
    x = _inputs(seq=8)
    causal = _mha(tflax.attention_fn(causal=True, impl="reference"))
    # A full mask, even the causal one attention_fn(causal=True) already applies, is not ignored.
    with pytest.raises(UnsupportedInput, match=r"^mask: .*causal=True.*without mask="):
        causal(x, mask=nnx.make_causal_mask(x[..., 0]))
    with pytest.raises(UnsupportedInput, match=r"^mask: .*causal= / window=.*segment_ids="):
        _mha(tflax.attention_fn(impl="reference"))(x, mask=nnx.make_causal_mask(x[..., 0]))
    with pytest.raises(UnsupportedInput, match=r"^module: .*sow_weights"):
        causal(x, sow_weights=True)
    with pytest.raises(UnsupportedInput, match=r"^dropout_rate: .*deterministic=True"):
        _mha(tflax.attention_fn(causal=True, impl="reference"), dropout_rate=0.1)(x, deterministic=False)
    deterministic = _mha(tflax.attention_fn(causal=True, impl="reference"), dropout_rate=0.1)
    _close(deterministic(x, deterministic=True), _flax_causal(x))
    with pytest.raises(UnsupportedInput, match=r"^precision: .*precision=None"):
        _mha(tflax.attention_fn(causal=True, impl="reference"), precision=jax.lax.Precision.HIGHEST)(x)
    fn = tflax.attention_fn(causal=True, impl="reference")
    q, k, v = _qkv()
    with pytest.raises(UnsupportedInput, match=r"^bias: "):
        fn(q, k, v, bias=jnp.zeros((2, 2, 8, 8)))
    with pytest.raises(UnsupportedInput, match=r"^some_future_argument: "):
        fn(q, k, v, some_future_argument=3)
    fn(q, k, v, some_future_argument=None)  # None (or False): ignored
    with pytest.raises(UnsupportedInput, match=r"^segment_ids: "):
        tflax.attention_fn(segment_ids=np.zeros((2, 8), np.int32))
    with pytest.raises(TypeError, match=r"^causal: "):
        tflax.attention_fn(causal=1)


def test_is_causal_dtype_and_batch_dimensions():
    plain, causal = tflax.attention_fn(impl="reference"), tflax.attention_fn(causal=True, impl="reference")
    q, k, v = _qkv()
    # Flax 0.12's is_causal: the same mask as causal=True when q_len == kv_len; refused otherwise.
    _close(plain(q, k, v, is_causal=True), causal(q, k, v))
    with pytest.raises(UnsupportedInput, match=r"^is_causal: .*top-left"):
        plain(*_qkv(q_len=4), is_causal=True)
    # dtype: the inputs cast to it, and the output in it.
    assert causal(q, k, v, dtype=jnp.bfloat16).dtype == jnp.bfloat16
    # Any number of batch dimensions (Flax's [batch..., seq, heads, head_dim]), none included.
    q2, k2, v2 = _qkv(batch=(2, 3))
    out = causal(q2, k2, v2)
    _close(out[1], causal(q2[1], k2[1], v2[1]))
    _close(out[1, 2], causal(q2[1, 2], k2[1, 2], v2[1, 2]))


def test_sinks_are_passed_only_when_given(monkeypatch):
    seen = []
    monkeypatch.setattr(tflax, "attention", lambda q, k, v, **kw: seen.append(kw) or q)
    q, k, v = _qkv()
    tflax.attention_fn(causal=True)(q, k, v)
    tflax.attention_fn(causal=True, sinks=jnp.zeros(2), block_q=8)(q, k, v)
    assert "sinks" not in seen[0]
    assert seen[1]["sinks"].shape == (2,) and seen[1]["block_q"] == 8 and seen[1]["causal"] is True


@pytest.mark.skipif("sinks" not in inspect.signature(tpuattn.attention).parameters,
                    reason="this tpuattn's contract takes no sinks")
def test_sinks_reach_the_softmax():
    """One logit per query head in the denominator (no value), causal, against float64 NumPy."""
    q, k, v = _qkv()
    sinks = np.array([1.5, -0.5])
    out = tflax.attention_fn(causal=True, sinks=jnp.asarray(sinks, jnp.float32), impl="reference")(q, k, v)
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    logits = np.einsum("bqhd,bkhd->bhqk", q64, k64) / np.sqrt(q64.shape[-1])
    logits = np.where(np.tril(np.ones((8, 8), bool)), logits, -np.inf)
    top = np.maximum(logits.max(-1, keepdims=True), sinks[None, :, None, None])
    weights = np.exp(logits - top)
    weights /= weights.sum(-1, keepdims=True) + np.exp(sinks[None, :, None, None] - top)
    _close(out, np.einsum("bhqk,bkhd->bqhd", weights, v64))


def test_flax_is_optional(monkeypatch):
    # Importing tpuattn loads no Flax (a clean interpreter: this one has imported it).
    code = "import sys, tpuattn; assert 'flax' not in sys.modules, 'tpuattn imported flax'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    # Without Flax, tpuattn.flax says how to install it.
    monkeypatch.setitem(sys.modules, "flax", None)
    monkeypatch.delitem(sys.modules, "tpuattn.flax")
    with pytest.raises(ImportError, match=r"pip install tpuattn\[flax\]"):
        importlib.import_module("tpuattn.flax")
