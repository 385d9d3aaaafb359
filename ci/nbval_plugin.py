"""pytest plugin for ``pytest --nbval``: compare every output except stderr.

nbval 0.11 compares stderr streams like any other output, so a JAX or library warning that differs
between machines (or versions) would fail the check; it has no option to skip them. Loaded by
ci/test.py with ``-p nbval_plugin`` (``ci/`` on PYTHONPATH). Cells whose stdout or results vary
between runs (timings, memory, versions) are tagged ``nbval-ignore-output`` in the notebooks.
"""

import nbval.plugin

_original_init = nbval.plugin.IPyNbFile.__init__


def _init_without_stderr(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    self.skip_compare = (*self.skip_compare, "stderr")


nbval.plugin.IPyNbFile.__init__ = _init_without_stderr
