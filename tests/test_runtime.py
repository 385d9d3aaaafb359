"""tpuattn.measure.runtime: where this runs, and the dry run's stand-in for a TPU."""

from __future__ import annotations

import jax
import pytest

from tpuattn import chips
from tpuattn.measure import runtime


def test_this_machine_is_described_as_it_is(monkeypatch):
    monkeypatch.delenv(runtime.STAND_IN_ENV, raising=False)
    info = runtime.info()
    assert info.backend == jax.default_backend() and not info.stand_in
    assert info.interpret == (info.backend != "tpu")
    assert info.on_tpu == (info.backend == "tpu")


@pytest.mark.parametrize("chip", ["v5e", "v6e", "v2"])
def test_a_stand_in_takes_the_tpu_paths_and_still_interprets(monkeypatch, chip):
    if jax.default_backend() == "tpu":  # pragma: no cover - the stand-in is for machines without one
        pytest.skip("a real TPU")
    monkeypatch.setenv(runtime.STAND_IN_ENV, chip)
    info = runtime.info()
    assert info.on_tpu and info.backend == "tpu" and info.stand_in
    assert info.interpret, "a CPU standing in for a TPU must still interpret Pallas kernels"
    assert chips.from_device_kind(info.device_kind) == chips.get(chip)
    assert "dry run" in info.label() and "dry run" in info.pallas_mode and "dry run" in info.summary()


def test_a_bad_stand_in_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(runtime.STAND_IN_ENV, "v9")
    with pytest.raises(ValueError, match=r"^TPUATTN_STAND_IN_TPU: expected a chip name in \[.*'v5e'.*\], "
                                         r"got 'v9'"):
        runtime.info()
