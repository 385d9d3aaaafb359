"""Kept import path: ``tpuattn.roofline`` is :mod:`tpuattn.model.roofline` (the same module object)."""

import sys

from tpuattn.model import roofline as _module

sys.modules[__name__] = _module
