"""The package's own exceptions, one family, so that callers (the bench, the compile reports) catch by type.

All three contracts (:func:`tpuattn.attention`, :func:`tpuattn.parallel.attention`,
:func:`tpuattn.decode.attention`) raise these. Every one subclasses :class:`ValueError`: code
written against the contract's "bad input raises ValueError" keeps working.
"""

from __future__ import annotations


class TpuattnError(ValueError):
    """The base of the family: a request the package refuses (an unknown implementation name, say)."""


class UnsupportedInput(TpuattnError):
    """A valid input that the chosen implementation cannot serve (its ``supports`` refused it)."""


class UnavailableImplementation(TpuattnError):
    """The implementation exists but cannot run on this machine (its dependencies do not import, say)."""
