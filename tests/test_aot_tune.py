"""Blocks tuned by the compiler (:mod:`tpuattn.measure.tune`): the committed table
``tpuattn/pallas/tuned_blocks.json`` loads with what made it, every entry is a legal block for its chip,
the Pallas kernel's defaults come from it, and the grid shares the estimate weighs the kernels' branches by
are those of the causal mask, counted here element by element in NumPy. No re-tune runs here (each
candidate is a compile of seconds): ``python -m tpuattn.aot --tune --reproduce FILE`` remakes the table."""

from __future__ import annotations

import numpy as np
import pytest

from tpuattn import chips
from tpuattn.measure import tune
from tpuattn.pallas import blocks

TABLE = tune.load()


def test_the_table_records_what_made_it():
    assert TABLE["kind"] == "tuned" and TABLE["label"] == tune.LABEL
    assert TABLE["command"][:4] == ["python", "-m", "tpuattn.aot", "--tune"]
    assert set(TABLE["versions"]) == {"python", "jax", "jaxlib", "libtpu"}
    assert TABLE["created"][:2] == "20"
    assert TABLE["rows"], "no tuned entry"
    # every chosen entry is the fastest of its candidates' estimates
    for entry in TABLE["rows"]:
        tried = [r for r in TABLE["candidates_estimated"]
                 if r["chip"] == entry["chip"] and r["seq_len"] == entry["seq_len"] and r["seconds"]]
        fwd = [r["seconds"] for r in tried if r["mode"] == "fwd"]
        both = [r["seconds"] for r in tried if r["mode"] == "fwd+bwd"]
        assert entry["fwd_seconds"] <= min(fwd) * 1.005 and entry["fwd_bwd_seconds"] <= min(both) * 1.005


@pytest.mark.parametrize("entry", TABLE["rows"], ids=lambda e: f"{e['chip']}-{e['seq_len']}")
def test_every_entry_is_a_legal_block_for_its_chip(entry):
    # The VMEM model's need fits the three quarters of the chip's VMEM a kernel may ask for
    # (blocks.fit_q_heads), and the compiler accepted the pair at its default scoped limit.
    chip = chips.get(entry["chip"])
    budget = chip.vmem_bytes * 3 // 4
    forward = blocks.forward_vmem_bytes(entry["block_q"], entry["block_kv"], 128, 2)
    backward = blocks.backward_vmem_bytes(entry["backward_block_q"], entry["backward_block_kv"], 128, 2)
    assert forward <= budget and backward <= budget, (forward, backward, budget)
    for kernel, pair in (("forward", (entry["block_q"], entry["block_kv"])),
                         ("backward", (entry["backward_block_q"], entry["backward_block_kv"]))):
        accepted = blocks.compiled_pairs(entry["chip"], kernel, 128, "bfloat16")
        assert not accepted or pair in accepted, f"{kernel} {pair} not compiled for {entry['chip']}"
        # the blocks' own rules (multiples of 8 and 128) hold: constructing them raises otherwise
        made = blocks.ForwardBlocks(*pair) if kernel == "forward" else blocks.BackwardBlocks(*pair)
        assert (made.block_q, made.block_kv) == pair


@pytest.mark.parametrize("entry", TABLE["rows"], ids=lambda e: f"{e['chip']}-{e['seq_len']}")
def test_the_defaults_come_from_the_table(entry):
    expected = blocks.BlockSizes(blocks.ForwardBlocks(entry["block_q"], entry["block_kv"]),
                                 blocks.BackwardBlocks(entry["backward_block_q"], entry["backward_block_kv"]))
    chip, seq_len = entry["chip"], entry["seq_len"]
    assert blocks.default_block_sizes(128, "bfloat16", chip=chip, seq_len=seq_len) == expected
    # a length between classes takes the nearest class's (by ratio); 1.2x is nearer its own than any other
    near = int(entry["seq_len"] * 1.2)
    classes = sorted({r["seq_len"] for r in TABLE["rows"] if r["chip"] == entry["chip"]})
    if min(classes, key=lambda t: abs(np.log(t / near))) == entry["seq_len"]:
        assert blocks.default_block_sizes(128, "bfloat16", chip=entry["chip"], seq_len=near) == expected


def test_without_a_tuned_entry_the_compiled_table_decides():
    for chip in ("v5e", "v4"):
        compiled = blocks._from_compiled(chips.get(chip), 128, "bfloat16", 1)
        assert compiled is not None
        assert blocks.default_block_sizes(128, "bfloat16", chip=chip) == compiled  # no length given
    assert not [r for r in TABLE["rows"] if r["chip"] == "v4"]
    assert blocks.default_block_sizes(128, "bfloat16", chip="v4", seq_len=8192) == \
        blocks._from_compiled(chips.get("v4"), 128, "bfloat16", 1)
    assert blocks.default_block_sizes(128, "float32", chip="v5e", seq_len=8192) == \
        blocks._from_compiled(chips.get("v5e"), 128, "float32", 1)  # the table holds bfloat16 only


def _oracle_shares(seq_len, block_q, block_kv, transposed):
    """Visible / partial tiles of a causal square problem, counted from every element."""
    rows, cols = np.arange(seq_len)[:, None], np.arange(seq_len)[None, :]
    visible = cols <= rows
    nq, nk = seq_len // block_q, seq_len // block_kv
    tiles = visible.reshape(nq, block_q, nk, block_kv).transpose(0, 2, 1, 3)
    some, every = tiles.any(axis=(2, 3)), tiles.all(axis=(2, 3))
    if transposed:
        some, every = some.T, every.T
    steps = some.sum(axis=1).max()
    total = some.shape[0] * steps
    return some.sum() / total, (some & ~every).sum() / total, 1 / steps


@pytest.mark.parametrize("block_q, block_kv", [(512, 512), (1024, 512), (256, 1024)])
@pytest.mark.parametrize("transposed", [False, True])
def test_grid_weights_are_the_causal_tiles(block_q, block_kv, transposed):
    got = tune.grid_weights(2048, block_q, block_kv, True, transposed=transposed)
    compute, partial, edge = _oracle_shares(2048, block_q, block_kv, transposed)
    assert (got.compute, got.partial, got.edge) == pytest.approx((compute, partial, edge))


def test_reproduce_names_a_changed_block():
    entry = dict(TABLE["rows"][0])
    assert tune.diff(TABLE, TABLE["rows"]) == []
    changed = dict(entry, block_q=entry["block_q"] // 2)
    key = f"('{entry['chip']}', {entry['seq_len']})"
    half = entry["block_q"] // 2
    assert tune.diff({"rows": [entry]}, [changed]) == [f"{key} block_q: {entry['block_q']} -> {half}"]
    slower = dict(entry, fwd_seconds=entry["fwd_seconds"] * 1.02)
    assert tune.diff({"rows": [entry]}, [slower])[0].startswith(f"{key} fwd_seconds:")
    assert tune.diff({"rows": [entry]}, [])[0] == f"{key}: missing now"
