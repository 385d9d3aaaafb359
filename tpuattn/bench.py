"""Kept import path and the command line.

``import tpuattn.bench`` gives :mod:`tpuattn.measure.bench` (the same module object);
``python -m tpuattn.bench`` runs its command line with ``--figures`` drawn by :mod:`tpuattn.viz.timings`.
"""

import sys

from tpuattn.measure import bench as _module

if __name__ == "__main__":
    from tpuattn.viz import timings as _figures

    _module.main(save_figures=_figures.save_figures)
else:
    sys.modules[__name__] = _module
