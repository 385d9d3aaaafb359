"""Quantized caches in tpuattn.decode (int8 and float8_e4m3fn entries with k_scale / v_scale) against the
float64 oracle on the dequantized values (tests/decode_oracle.py): per tensor and per kv head, dense and
ragged, paged and contiguous; scales of zero, huge and subnormal values; quantize and the paged write
against NumPy; every refusal.

The accuracy is printed (``pytest tests/test_decode_quant.py -k accuracy -s``): the error of each
implementation against the oracle on the dequantized cache (the kernel's own error), and the oracle on
the dequantized cache against the oracle on the full-width one (what quantizing costs)."""

from __future__ import annotations

import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from decode_oracle import dequantized, oracle_decode, oracle_ragged_decode

from tpuattn import decode
from tpuattn.errors import TpuattnError, UnsupportedInput

IMPLS = decode.implementations()
DTYPES = ("int8", "float8_e4m3fn")
# The implementations against the oracle on the dequantized values: float32 queries, so the kernel's
# own float32 accumulation (2e-5, as tests/test_decode.py); the entries are exact in f32 and bf16.
TOL = {"float32": 2e-5, "bfloat16": 2e-2}
PAGE, PPS, NUM_PAGES, HK, H, D = 8, 4, 14, 2, 4, 32


def _takers():
    return [i for i in IMPLS if decode.get_implementation(i).takes_scales]


def _inputs(dtype, per, *, qdtype="float32", seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((3, 2, H, D)), qdtype)
    k = rng.standard_normal((NUM_PAGES, PAGE, HK, D)) * np.array([1.0, 3.0])[:, None]  # heads differ
    v = rng.standard_normal(k.shape)
    kq, ks = decode.quantize(k, dtype, per=per)
    vq, vs = decode.quantize(v, dtype, per=per)
    table = rng.permutation(NUM_PAGES)[:3 * PPS].reshape(3, PPS).astype(np.int32)
    lengths = np.array([1, 17, 32], np.int32)  # one key; across pages; the capacity
    return q, k, v, kq, ks, vq, vs, table, lengths


def _oracle(q, kq, ks, vq, vs, table, lengths, **kw):
    return oracle_decode(np.asarray(q.astype(jnp.float32), np.float64), dequantized(kq, ks),
                         dequantized(vq, vs), lengths, page_table=table, **kw)


# Each dtype once per scale form here (the accuracy test below runs all four, without a window).
@pytest.mark.parametrize(("dtype", "per"), [("int8", "head"), ("float8_e4m3fn", "tensor")])
@pytest.mark.parametrize("impl", IMPLS)
def test_quantized_matches_oracle_on_dequantized_values(impl, dtype, per):
    q, _, _, kq, ks, vq, vs, table, lengths = _inputs(dtype, per)
    kw = dict(window=(20, 0), softcap=4.0)
    if not decode.get_implementation(impl).takes_scales:
        with pytest.raises(UnsupportedInput, match=re.escape("scales (k_scale, v_scale)")):
            decode.attention(q, kq, vq, lengths, page_table=table, k_scale=ks, v_scale=vs, impl=impl, **kw)
        return
    out = decode.attention(q, kq, vq, lengths, page_table=table, k_scale=ks, v_scale=vs, impl=impl, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    want = _oracle(q, kq, ks, vq, vs, table, lengths, **kw)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=TOL["float32"], rtol=TOL["float32"])


# Quantizing costs, against the oracle on the full-width cache (inputs ~N(0, 1), keys of head 1 x3;
# max abs error of outputs of size ~1), measured by this test on JAX 0.10.2 (CPU): int8 2.8e-2 per
# tensor, 2.0e-2 per kv head; fp8 1.4e-1 per tensor, 1.6e-1 per kv head. The implementations against
# the oracle on the dequantized values: reference and pallas (interpret mode) 4e-7 to 8e-7 (float32).
# Bounds with margin.
COST_BOUND = {"int8": 5e-2, "float8_e4m3fn": 2.5e-1}


