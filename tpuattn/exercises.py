"""Run a notebook's exercise checks so that unfinished stubs keep "Run All" green."""

from __future__ import annotations

from collections.abc import Callable


class NotCheckable(Exception):  # noqa: N818 - a state, like StopIteration, not an error
    """Raised by a check that cannot run on this installation (it says why); reported, not raised."""


def run_checks(checks: dict[str, Callable[[], object]],
               hint: str = "see the markdown above the stubs") -> dict[str, bool | None]:
    """Call each check; a stub that still raises ``NotImplementedError`` is reported, not raised.

    A wrong answer raises (an ``AssertionError`` from the check) as it should. A check that raises
    :class:`NotCheckable` (e.g. a JAX version without the behaviour it checks) is reported with its
    reason. Returns ``{name: done}`` (``None``: could not be checked here).
    """
    done: dict[str, bool | None] = {}
    for name, check in checks.items():
        try:
            check()
        except NotImplementedError:
            print(f"exercise {name}: not done yet (hint: {hint})")
            done[name] = False
        except NotCheckable as reason:
            print(f"exercise {name}: cannot be checked on this installation ({reason})")
            done[name] = None
        else:
            print(f"exercise {name}: correct")
            done[name] = True
    return done
