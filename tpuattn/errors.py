"""The package's own exceptions, so that callers (the bench, the compile reports) catch by type.

Both subclass :class:`ValueError`: code written against the contract's "bad input raises
ValueError" keeps working.
"""

from __future__ import annotations


class UnsupportedInput(ValueError):
    """A valid input that the chosen implementation cannot serve (its ``supports`` refused it)."""


class UnavailableImplementation(ValueError):
    """The implementation exists but cannot run on this machine (or for the requested target)."""
