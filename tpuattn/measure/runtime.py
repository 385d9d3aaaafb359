"""Where am I running? One place that says so, for notebooks, benchmarks and figures."""

from __future__ import annotations

import dataclasses
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

    @property
    def on_tpu(self) -> bool:
        return self.backend == "tpu"

    @property
    def pallas_mode(self) -> str:
        """How Pallas TPU kernels run here: compiled on a TPU, interpreted elsewhere."""
        return "compiled" if self.on_tpu else "interpret"

    def label(self, *, interpret: bool = False) -> str:
        """A short label for numbers and figures, e.g. ``"cpu (interpret)"`` or ``"TPU v5 lite"``."""
        kind = self.device_kind if self.backend != "cpu" else "cpu"
        return f"{kind} (interpret)" if interpret and not self.on_tpu else kind

    def summary(self) -> str:
        return (f"JAX {self.jax_version} (jaxlib {self.jaxlib_version}), Python {self.python_version}, "
                f"backend {self.backend}, {self.device_count} x {self.device_kind}; "
                f"Pallas TPU kernels run {self.pallas_mode}")


def info() -> PlatformInfo:
    import jaxlib

    device = jax.devices()[0]
    return PlatformInfo(
        jax_version=jax.__version__,
        jaxlib_version=getattr(jaxlib, "__version__", "?"),
        python_version=_py_platform.python_version(),
        backend=jax.default_backend(),
        device_kind=str(getattr(device, "device_kind", device.platform)),
        device_count=jax.device_count(),
    )