@pytest.mark.parametrize("dtype", DTYPES)
def test_accuracy_of_quantized_caches_is_measured_and_bounded(dtype):
    for per in ("tensor", "head"):
        q, k, v, kq, ks, vq, vs, table, lengths = _inputs(dtype, per)
        full = oracle_decode(np.asarray(q, np.float64), k, v, lengths, page_table=table)
        deq = _oracle(q, kq, ks, vq, vs, table, lengths)
        cost = np.abs(deq - full).max()
        line = [f"{dtype} per {per}: dequantized oracle vs full-width oracle max abs {cost:.2e}"]
        errors = {}
        for impl in _takers():
            out = decode.attention(q, kq, vq, lengths, page_table=table, k_scale=ks, v_scale=vs, impl=impl)
            errors[impl] = np.abs(np.asarray(out, np.float64) - deq).max()
            line.append(f"{impl} vs dequantized oracle {errors[impl]:.2e}")
        print("; ".join(line))
        assert cost < COST_BOUND[dtype]
        assert max(errors.values()) < TOL["float32"], errors


def test_bf16_queries_over_an_int8_cache():
    q, _, _, kq, ks, vq, vs, table, lengths = _inputs("int8", "head", qdtype="bfloat16", seed=2)
    want = _oracle(q, kq, ks, vq, vs, table, lengths)
    for impl in _takers():
        out = decode.attention(q, kq, vq, lengths, page_table=table, k_scale=ks, v_scale=vs, impl=impl)
        assert out.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), want, atol=TOL["bfloat16"],
                                   rtol=TOL["bfloat16"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_ragged_batch_over_a_quantized_contiguous_cache(dtype):
    rng = np.random.default_rng(4)
    k = rng.standard_normal((3, 24, HK, D))
    v = rng.standard_normal(k.shape)
    kq, ks = decode.quantize(k, dtype)
    vq, vs = decode.quantize(v, dtype, per="tensor")
    lengths = np.array([24, 5, 11], np.int32)
    cu = np.array([0, 7, 8, 8], np.int32)  # a chunk at the capacity, a decode, no query
    q = rng.standard_normal((10, H, D)).astype(np.float32)
    want = oracle_ragged_decode(q, kq, vq, lengths, cu, k_scale=ks, v_scale=vs, window=4)
    for impl in _takers():
        options = {"block_size": 8, "q_block": 4} if impl == "pallas" else {}
        out = decode.attention(q, kq, vq, lengths, cu_q_lens=cu, k_scale=ks, v_scale=vs, window=4, impl=impl,
                               **options)
        np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=2e-5, rtol=2e-5)


SCALES = {"zero": 0.0, "huge": 1e30, "subnormal": 1e-40}


@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("name", list(SCALES))
def test_extreme_scales(name, which):
    """A key scale of 0 makes every logit 0 (uniform weights); 1e30 makes them huge (one-hot: the
    oracle's argmax, in float32 the largest logit by far); a subnormal one ~0. A value scale multiplies
    the output. Against the oracle on the dequantized values (float64), per kv head (one head normal)."""
    q, _, _, kq, ks, vq, vs, table, lengths = _inputs("int8", "head", seed=5)
    q = q * 1e-3 if name == "huge" else q  # logits ~1e26: finite in float32
    extreme = jnp.array([SCALES[name], 0.05], jnp.float32)
    ks, vs = (extreme, vs) if which == "k" else (ks, extreme)
    want = _oracle(q, kq, ks, vq, vs, table, lengths)
    for impl in _takers():
        out = np.asarray(decode.attention(q, kq, vq, lengths, page_table=table, k_scale=ks, v_scale=vs,
                                          impl=impl), np.float64)
        assert np.all(np.isfinite(out))
        scale = max(1.0, np.abs(want).max())
        np.testing.assert_allclose(out / scale, want / scale, atol=2e-5, rtol=0)


