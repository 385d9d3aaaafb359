"""``python -m tpuattn.aot``: compile reports for TPU chips (see :mod:`tpuattn.measure.aot`);
``python -m tpuattn.aot --slices``: sharded and ring attention for whole slices
(:mod:`tpuattn.measure.slices`); ``python -m tpuattn.aot --reproduce FILE [--limit N]``: compile a
report file's recorded problems again and print a row-by-row diff (exit status 1 on a difference);
``python -m tpuattn.aot --static``: bundles and vmatmuls of the package's Pallas kernels
(:mod:`tpuattn.measure.static`); ``python -m tpuattn.aot --estimate-validate``: the compiled static estimate
of each published TPU measurement's program beside the measured time and the roofline
(:mod:`tpuattn.model.validation`); ``python -m tpuattn.aot --tune [--reproduce FILE]``: the Pallas kernel's
blocks chosen by the compiled static estimate (:mod:`tpuattn.measure.tune`).

Sets ``JAX_PLATFORMS=cpu`` before JAX starts (unless set): with libtpu installed JAX would otherwise
look for a TPU; the compile-only TPU topologies stay available.
"""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from tpuattn.measure import aot as _module
    from tpuattn.measure import reports as _reports
    from tpuattn.measure import slices as _slices
    from tpuattn.measure import static as _static
    from tpuattn.measure import tune as _tune

    argv = sys.argv[1:]
    if "--estimate-validate" in argv:  # the compiled static estimate against the published runs
        from tpuattn.model import validation as _validation

        _validation.main()
        raise SystemExit(0)
    (_tune.main if "--tune" in argv else _reports.main if "--reproduce" in argv
     else _slices.main if "--slices" in argv else _static.main if "--static" in argv else _module.main)()
else:
    from tpuattn.measure import aot as _module

    sys.modules[__name__] = _module
