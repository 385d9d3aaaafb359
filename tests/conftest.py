"""Shared test configuration. (``tests/`` is on the import path through pytest's ``pythonpath`` setting,
so the oracle, the cases and the helpers import by name.)

Eight CPU devices for the sharded and ring attention tests (tests/test_parallel.py): the flag must be
set before JAX starts, so it is set here, before any test module imports JAX. A single-device
computation runs on the first device as before.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()
