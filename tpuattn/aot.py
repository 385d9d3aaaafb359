"""``python -m tpuattn.aot``: compile reports for TPU chips (see :mod:`tpuattn.measure.aot`);
``python -m tpuattn.aot --slices``: sharded and ring attention for whole slices
(:mod:`tpuattn.measure.slices`).

Sets ``JAX_PLATFORMS=cpu`` before JAX starts (unless set): with libtpu installed JAX would otherwise
look for a TPU; the compile-only TPU topologies stay available.
"""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from tpuattn.measure import aot as _module
    from tpuattn.measure import slices as _slices

    (_slices.main if "--slices" in sys.argv[1:] else _module.main)()
else:
    from tpuattn.measure import aot as _module

    sys.modules[__name__] = _module
