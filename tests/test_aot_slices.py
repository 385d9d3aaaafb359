"""Sharded and ring attention through the real TPU compiler for a whole slice (compiled, not run).

In the compile stage (libtpu installed, JAX_PLATFORMS=cpu). A 4-chip v5e slice keeps the compiles
short; the committed report (8 chips) is checked for what it must show.
"""

from __future__ import annotations

import pytest

from tpuattn.measure import aot, slices

pytestmark = pytest.mark.skipif(not aot.tpu_available(),
                                reason="needs libtpu (the compile stage installs it)")


@pytest.fixture(scope="module")
def rows():
    return {strategy: slices.slice_row("v5e:2x2", strategy, "fwd", 16384)
            for strategy in ("ring", "allgather")}


def test_the_ring_compiles_to_permutes_the_compiler_overlaps(rows):
    ring = rows["ring"]
    assert ring["status"] == "ok", ring["error"]
    assert ring["devices"] == 4
    # The ring's loop sends K and V on once per iteration; nothing is gathered. The sends are
    # asynchronous and the compiler schedules work inside them.
    assert ring["collective_permutes"] >= 2 and ring["all_gathers"] == 0
    assert ring["async_collectives"] == ring["collective_permutes"]
    assert ring["overlapped_collectives"] >= 1


def test_allgather_compiles_to_gathers(rows):
    gather = rows["allgather"]
    assert gather["status"] == "ok", gather["error"]
    assert gather["all_gathers"] >= 2 and gather["collective_permutes"] == 0


def test_committed_slice_report_shows_what_the_notebook_reads():
    report = slices.committed()
    assert report["command"][:4] == ["python", "-m", "tpuattn.aot", "--slices"]
    rows = report["rows"]
    assert set(slices.SLICES) <= {r["topology"] for r in rows}
    for topology in slices.SLICES:
        for strategy in ("ring", "allgather"):
            mine = [r for r in rows if r["topology"] == topology and r["strategy"] == strategy
                    and r["mode"] == "fwd" and r["status"] == "ok"]
            assert len(mine) >= 2, (topology, strategy)
        ring = sorted((r["seq_len"], r["peak_hbm_bytes"]) for r in rows if r["topology"] == topology
                      and r["strategy"] == "ring" and r["mode"] == "fwd" and r["status"] == "ok")
        # Memory per device grows with the sequence: the ring holds T / n of it.
        assert all(a[1] < b[1] for a, b in zip(ring, ring[1:], strict=False))
    # Twice the chips at the same length: the ring's memory per device about halves.
    per_n = {r["devices"]: r["peak_hbm_bytes"] for r in rows if r["chip"] == "v5e" and r["strategy"] == "ring"
             and r["seq_len"] == 131072 and r["mode"] == "fwd" and r["status"] == "ok"}
    assert 0.4 < per_n[8] / per_n[4] < 0.6
