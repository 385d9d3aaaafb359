"""Kept import path and CLI: ``tpuattn.bench`` is :mod:`tpuattn.measure.bench` (the same module
object), and ``python -m tpuattn.bench`` runs its CLI."""

import sys

from tpuattn.measure import bench as _module

if __name__ == "__main__":
    _module.main()
else:
    sys.modules[__name__] = _module
