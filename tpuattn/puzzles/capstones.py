"""Capstones: the learner writes a whole kernel, its ``pallas_call`` included (Triton-Puzzles' last
chapter; vorushin's Pallas puzzles' "configure your own pallas_call").

F. a causal GQA flash-attention forward with its logsumexp, on a block-skip schedule the learner builds
   (a scalar-prefetch table of the K/V blocks each query block visits); float32, and again in bfloat16;
G. its backward: the dQ and dK/dV kernels and the ``jax.custom_vjp`` that joins them to the forward,
   checked through ``jax.grad``;
H. a decode step that fetches its K/V pages itself, double-buffered (``pltpu.make_async_copy``, DMA
   semaphores, two VMEM slots), under the interpreter's race detector;
I. ring attention, causal, in one kernel per device that passes K/V to its neighbour with
   ``pltpu.make_async_remote_copy`` (two slots, and a semaphore the neighbour signals when a slot is
   free), under the race detector on four CPU devices.

An answer is a function that builds and calls its ``pallas_call`` s (``interpret=`` passed through).
It calls :func:`pallas_call` here: ``pl.pallas_call`` with the operands' names, which shows the check
its grid, BlockSpecs and scalar-prefetch tables (through :func:`tpuattn.puzzles.core.pallas_call`, so
the harness's own audits apply too). :func:`tpuattn.puzzles.core.check` runs it in interpret mode
against a float64 NumPy oracle written here from the formulas (nothing of ``tpuattn``'s kernels), then
audits what the values cannot show (the blocks each launch names), then compiles it for a TPU chip.
Importing this module registers the capstones in :data:`tpuattn.puzzles.core.REGISTRY`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from tpuattn.puzzles import core
from tpuattn.puzzles.core import Puzzle, register

# ---------------------------------------------------------------------------------------------------
# Shapes: small for interpret mode, tile-legal for the v5e compile.

HEAD_DIM = 128
SCALE = 1.0 / np.sqrt(HEAD_DIM)
HEADS, KV_HEADS = 4, 2                 # F, G: query heads h = 0..3 use kv head h // GROUP
GROUP = HEADS // KV_HEADS
SEQ, BLOCK = 512, 128                  # F: 4 query blocks and 4 K/V blocks per head
BF16_SEQ = 256                         # F in bfloat16
GRAD_SEQ = 256                         # G


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _normal(rng, shape, scale: float = 1.0) -> np.ndarray:
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def _bf16(array: np.ndarray) -> np.ndarray:
    return np.asarray(jnp.asarray(array, jnp.bfloat16))


def _f64(*arrays):
    return tuple(np.asarray(a, np.float64) for a in arrays)


# ---------------------------------------------------------------------------------------------------
# float64 oracles, from the formulas: S = Q Kᵀ · scale, masked causally; lse = log Σ exp S (natural
# log, per row); P = exp(S - lse); O = P V. The gradients of Σ O ∘ dO: dV = Pᵀ dO, dP = dO Vᵀ,
# dS = P ∘ (dP - rowsum(P ∘ dP)), dQ = dS K · scale, dK = dSᵀ Q · scale; a kv head's dK, dV sum over
# the query heads of its group.

def causal_visible(seq: int) -> np.ndarray:
    """``[seq, seq]`` bool: query ``r`` sees key ``c`` iff ``c <= r``."""
    return np.arange(seq)[None, :] <= np.arange(seq)[:, None]


def _head_probabilities(q, k, visible):
    s = np.where(visible, q @ k.T * SCALE, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(s - m).sum(axis=-1, keepdims=True))
    return np.exp(s - lse), lse


def attention64(q, k, v):
    """``(out [H, S, D], lse [H, S, 1])`` of causal GQA attention in float64: query head ``h`` attends
    with kv head ``h // (H / KV_H)``."""
    q, k, v = _f64(q, k, v)
    heads, seq, _ = q.shape
    group = heads // k.shape[0]
    visible = causal_visible(seq)
    out, lse = np.empty_like(q), np.empty((heads, seq, 1))
    for h in range(heads):
        p, lse[h] = _head_probabilities(q[h], k[h // group], visible)
        out[h] = p @ v[h // group]
    return out, lse


def gradients64(q, k, v, do):
    """``(dq, dk, dv)`` of ``Σ out ∘ do`` for :func:`attention64`'s ``out``, in float64."""
    q, k, v, do = _f64(q, k, v, do)
    heads, seq, _ = q.shape
    group = heads // k.shape[0]
    visible = causal_visible(seq)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for h in range(heads):
        g = h // group
        p, _ = _head_probabilities(q[h], k[g], visible)
        dp = do[h] @ v[g].T
        ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
        dq[h] = ds @ k[g] * SCALE
        dk[g] += ds.T @ q[h] * SCALE
        dv[g] += p.T @ do[h]
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------------
# What a check sees of an answer's launches: each pallas_call made through pallas_call() below while a
# check runs the answer in interpret mode.

@dataclasses.dataclass(frozen=True)
class Call:
    """One ``pallas_call`` an answer made: its grid, the BlockSpecs and shapes of its named inputs and
    outputs (a spec is ``None`` for an operand without an index map: the whole array, or memory the
    kernel copies itself), its scalar-prefetch values (NumPy; ``None`` where they were traced), its
    dimension semantics (``"arbitrary"`` where none were given), its outputs' names and the shapes of its
    scratch buffers."""

    grid: tuple[int, ...]
    specs: dict
    shapes: dict
    prefetch: tuple | None
    semantics: tuple[str, ...]
    out_names: tuple[str, ...] = ()
    scratch: tuple[tuple[int, ...], ...] = ()


_CALLS: list[Call] | None = None  # the launches of the answer being checked; None outside a check


def pallas_call(kernel, *, in_names: tuple[str, ...] = (), out_names: tuple[str, ...] = (), **kwargs):
    """``pl.pallas_call(kernel, **kwargs)`` for a capstone: the same arguments, plus the names of the
    inputs (after any scalar-prefetch operands) and of the outputs, so that the check can walk each
    operand's index map over the grid and name it in its messages."""
    launch = core.pallas_call(kernel, in_names=in_names, out_names=out_names, **kwargs)

    def run(*args):
        if _CALLS is not None:
            _CALLS.append(_describe(kwargs, args, in_names, out_names))
        return launch(*args)
    return run


def _describe(kwargs: dict, args: tuple, in_names, out_names) -> Call:
    grid_spec = kwargs.get("grid_spec")

    def get(name, default=None):
        return kwargs.get(name, default) if grid_spec is None else getattr(grid_spec, name, default)

    grid = tuple(int(n) for n in (get("grid", ()) or ()))
    num_prefetch = int(get("num_scalar_prefetch", 0) or 0)
    out_shapes = kwargs["out_shape"]
    out_shapes = list(out_shapes) if isinstance(out_shapes, (tuple, list)) else [out_shapes]
    in_specs = get("in_specs")
    in_specs = list(in_specs) if isinstance(in_specs, (tuple, list)) else []
    out_specs = get("out_specs")
    out_specs = list(out_specs) if isinstance(out_specs, (tuple, list)) else [out_specs] * len(out_shapes)
    specs, shapes = {}, {}
    for name, spec, array in itertools.chain(zip(in_names, in_specs, args[num_prefetch:], strict=False),
                                             zip(out_names, out_specs, out_shapes, strict=False)):
        has_map = getattr(spec, "block_shape", None) is not None and getattr(spec, "index_map", None)
        specs[name] = spec if has_map else None
        shapes[name] = tuple(np.shape(array))
    try:
        prefetch = tuple(np.asarray(a) for a in args[:num_prefetch])
    except Exception:  # noqa: BLE001 - traced (a jitted answer): the index maps cannot be walked
        prefetch = None
    params = kwargs.get("compiler_params")
    semantics = getattr(params, "dimension_semantics", None)
    semantics = tuple(str(s).lower() for s in semantics) if semantics else ("arbitrary",) * len(grid)
    scratch = get("scratch_shapes", ()) or ()
    scratch = tuple(tuple(getattr(buffer, "shape", ()) or ()) for buffer in scratch)
    return Call(grid, specs, shapes, prefetch, semantics, tuple(out_names), scratch)


@contextlib.contextmanager
def _recording():
    global _CALLS
    outer, _CALLS = _CALLS, []
    try:
        yield _CALLS
    finally:
        _CALLS = outer


# The launches of the last interpret-mode run of each capstone, for its audit (check runs the values
# first, then the audit, in one process and in order).
_LAST: dict[str, list[Call]] = {}


def _builder(name: str, wrap):
    """A puzzle's ``build``: ``wrap(answer, interpret)`` -> ``fn(*inputs)``, with the launches of every
    interpret-mode run recorded under ``name`` for the audit."""
    def build(answer, *, interpret):
        fn = wrap(answer, interpret)
        if interpret is False:
            return fn

        def recorded(*inputs):
            with _recording() as calls:
                result = fn(*inputs)
            _LAST[name] = calls
            return result
        return recorded
    return build


def _walk(spec, grid, prefetch):
    """``[(step, block)]``: the spec's index map at every grid step, in the pipeline's order (the last
    axis fastest), evaluated on the host with the NumPy scalar-prefetch tables."""
    walk = []
    for step in itertools.product(*(range(n) for n in grid)):
        block = spec.index_map(*step, *prefetch)
        block = block if isinstance(block, (tuple, list)) else (block,)
        walk.append((step, tuple(int(b) for b in block)))
    return walk


def _fetches(walk) -> int:
    """How many steps of ``walk`` name a block other than the previous step's (each starts a copy)."""
    return sum(1 for n, (_, block) in enumerate(walk) if n == 0 or block != walk[n - 1][1])


def _tiles_seen(call: Call, block_q: int, block_kv: int, group: int) -> str | None:
    """``None`` if at every grid step of ``call`` the q and k index maps name a query block and a K/V
    block that the causal mask lets meet, the K/V block of the query head's own kv head; else a sentence
    on the first step that does not. Index maps return ``(head, block, 0)``."""
    q_walk = _walk(call.specs["q"], call.grid, call.prefetch)
    kv_walk = _walk(call.specs["k"], call.grid, call.prefetch)
    for (step, (h, i, *_)), (_, (g, j, *_)) in zip(q_walk, kv_walk, strict=True):
        if g != h // group:
            return (f"at grid step {step} of {_label(call)} the k index map names kv head {g} for query "
                    f"head {h}, which uses kv head {h // group}")
        if j * block_kv > i * block_q + block_q - 1:
            return (f"at grid step {step} of {_label(call)} the q and k index maps name query block {i} "
                    f"and K/V block {j}, which the causal mask keeps apart: a copy for nothing (name only "
                    "the tiles of the schedule; where a row of it ends, repeat its last block)")
    return None


def _label(call: Call) -> str:
    return f"the launch that writes {', '.join(call.out_names)}"


# ---------------------------------------------------------------------------------------------------
# F. the forward: out, lse = flash_forward(q, k, v, interpret=...) with q [HEADS, seq, HEAD_DIM],
# k, v [KV_HEADS, seq, HEAD_DIM], out like q, lse [HEADS, seq, 1] float32; causal; blocks of BLOCK.

def visible_tiles(seq: int = SEQ, block: int = BLOCK) -> int:
    """The (query block, K/V block) tiles of one head that the causal mask leaves visible."""
    n = seq // block
    return n * (n + 1) // 2


def _forward_wrap(answer, interpret):
    def fn(q, k, v):
        out, lse = answer(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), interpret=interpret)
        return out, lse
    return fn


def _audit_launches(name: str, seq: int, required: tuple[str, ...], optional: tuple[str, ...] = (), *,
                    table: bool = False):
    """The audit of a flash capstone. The answer made a launch writing each output named in ``required``
    (and may have made one writing each of ``optional``). In each of those launches the q and k index
    maps name only tiles the causal mask leaves visible, with the query head's own kv head, and no
    operand among q, k, v is copied more often than once per visible tile and query head; ``table``:
    each launch takes a scalar-prefetch schedule."""
    def audit(answer):
        calls = _LAST.get(name, [])
        if not calls:
            return ("the check saw no launch: build each kernel with capstones.pallas_call (pl.pallas_call "
                    "that also names its operands, so the check can walk the index maps)")
        for output in required + optional:
            call = next((c for c in calls if output in c.out_names), None)
            if call is None and output in optional:
                continue
            if call is None:
                return (f"the check saw no launch with an output named {output!r} (out_names= of "
                        "capstones.pallas_call)")
            found = _audit_flash_launch(call, seq, table)
            if found is not None:
                return found
        return None
    return audit


def _audit_flash_launch(call: Call, seq: int, table: bool) -> str | None:
    missing = [n for n in ("q", "k", "v") if call.specs.get(n) is None]
    if missing:
        return (f"{_label(call)} has no BlockSpec with an index map for an input named {missing[0]!r} "
                "(in_names= of capstones.pallas_call)")
    if call.prefetch is None:
        return (f"{_label(call)} took traced scalar-prefetch tables (a jitted answer): the check cannot "
                "walk its index maps; leave the jit to the check")
    if table and not call.prefetch:
        return (f"{_label(call)} has no scalar-prefetch operand: the capstone asks for the schedule as a "
                "table in SMEM (pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=...))")
    found = _tiles_seen(call, BLOCK, BLOCK, GROUP)
    if found is not None:
        return found
    enough = HEADS * visible_tiles(seq)
    for operand in ("q", "k", "v"):
        copies = _fetches(_walk(call.specs[operand], call.grid, call.prefetch))
        if copies > enough:
            return (f"in {_label(call)} the {operand} index map starts {copies} copies; {enough} are "
                    "enough (one per visible tile and query head): a step that names the block the step "
                    "before it named copies nothing")
    return None


def _forward_inputs(seed: int, seq: int, dtype):
    rng = _rng(seed)
    arrays = (_normal(rng, (HEADS, seq, HEAD_DIM)), _normal(rng, (KV_HEADS, seq, HEAD_DIM)),
              _normal(rng, (KV_HEADS, seq, HEAD_DIM)))
    return arrays if dtype == "float32" else tuple(_bf16(a) for a in arrays)


FORWARD_NAME = "F. capstone: causal GQA flash forward"
FORWARD_BF16_NAME = "F. capstone: causal GQA flash forward, bfloat16"

FORWARD = register(Puzzle(
    FORWARD_NAME, _builder(FORWARD_NAME, _forward_wrap), lambda: _forward_inputs(21, SEQ, "float32"),
    attention64, rtol=1e-4, atol=1e-5, audit=_audit_launches(FORWARD_NAME, SEQ, ("out",), table=True),
    outputs=("out", "lse")))

# bfloat16 inputs and output: the output's own rounding is 2**-9 relative, and P rounded to bfloat16
# for the P V matmul adds as much again; the logsumexp stays float32.
FORWARD_BF16 = register(Puzzle(
    FORWARD_BF16_NAME, _builder(FORWARD_BF16_NAME, _forward_wrap),
    lambda: _forward_inputs(22, BF16_SEQ, "bfloat16"), attention64, rtol=2e-2, atol=2e-2,
    audit=_audit_launches(FORWARD_BF16_NAME, BF16_SEQ, ("out",), table=True),
    outputs=("out", "lse")))


# ---------------------------------------------------------------------------------------------------
# G. the backward: flash_attention(q, k, v, interpret=...) -> out, differentiable through the learner's
# jax.custom_vjp (their forward, a dQ launch, a dK/dV launch); checked as jax.grad of Σ out ∘ do.

def _gradient_wrap(answer, interpret):
    def fn(q, k, v, do):
        do = jnp.asarray(do)

        def loss(q, k, v):
            return jnp.sum(answer(q, k, v, interpret=interpret).astype(jnp.float32) * do)

        return jax.grad(loss, argnums=(0, 1, 2))(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    return fn


def _gradient_inputs():
    rng = _rng(23)
    return (_normal(rng, (HEADS, GRAD_SEQ, HEAD_DIM)), _normal(rng, (KV_HEADS, GRAD_SEQ, HEAD_DIM)),
            _normal(rng, (KV_HEADS, GRAD_SEQ, HEAD_DIM)), _normal(rng, (HEADS, GRAD_SEQ, HEAD_DIM)))


BACKWARD_NAME = "G. capstone: the backward and its custom VJP"

# Each gradient sums up to 256 float32 products per element (dQ over the keys, dK and dV over the
# queries of two heads); the largest are about 7.
BACKWARD = register(Puzzle(
    BACKWARD_NAME, _builder(BACKWARD_NAME, _gradient_wrap), _gradient_inputs, gradients64,
    rtol=1e-4, atol=1e-4,
    audit=_audit_launches(BACKWARD_NAME, GRAD_SEQ, ("dq", "dk"), optional=("out",)),
    outputs=("dQ", "dK", "dV")))


def package_forward(q, k, v, *, interpret=True):
    """tpuattn's own Pallas forward in capstone F's layout: ``(out [H, S, D], lse [H, S, 1])``, causal,
    for a backward whose learner skipped F. (The package decides interpret mode itself: interpreted off
    a TPU, compiled inside :func:`tpuattn.chips.target`; ``interpret`` is accepted and unused.)"""
    import tpuattn
    from tpuattn import api, softmax

    def contract(a):  # [heads, seq, head_dim] -> the contract's [batch, seq, heads, head_dim]
        return jnp.swapaxes(a, 0, 1)[None]

    q4, k4, v4, segment_ids, spec = tpuattn.make_spec(contract(q), contract(k), contract(v), causal=True)
    part = api.resolve("pallas", spec).partial.forward(q4, k4, v4, segment_ids, spec)
    out = jnp.swapaxes(part.out[0], 0, 1).astype(q.dtype)
    return out, softmax.to_lse(part)[0][..., None]


# ---------------------------------------------------------------------------------------------------
# H. a decode step over a paged cache, its pages copied by hand: out = decode_step(q, k_pages, v_pages,
# page_table, lengths, interpret=...). One new token per sequence with DECODE_HEADS query heads sharing
# one kv head; the cache is a pool of pages k_pages, v_pages [NUM_PAGES, PAGE_SIZE, HEAD_DIM] (left in
# HBM: memory_space=pl.ANY); sequence b's token t sits in page page_table[b, t // PAGE_SIZE], row
# t % PAGE_SIZE. Entries of the table past a sequence's last page name POISON_PAGE, whose rows are NaN:
# a kernel that computes with a page the sequence does not own gets NaN.

DECODE_HEADS, PAGE_SIZE, PAGES_PER_SEQ, NUM_PAGES = 8, 16, 8, 12
POISON_PAGE = NUM_PAGES - 1
DECODE_LENGTHS = (100, 37)   # 7 pages and 3 pages


def decode_tables():
    """``(page_table [B, PAGES_PER_SEQ], lengths [B])`` int32: the pages a sequence owns, handed out in a
    shuffled order; the rest of its row names :data:`POISON_PAGE`."""
    order = _rng(24).permutation(POISON_PAGE)
    table = np.full((len(DECODE_LENGTHS), PAGES_PER_SEQ), POISON_PAGE, np.int32)
    used = 0
    for b, length in enumerate(DECODE_LENGTHS):
        n = -(-length // PAGE_SIZE)
        table[b, :n] = order[used:used + n]
        used += n
    return table, np.asarray(DECODE_LENGTHS, np.int32)


def _decode_inputs():
    rng = _rng(25)
    q = _normal(rng, (len(DECODE_LENGTHS), DECODE_HEADS, HEAD_DIM), 2.0)
    k_pages, v_pages = (_normal(rng, (NUM_PAGES, PAGE_SIZE, HEAD_DIM)) for _ in range(2))
    k_pages[POISON_PAGE] = v_pages[POISON_PAGE] = np.nan
    return (q, k_pages, v_pages, *decode_tables())


def decode64(q, k_pages, v_pages, page_table, lengths):
    """``out [B, DECODE_HEADS, HEAD_DIM]``: each sequence's query heads attend its ``lengths[b]`` cached
    tokens, in float64."""
    q, k_pages, v_pages = _f64(q, k_pages, v_pages)
    out = np.empty_like(q)
    for b, length in enumerate(np.asarray(lengths)):
        k = k_pages[page_table[b]].reshape(-1, q.shape[-1])[:length]
        v = v_pages[page_table[b]].reshape(-1, q.shape[-1])[:length]
        p, _ = _head_probabilities(q[b], k, np.ones((q.shape[1], length), bool))
        out[b] = p @ v
    return out


def _decode_wrap(answer, interpret):
    def fn(q, k_pages, v_pages, page_table, lengths):
        return answer(*(jnp.asarray(a) for a in (q, k_pages, v_pages, page_table, lengths)),
                      interpret=interpret)
    return fn


DECODE_NAME = "H. capstone: decode, pages copied by hand"

def _decode_audit(answer):
    calls = _LAST.get(DECODE_NAME, [])
    if len(calls) != 1:
        return (f"the check saw {len(calls)} launches through capstones.pallas_call; the capstone asks for "
                "one, named with in_names=(\"q\", \"k_pages\", \"v_pages\")")
    call = calls[0]
    for name in ("k_pages", "v_pages"):
        if name not in call.specs:
            return f"the launch has no input named {name!r} (in_names= of capstones.pallas_call)"
        if call.specs[name] is not None:
            return (f"{name} has a BlockSpec with an index map, so the pipeline copies its pages; the "
                    "capstone asks the kernel to copy them itself (pl.BlockSpec(memory_space=pl.ANY), "
                    "pltpu.make_async_copy)")
    slots = [shape for shape in call.scratch if tuple(shape[-2:]) == (PAGE_SIZE, HEAD_DIM)]
    if not any(len(shape) == 3 and shape[0] >= 2 for shape in slots):
        return (f"no VMEM scratch holds two pages ({PAGE_SIZE}, {HEAD_DIM}): with one slot, the copy of "
                "page p + 1 cannot run while page p is read; give K and V two slots each")
    return None


DECODE = register(Puzzle(
    DECODE_NAME, _builder(DECODE_NAME, _decode_wrap), _decode_inputs, decode64, rtol=1e-4, atol=1e-5,
    detect_races=True, audit=_decode_audit, outputs=("out",)))


# ---------------------------------------------------------------------------------------------------
# I. ring attention, causal, in one kernel per device: out = ring_attention(q, k, v, interpret=...)
# inside shard_map over RING_DEVICES devices on the mesh axis RING_AXIS. Device d holds query block d
# and, at first, K/V block d (RING_ROWS rows each, one head); the kernel runs the ring's RING_DEVICES
# steps, passing K/V to device d + 1 with pltpu.make_async_remote_copy, so that at step s it holds K/V
# block (d - s) mod RING_DEVICES.

RING_DEVICES, RING_ROWS, RING_AXIS = 4, 32, "ring"


def ring_devices() -> list:
    """The CPU devices the ring's interpret-mode check runs on (``XLA_FLAGS=
    --xla_force_host_platform_device_count=4`` or more, set before JAX starts)."""
    devices = jax.devices("cpu")
    if len(devices) < RING_DEVICES:
        raise RuntimeError(
            f"the ring capstone needs {RING_DEVICES} CPU devices, and this process has {len(devices)}: "
            f"set XLA_FLAGS=--xla_force_host_platform_device_count={RING_DEVICES} before JAX starts "
            "(the notebook's first import cell does), then restart")
    return devices[:RING_DEVICES]


def _shard_map(fn, mesh):
    from jax.sharding import PartitionSpec

    spec = PartitionSpec(RING_AXIS)

    def local(q, k, v):  # each device's block arrives as [1, RING_ROWS, HEAD_DIM]
        return fn(q[0], k[0], v[0])[None]

    if hasattr(jax, "shard_map"):
        return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
    from jax.experimental.shard_map import shard_map  # JAX 0.7.2

    return shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_rep=False)


def _ring_wrap(answer, interpret):
    if interpret is not False:
        mesh = jax.sharding.Mesh(np.array(ring_devices()), (RING_AXIS,))
        return jax.jit(_shard_map(lambda q, k, v: answer(q, k, v, interpret=interpret), mesh))

    def compile_on_slice(q, k, v):
        # check() compiles for one device of its chip; a ring needs four. So this function, traced
        # inside that compile (whose chips.target names the chip), compiles the ring for a
        # compile-only 2x2 slice of the same chip -- the compiler's errors propagate -- and hands the
        # one-device compile its input unchanged.
        from jax.sharding import NamedSharding, PartitionSpec

        from tpuattn import chips
        from tpuattn.measure import aot

        chip = chips.target_chip() or chips.get("v5e")
        mesh = jax.sharding.Mesh(np.array(aot._topology(chip.topology).devices[:RING_DEVICES]),
                                 (RING_AXIS,))
        sharding = NamedSharding(mesh, PartitionSpec(RING_AXIS))
        placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in (q, k, v)]
        jax.jit(_shard_map(lambda q, k, v: answer(q, k, v, interpret=False), mesh)).lower(*placed).compile()
        return q
    return compile_on_slice


def _ring_inputs():
    rng = _rng(26)
    return tuple(_normal(rng, (RING_DEVICES, RING_ROWS, HEAD_DIM)) for _ in range(3))


def ring64(q, k, v):
    """``out [RING_DEVICES, RING_ROWS, HEAD_DIM]``: causal attention over the whole sequence (the
    devices' blocks in order), in float64, cut back into the devices' blocks."""
    q, k, v = _f64(q, k, v)
    n, rows, d = q.shape
    out, _ = attention64(q.reshape(1, n * rows, d), k.reshape(1, n * rows, d), v.reshape(1, n * rows, d))
    return out.reshape(n, rows, d)


def _ring_audit(answer):
    calls = _LAST.get(RING_NAME, [])
    if len(calls) != 1:
        return (f"the check saw {len(calls)} launches through capstones.pallas_call; the capstone asks for "
                "the whole ring in one kernel per device, its K/V moved by remote copies inside it")
    return None


RING_NAME = "I. capstone: ring attention with remote copies, causal"

RING = register(Puzzle(
    RING_NAME, _builder(RING_NAME, _ring_wrap), _ring_inputs, ring64, rtol=1e-4, atol=1e-5,
    detect_races=True, audit=_ring_audit, outputs=("out",)))

PUZZLES = (FORWARD, FORWARD_BF16, BACKWARD, DECODE, RING)

__all__ = ["BF16_SEQ", "BLOCK", "Call", "DECODE_HEADS", "DECODE_LENGTHS", "GRAD_SEQ", "GROUP", "HEADS",
           "HEAD_DIM", "KV_HEADS", "NUM_PAGES", "PAGES_PER_SEQ", "PAGE_SIZE", "POISON_PAGE", "PUZZLES",
           "RING_AXIS", "RING_DEVICES", "RING_ROWS", "SCALE", "SEQ", "attention64", "causal_visible",
           "decode64", "decode_tables", "gradients64", "package_forward", "pallas_call", "ring64",
           "ring_devices", "visible_tiles"] + [
    "BACKWARD", "DECODE", "FORWARD", "FORWARD_BF16", "RING"]
