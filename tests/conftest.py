"""Shared test configuration. (``tests/`` is on the import path through pytest's ``pythonpath`` setting,
so the oracle, the cases and the helpers import by name.)

Eight CPU devices for the sharded and ring attention tests (tests/test_parallel.py): the flag must be
set before JAX starts, so it is set here, before any test module imports JAX. A single-device
computation runs on the first device as before.

The ``quick`` marker (``pytest -m quick``; ``python3 ci/test.py --quick`` runs it) selects the edit
loop's tier from the existing tests, without a second copy of any of them: each registered
implementation once against the float64 oracle (one case, forward and gradients; decode's once
against its oracle), a small Pallas attention compiled for every chip the installed TPU compiler
knows, and the package's layering.
"""

import functools
import os

import numpy as np
import pytest

_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()


def pytest_configure(config):
    """The unit stages of ci/test.py name a folder in TPUATTN_TEST_COMPILATION_CACHE, new for each run of
    the command: JAX's persistent compilation cache there, for the pytest processes only (not their
    children, which measure their own peak memory). The tests compile many identical CPU programs (a
    function traced again at the same shapes compiles again); the stage takes 12% less time with it
    (ci/test.py). An entry that cannot be read back is compiled again, with JAX's "Error reading
    persistent compilation cache entry" warning, silenced here: the TPU compiler's programs for
    compile-only devices (written, never readable), or an entry one worker reads while the other is
    still writing it."""
    folder = os.environ.get("TPUATTN_TEST_COMPILATION_CACHE")
    if folder:
        import jax

        jax.config.update("jax_compilation_cache_dir", folder)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        config.addinivalue_line(
            "filterwarnings", "ignore:Error reading persistent compilation cache entry:UserWarning")


# The oracle cases the quick tier runs, one per implementation: the first of these it supports. Both
# are small and check gradients; "everything" has every option at once (batch 2, GQA, causal with a
# left window, soft-cap, segment ids with rows that see no key), so one compile covers the most code;
# an implementation that refuses it (no soft-cap) gets segment ids with empty rows and q_len < kv_len.
QUICK_ORACLE_CASES = ("everything", "segments-empty-rows")


@functools.cache
def quick_oracle_case(impl: str) -> str:
    from cases import CASES
    from test_oracle_suite import _supported

    for case in (c for name in QUICK_ORACLE_CASES for c in CASES if c.name == name):
        rng = np.random.default_rng(case.seed)
        q, k, v = case.inputs(rng)
        if _supported(impl, case, q, k, v, case.kwargs(rng)) is None:
            return case.name
    return QUICK_ORACLE_CASES[0]  # refuses them all: the quick tier checks the refusal


# The decode contract's implementations likewise, against its own float64 oracle: a paged cache with
# 8 query heads per KV head, 4 queries per sequence, soft-cap and scale; else one query, paged.
QUICK_DECODE_CASES = ("paged-f32-g8-tq4-softcap-d64", "paged-f32-g1-tq1")


@functools.cache
def quick_decode_case(impl: str) -> str:
    from test_decode import CASES, kwargs, make_inputs

    from tpuattn import decode

    for case in (c for name in QUICK_DECODE_CASES for c in CASES if c.name == name):
        q, k, v, lengths, table = make_inputs(case, False)
        spec = decode.make_decode_spec(q, k, v, lengths, table, **kwargs(case))[-1]
        if decode.get_implementation(impl).supports(spec, "cpu") is None:
            return case.name
    return QUICK_DECODE_CASES[0]  # refuses them all (JAX's ragged kernel off a TPU): the refusal


# test file -> test function -> which parametrisations are quick (None: all of them).
QUICK = {
    "test_oracle_suite.py": {"test_matches_oracle": lambda p: p["case"].name == quick_oracle_case(p["impl"])},
    "test_decode.py": {"test_matches_oracle": lambda p: p["case"].name == quick_decode_case(p["impl"])},
    # The Pallas kernel's forward, compiled for each chip (where the chip has no bf16 matmul, the
    # clear refusal is checked instead and float32 is compiled by the next test).
    "test_aot.py": {"test_every_implementation_compiles_for_every_chip":
                    lambda p: p["impl"] == "pallas" and p["mode"] == "fwd",
                    "test_float32_serves_the_kernels_on_v2": None},
    "test_architecture.py": {name: None for name in (
        "test_no_import_cycle", "test_layers_import_only_downward_and_siblings_never_import_each_other",
        "test_inside_ordered_packages_files_import_only_downward", "test_every_module_has_a_layer",
        "test_architecture_names_every_module")},
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        rules = QUICK.get(item.path.name, {})
        function = getattr(item, "originalname", item.name)
        if function in rules:
            rule = rules[function]
            params = item.callspec.params if hasattr(item, "callspec") else {}
            if rule is None or rule(params):
                item.add_marker(pytest.mark.quick)


# The test command's colab stage runs the puzzle tests against the package installed into Colab's
# environment by a notebook's install cell, never the checkout: it names that environment here.
if os.environ.get("TPUATTN_EXPECT_INSTALLED_IN"):
    import tpuattn

    _INSTALLED_IN = os.path.realpath(os.environ["TPUATTN_EXPECT_INSTALLED_IN"])
    if not os.path.realpath(tpuattn.__file__).startswith(_INSTALLED_IN):
        raise RuntimeError(f"tpuattn imports from {tpuattn.__file__}, not from the installed package in "
                           f"{os.environ['TPUATTN_EXPECT_INSTALLED_IN']}")