# ---------------------------------------------------------------------------- quantize and write
@pytest.mark.parametrize("per", ["tensor", "head"])
def test_int8_quantize_rounds_to_half_a_scale(per):
    x = np.random.default_rng(6).standard_normal((5, 7, HK, D)).astype(np.float32)
    e, s = decode.quantize(x, "int8", per=per)
    s64 = np.asarray(s, np.float64)
    amax = np.abs(x).max(axis=(0, 1, 3)) if per == "head" else np.abs(x).max()
    np.testing.assert_allclose(s64, amax / 127, rtol=1e-6)
    assert e.dtype == jnp.int8 and np.abs(np.asarray(e, np.int64)).max() == 127
    err = np.abs(dequantized(e, s) - x)
    assert np.all(err <= (s64[:, None] if per == "head" else s64) / 2 * (1 + 1e-6))


def test_fp8_quantize_relative_error():
    x = np.random.default_rng(7).standard_normal((5, 7, HK, D)).astype(np.float32)
    e, s = decode.quantize(x, "float8_e4m3fn")
    assert e.dtype == jnp.float8_e4m3fn
    np.testing.assert_allclose(np.asarray(s, np.float64), np.abs(x).max(axis=(0, 1, 3)) / 448, rtol=1e-6)
    # e4m3: 3 mantissa bits, round to nearest: relative error <= 2**-4 for normal entries (>= 2**-6)
    normal = np.abs(x / np.asarray(s)[:, None]) >= 2.0 ** -6
    rel = np.abs(dequantized(e, s) - x) / np.abs(x)
    assert rel[normal].max() <= 2.0 ** -4 * (1 + 1e-6)


