"""tpuattn.lm: the contract inside a small Flax NNX transformer. Swapping the attention implementation
changes nothing the model computes (logits against a float64 NumPy forward of the same weights, losses
after a few training steps); the paged, continuously batched server decodes the tokens that recomputing
the whole sequence gives, while reusing pages; the free list never hands out a page in use; bad input
names the argument."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")
from flax import nnx  # noqa: E402

from tpuattn import lm  # noqa: E402

CONFIG = lm.Config(d_model=32, layers=2, heads=4, kv_heads=2, mlp_dim=64)
IMPLS = ["reference", "blockwise", "pallas", "xla"]
LOGIT_TOL = 2e-5  # float32 against float64, relative to the largest logit
PROMPTS = ["a", "The kern", "attention on ", "Pallas, then splash"]  # 1, 8, 13 and 19 bytes
NEW = [6, 3, 9, 4]


def _model(impl="reference", seed=0):
    return lm.Transformer(CONFIG, rngs=nnx.Rngs(seed), impl=impl)


def _tokens(batch=2, seq=24, seed=1):
    return np.random.default_rng(seed).integers(0, lm.VOCAB, (batch, seq)).astype(np.int32)


def _numpy_logits(model, tokens):
    """The model's forward pass in float64 NumPy from its weights (an oracle independent of JAX)."""
    c, w = model.config, lambda p: np.asarray(p[...], np.float64)
    batch, seq = tokens.shape
    table = w(model.embed.embedding)
    norm = lambda x, layer: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * w(layer.scale)
    half, pos = c.head_dim // 2, np.arange(seq, dtype=np.float64)
    angles = pos[:, None] * c.rope_base ** (-np.arange(half) / half)  # [seq, D/2]
    cos, sin = np.cos(angles)[None, :, None], np.sin(angles)[None, :, None]

    def rope(x):
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    x = table[tokens]
    for block in model.blocks:
        att, h = block.attention, norm(x, block.attention_norm)
        q = rope((h @ w(att.query.kernel)).reshape(batch, seq, c.heads, c.head_dim))
        k = rope((h @ w(att.key.kernel)).reshape(batch, seq, c.kv_heads, c.head_dim))
        v = (h @ w(att.value.kernel)).reshape(batch, seq, c.kv_heads, c.head_dim)
        group = c.heads // c.kv_heads
        k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
        s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(c.head_dim)
        s = np.where(np.tril(np.ones((seq, seq), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        o = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v).reshape(batch, seq, -1)
        x = x + o @ w(att.out.kernel)
        h, mlp = norm(x, block.mlp_norm), block.mlp
        g = h @ w(mlp.gate.kernel)
        x = x + (g / (1 + np.exp(-g)) * (h @ w(mlp.up.kernel))) @ w(mlp.down.kernel)
    return norm(x, model.final_norm) @ table.T


def _relative(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    return np.max(np.abs(actual - expected)) / np.max(np.abs(expected))


@pytest.mark.parametrize("impl", IMPLS)
def test_swapping_impl_gives_the_oracles_logits(impl):
    model, tokens = _model(impl), _tokens()
    graphdef, state = nnx.split(model)
    import jax

    logits = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens)
    assert logits.shape == (*tokens.shape, lm.VOCAB) and logits.dtype == np.float32
    assert _relative(logits, _numpy_logits(model, tokens)) <= LOGIT_TOL


def test_swapping_impl_gives_the_same_losses_when_training():
    data = lm.corpus()
    curves = {impl: lm.train(_model(impl), lm.batches(data, batch=2, seq=32, seed=3), 3)[1] for impl in IMPLS}
    first = curves["reference"]
    assert first[-1] < first[0]  # it learns
    for impl, losses in curves.items():
        np.testing.assert_allclose(losses, first, rtol=1e-5, err_msg=impl)


def _live_pages_disjoint(events):
    """Replays the server's admissions and retirements: no page is held by two sequences at once."""
    held = {}
    for _, kind, prompt, _, pages in events:
        if kind == "admit":
            clash = {p: held[p] for p in pages if p in held}
            assert not clash, f"prompt {prompt} got pages held by {clash}"
            held.update(dict.fromkeys(pages, prompt))
        else:
            assert all(held.pop(p) == prompt for p in pages)
    assert held == {}


@pytest.mark.parametrize("decode_impl", ["reference", "pallas"])
def test_continuous_batching_equals_recomputation(decode_impl):
    model = _model("reference", seed=2)
    prompts = [lm.encode(p) for p in PROMPTS]
    # 2 slots, 8 pages of 4 rows (7 handed out): the 19 + 4 bytes prompt needs 6 of them, so sequences
    # wait for pages, and every page is handed out again after a sequence gives it back.
    served = lm.serve(model, prompts, NEW, slots=2, page_size=4, num_pages=8, decode_impl=decode_impl,
                      keep_logits=True)
    assert served.reused > 0
    _live_pages_disjoint(served.events)
    admitted = [e for e in served.events if e[1] == "admit"]
    assert sorted(e[2] for e in admitted) == list(range(len(prompts)))
    assert len({e[3] for e in admitted}) == 2  # both slots served
    for prompt, n, tokens, logits in zip(prompts, NEW, served.tokens, served.logits, strict=True):
        expected_tokens, expected_logits = lm.recompute(model, prompt, n, keep_logits=True)
        np.testing.assert_array_equal(tokens, expected_tokens)
        assert _relative(logits, expected_logits) <= LOGIT_TOL


@pytest.mark.parametrize("decode_impl", ["reference", "pallas"])
def test_mixed_batches_equal_recomputation(decode_impl):
    """Chunked prefill beside running decodes, one ragged call a step (chunk 4: the 13- and 19-byte
    prompts take 4 and 5 steps of prefill while the others decode): the tokens recomputation gives,
    and logits within float32 rounding; an admitted prompt joins the step right away."""
    model = _model("reference", seed=2)
    prompts = [lm.encode(p) for p in PROMPTS]
    served = lm.serve(model, prompts, NEW, slots=3, page_size=4, num_pages=16, decode_impl=decode_impl,
                      keep_logits=True, chunk=4)
    _live_pages_disjoint(served.events)
    admitted = {e[2]: e[0] for e in served.events if e[1] == "admit"}
    retired = {e[2]: e[0] for e in served.events if e[1] == "retire"}
    assert sorted(admitted) == list(range(len(prompts)))
    # Prompt 3 is admitted as a slot frees and decoded tokens keep coming in the steps it prefills.
    late = max(admitted, key=admitted.get)
    busy = [i for i in admitted if i != late and admitted[i] <= admitted[late] < retired[i]]
    assert busy, "no prompt was prefilled beside a running decode"
    # Steps: every prompt's chunks and tokens, sharing steps (fewer than one prefill step a chunk plus
    # one decode step a token, each prompt alone).
    alone = sum(-(-len(p) // 4) + n - 1 for p, n in zip(prompts, NEW, strict=True))
    assert served.steps < alone
    for prompt, n, tokens, logits in zip(prompts, NEW, served.tokens, served.logits, strict=True):
        expected_tokens, expected_logits = lm.recompute(model, prompt, n, keep_logits=True)
        np.testing.assert_array_equal(tokens, expected_tokens)
        assert _relative(logits, expected_logits) <= LOGIT_TOL


# A quantized cache (per-layer, per-kv-head scales calibrated on the prompts' prefill): the logits'
# distance from recomputation's, relative to the largest logit. Measured (tests print them with -s):
# int8 and float8_e4m3fn both below these bounds on JAX 0.10.2 and 0.7.2.
QUANTIZED_LOGIT_TOL = {"int8": 0.02, "float8_e4m3fn": 0.1}


@pytest.mark.parametrize("cache_dtype", ["int8", "float8_e4m3fn"])
def test_a_quantized_cache_stays_close_to_recomputation(cache_dtype):
    model = _model("reference", seed=2)
    prompts = [lm.encode(p) for p in PROMPTS]
    served = lm.serve(model, prompts, NEW, slots=2, page_size=4, num_pages=12, decode_impl="reference",
                      keep_logits=True, chunk=4, cache_dtype=cache_dtype)
    worst, same = 0.0, 0
    for prompt, n, tokens, logits in zip(prompts, NEW, served.tokens, served.logits, strict=True):
        # Recompute the logits along the served tokens (teacher forcing), so that one flipped argmax
        # does not compare different continuations.
        full = np.concatenate([prompt, tokens[:-1]])
        expected = np.asarray(model(full[None])[0], np.float64)[len(prompt) - 1:]
        worst = max(worst, _relative(logits, expected))
        same += int(np.array_equal(tokens, lm.recompute(model, prompt, n)))
    print(f"{cache_dtype} cache: logits within {worst:.2e} of the full-width model's (relative to the "
          f"largest); {same} of {len(prompts)} prompts' greedy tokens equal recomputation")
    assert 0 < worst <= QUANTIZED_LOGIT_TOL[cache_dtype]


def test_calibrated_scales_cover_the_prompts_keys():
    model = _model("reference", seed=2)
    prompts = [lm.encode(p) for p in PROMPTS]
    k_scale, v_scale = lm.calibrate(model, prompts, "int8", headroom=1.0)
    _, kvs = model.prefill(prompts[-1][None])
    for layer, (k, v) in enumerate(kvs):
        for x, scale in ((k, k_scale), (v, v_scale)):
            amax = np.abs(np.asarray(x, np.float64)).max(axis=(0, 1, 3))
            assert np.all(amax <= 127 * np.asarray(scale[layer], np.float64) * (1 + 1e-6))


def test_the_free_list_never_hands_out_a_page_in_use():
    rng = np.random.default_rng(0)
    pages, held = lm.PageAllocator(12), []
    for _ in range(300):
        if held and (rng.random() < 0.5 or not pages.free):
            pages.give_back(held.pop(rng.integers(len(held))))
        else:
            got = pages.take(int(rng.integers(1, len(pages.free) + 1)))
            assert 0 not in got  # the scratch page
            assert not set(got) & {p for h in held for p in h}
            held.append(got)
        assert set(pages.free).isdisjoint(pages.in_use) and len(pages.free) + len(pages.in_use) == 11
    assert pages.reused > 0
    with pytest.raises(ValueError, match="pages:"):
        pages.give_back([pages.free[0]])
    with pytest.raises(ValueError, match="n:"):
        pages.take(len(pages.free) + 1)


@pytest.mark.parametrize("call, match", [
    (lambda: lm.Config(d_model=30, heads=4), "Config.heads"),
    (lambda: lm.Config(heads=4, kv_heads=3), "Config.kv_heads"),
    (lambda: lm.Config(d_model=12, heads=4), "Config.heads: head_dim"),
    (lambda: lm.Config(layers=0), "Config.layers"),
    (lambda: lm.PageAllocator(1), "num_pages"),
    (lambda: _model()(np.zeros(5, np.int32)), "tokens"),
    (lambda: lm.serve(_model(), [], 3), "prompts"),
    (lambda: lm.serve(_model(), [np.array([1, 300])], 3), r"prompts\[0\]"),
    (lambda: lm.serve(_model(), [np.array([1, 2])], 0), r"max_new_tokens\[0\]"),
    (lambda: lm.serve(_model(), [np.array([1, 2])], [1, 2]), "max_new_tokens"),
    (lambda: lm.serve(_model(), [np.arange(40)], 8, page_size=4, num_pages=8), r"prompts\[0\]: needs 12"),
    (lambda: list(zip(range(1), lm.batches(np.arange(10), batch=2, seq=16), strict=False)), "data"),
    (lambda: lm.serve(_model(), [np.array([1, 2])], 3, cache_dtype="int8"), "cache_dtype: a quantized"),
    (lambda: lm.serve(_model(), [np.array([1, 2])], 3, chunk=4, cache_dtype="int4"), "cache_dtype"),
    (lambda: lm.serve(_model(), [np.array([1, 2])], 3, chunk=0), "chunk"),
    (lambda: lm.calibrate(_model(), [np.array([1, 2])], "int8", headroom=0.5), "headroom"),
    (lambda: lm.PagedCache.empty(CONFIG, 4, 4, dtype="int8"), "k_scale, v_scale"),
    (lambda: lm.PagedCache.empty(CONFIG, 4, 4, dtype="int8", k_scale=np.ones(2), v_scale=np.ones(2)),
     r"k_scale: expected float32 \[layers, kv_heads\]"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_impl_must_be_a_name():
    with pytest.raises(TypeError, match="impl"):
        lm.Transformer(CONFIG, rngs=nnx.Rngs(0), impl=None)


def test_importing_tpuattn_imports_neither_flax_nor_lm():
    code = "import sys, tpuattn; print('flax' in sys.modules, 'tpuattn.lm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_a_bfloat16_model_computes_and_caches_in_bfloat16():
    model = lm.Transformer(lm.Config(d_model=32, layers=1, heads=4, kv_heads=2, mlp_dim=64, dtype="bfloat16"),
                           rngs=nnx.Rngs(0))
    _, kvs = model.prefill(_tokens(1, 8))
    assert kvs[0][0].dtype == kvs[0][1].dtype == np.dtype("bfloat16")  # the KV cache's dtype
    served = lm.serve(model, [lm.encode("ab")], 3, page_size=4, num_pages=4)  # q and cache agree in dtype
    assert served.tokens[0].shape == (3,)
