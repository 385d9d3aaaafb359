"""Where am I running? One place that says so, for notebooks, benchmarks and figures.

**The dry run.** With ``TPUATTN_STAND_IN_TPU=<chip>`` (e.g. ``v5e``) in the environment, :func:`info`
describes a *stand-in* for that TPU: ``backend == "tpu"`` and that chip's device kind, so a notebook
takes its TPU-runtime paths (``if PLATFORM.on_tpu: ...``), while the machine is still a CPU:
``interpret`` stays True (Pallas kernels run in interpret mode) and device memory is the host's
(:mod:`tpuattn.measure.memory` measures the child process's RSS). The test command runs the
notebooks' TPU paths this way (its ``dry-run`` stage) so their Python is exercised; nothing it prints
is a TPU number, and the project has not run those paths on a TPU.
"""

from __future__ import annotations

import dataclasses
import os
import platform as _py_platform

import jax


@dataclasses.dataclass(frozen=True)
class PlatformInfo:
    jax_version: str
    jaxlib_version: str
    python_version: str
    backend: str  # "cpu", "tpu", "gpu"
    device_kind: str  # e.g. "cpu", "TPU v5 lite", "NVIDIA H200"
    device_count: int
    stand_in: bool = False  # a CPU standing in for a TPU (the dry run; see the module docstring)

    @property
    def on_tpu(self) -> bool:
        """Take the TPU-runtime paths (True on a TPU, and on a stand-in for one)."""
        return self.backend == "tpu"

    @property
    def interpret(self) -> bool:
        """Whether Pallas TPU kernels must run in interpret mode here (everywhere but a real TPU)."""
        return not self.on_tpu or self.stand_in

    @property
    def pallas_mode(self) -> str:
        """How Pallas TPU kernels run here: compiled on a TPU, interpreted elsewhere."""
        if self.stand_in:
            return f"interpret (a CPU standing in for a {self.device_kind}: a dry run, not TPU numbers)"
        return "compiled" if self.on_tpu else "interpret"

    def label(self, *, interpret: bool = False) -> str:
        """A short label for numbers and figures, e.g. ``"cpu (interpret)"`` or ``"TPU v5 lite"``."""
        if self.stand_in:
            return f"cpu standing in for {self.device_kind} (dry run)"
        kind = self.device_kind if self.backend != "cpu" else "cpu"
        return f"{kind} (interpret)" if interpret and not self.on_tpu else kind

    def summary(self) -> str:
        return (f"JAX {self.jax_version} (jaxlib {self.jaxlib_version}), Python {self.python_version}, "
                f"backend {self.backend}, {self.device_count} x {self.device_kind}; "
                f"Pallas TPU kernels run {self.pallas_mode}")


STAND_IN_ENV = "TPUATTN_STAND_IN_TPU"


def info() -> PlatformInfo:
    import jaxlib

    device = jax.devices()[0]
    chip_name = os.environ.get(STAND_IN_ENV)
    if chip_name:
        from tpuattn import chips

        if jax.default_backend() == "tpu":
            raise ValueError(f"{STAND_IN_ENV}: a stand-in is for machines without a TPU; this one has "
                             f"{device.device_kind}")
        if chip_name not in chips.NAMES:
            raise ValueError(f"{STAND_IN_ENV}: expected a chip name in {list(chips.NAMES)}, "
                             f"got {chip_name!r}")
        chip = chips.get(chip_name)
        return PlatformInfo(jax_version=jax.__version__, jaxlib_version=getattr(jaxlib, "__version__", "?"),
                            python_version=_py_platform.python_version(), backend="tpu",
                            device_kind=chip.device_kinds[0], device_count=jax.device_count(), stand_in=True)
    return PlatformInfo(
        jax_version=jax.__version__,
        jaxlib_version=getattr(jaxlib, "__version__", "?"),
        python_version=_py_platform.python_version(),
        backend=jax.default_backend(),
        device_kind=str(getattr(device, "device_kind", device.platform)),
        device_count=jax.device_count(),
    )