def test_quantize_saturates_and_handles_zero_scale_and_nan():
    x = np.array([[[1000.0, -1000.0, np.nan, np.inf]]], np.float32)  # [1, kv_heads 1, 4]
    e8, _ = decode.quantize(x, "int8", scale=np.float32(1.0))
    np.testing.assert_array_equal(np.asarray(e8), [[[127, -127, 0, 127]]])
    f8, _ = decode.quantize(x, "float8_e4m3fn", scale=np.float32(1.0))
    got = np.asarray(f8).astype(np.float32)
    np.testing.assert_array_equal(got[0, 0, [0, 1, 3]], [448.0, -448.0, 448.0])
    assert np.isnan(got[0, 0, 2])
    z, _ = decode.quantize(x[..., :2], "int8", scale=np.float32(0.0))
    np.testing.assert_array_equal(np.asarray(z), 0)


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn", "float32"])
def test_write_stores_rows_at_their_pages_and_drops_padding(dtype):
    rng = np.random.default_rng(8)
    pages = jnp.zeros((6, 4, HK, D), dtype)
    table = np.array([[3, 1, 0], [5, 2, 4]], np.int32)
    new = rng.standard_normal((4, HK, D)).astype(np.float32)
    seq, positions = np.array([0, 1, 1, 0]), np.array([5, 0, 11, -1])  # the last is padding
    scale = np.array([0.02, 0.03], np.float32) if dtype != "float32" else None
    got = np.asarray(decode.write(pages, new, table, positions, seq=seq, scale=scale)).astype(np.float64)
    want = np.zeros((6, 4, HK, D))
    for row, b, j in zip(new, seq, positions, strict=True):
        if j >= 0:
            want[table[b, j // 4], j % 4] = row
    if dtype == "int8":
        want = np.clip(np.round(want / scale[:, None]), -127, 127)
    elif dtype == "float8_e4m3fn":
        # Within one fp8 step (2**-3 relative) of NumPy's nearest: JAX 0.7.2's conversion on the CPU
        # does not always round to the nearest (0.10.2 does, exactly), so the bound is the step.
        exact = (want / scale[:, None]).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
        np.testing.assert_allclose(got, exact, rtol=2.0 ** -3, atol=0)
        np.testing.assert_allclose(got, want / scale[:, None], rtol=2.0 ** -3, atol=2.0 ** -9)
        return
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------- refusals
def _good():
    q, _, _, kq, ks, vq, vs, table, lengths = _inputs("int8", "head")
    return dict(q=q, k_cache=kq, v_cache=vq, lengths=lengths, page_table=table, k_scale=ks, v_scale=vs)


BAD = [
    ("no scales", dict(k_scale=None, v_scale=None), TpuattnError,
     "k_scale, v_scale: expected the scales of a int8 cache (float32 [] per tensor or [2] per kv head), "
     "got None"),
    ("one scale", dict(v_scale=None), TpuattnError, "k_scale and v_scale: expected both or neither, got only "
     "k_scale"),
    ("scale shape", dict(k_scale=np.ones(3, np.float32)), TpuattnError,
     "k_scale: expected shape () per tensor or (2,) per kv head, got (3,)"),
    ("scale dtype", dict(v_scale=np.ones(2, np.int32)), TypeError,
     "v_scale: expected a float dtype (float32), got int32"),
    ("negative", dict(k_scale=np.array([0.1, -1.0], np.float32)), TpuattnError,
     "k_scale: expected finite values >= 0, got -1.0"),
    ("nan", dict(v_scale=np.array([np.nan, 1.0], np.float32)), TpuattnError,
     "v_scale: expected finite values >= 0, got nan"),
    ("inf", dict(v_scale=np.float32(np.inf)), TpuattnError, "v_scale: expected finite values >= 0, got inf"),
    ("k and v dtypes", dict(v_cache=jnp.zeros((NUM_PAGES, PAGE, HK, D), jnp.float8_e4m3fn)), TypeError,
     "q, k_cache, v_cache: expected one dtype (or k_cache and v_cache both of a quantized dtype in "
     "['int8', 'float8_e4m3fn']), got q float32, k_cache int8, v_cache float8_e4m3fn"),
    ("int q", dict(q=jnp.zeros((3, 2, H, D), jnp.int8)), TypeError,
     "q: expected a dtype in ['float32', 'bfloat16', 'float16'] over a int8 cache, got int8"),
    ("other int cache", dict(k_cache=jnp.zeros((NUM_PAGES, PAGE, HK, D), jnp.int16),
                             v_cache=jnp.zeros((NUM_PAGES, PAGE, HK, D), jnp.int16)), TypeError,
     "q, k_cache, v_cache: expected one dtype (or k_cache and v_cache both of a quantized dtype"),
]


@pytest.mark.parametrize("name,change,error,message", BAD, ids=[b[0] for b in BAD])
def test_bad_quantized_arguments_are_refused_with_a_clear_message(name, change, error, message):
    args = {**_good(), **change}
    with pytest.raises(error, match=re.escape(message)):
        decode.attention(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), args.pop("lengths"),
                         impl="reference", **args)


def test_native_kernels_refuse_scales_by_name():
    spec = decode.decode_spec_from_shapes(batch=2, q_len=1, num_q_heads=4, num_kv_heads=2, head_dim=128,
                                          page_size=16, num_pages=8, pages_per_sequence=4, dtype="bfloat16",
                                          cache_dtype="int8", scales="head")
    for name in ("jax_paged", "jax_ragged"):
        reason = decode.get_implementation(name).supports(spec, "tpu")
        assert reason.startswith("k_scale, v_scale: ") and "int8 cache" in reason, reason
    with pytest.raises(TpuattnError, match=re.escape("scales: expected 'tensor' or 'head' for a int8 cache")):
        decode.decode_spec_from_shapes(batch=1, q_len=1, num_q_heads=2, num_kv_heads=2, head_dim=128,
                                       capacity=16, cache_dtype="int8")


@pytest.mark.parametrize(("change", "message"), [
    (dict(scale=None), "scale: expected the cache's float32 scale ([] or [kv_heads]) for int8 pages, "
                       "got None"),
    (dict(new=np.zeros((2, 3, D), np.float32)), "new: expected [n, 2, 32]"),
    (dict(positions=np.array([0.0, 1.0])), "positions: expected integers of shape (2,)"),
])
def test_write_refusals(change, message):
    args = {**dict(pages=jnp.zeros((4, 4, HK, D), jnp.int8), new=np.zeros((2, HK, D), np.float32),
                   page_table=np.array([[0, 1], [2, 3]], np.int32), positions=np.array([0, 1]),
                   scale=np.float32(0.1)), **change}
    with pytest.raises(TpuattnError, match=re.escape(message)):
        decode.write(args.pop("pages"), args.pop("new"), args.pop("page_table"), args.pop("positions"),
                     **args)
