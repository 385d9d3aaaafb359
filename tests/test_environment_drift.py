"""pyproject.toml, environment.yml and the CI pin files must tell the same story.

pyproject.toml holds the ranges users get; environment.yml adds only Python from conda-forge and
installs the package through pip; requirements/ci-*.txt pin exact versions CI installs, which must
fall inside those ranges (the newest JAX in one file, Colab's JAX 0.7.2 in another, the releases
between them in one file each).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
JAX_RANGE = SpecifierSet(">=0.7.2,<0.11")
# Every supported JAX minor release has a pin file (ci/_venv.py RELEASES): the newest with everything,
# Colab's 0.7.2 for the unit and compile tests, the middle ones for the release matrix's smoke subset.
PIN_FILES = {"ci-jax0.10.2.txt": "0.10.2", "ci-jax0.7.2.txt": "0.7.2", "ci-jax0.8.3.txt": "0.8.3",
             "ci-jax0.9.2.txt": "0.9.2"}


def requirements(strings) -> dict[str, Requirement]:
    reqs = [Requirement(s) for s in strings]
    return {canonicalize_name(r.name): r for r in reqs}


BASE = requirements(PYPROJECT["dependencies"])
EXTRAS = {extra: requirements(deps) for extra, deps in PYPROJECT["optional-dependencies"].items()}


def pins(filename: str) -> dict[str, Version]:
    out = {}
    for line in (ROOT / "requirements" / filename).read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        assert match, f"requirements/{filename}: expected only exact pins 'name==version', got {line!r}"
        out[canonicalize_name(match.group(1))] = Version(match.group(2))
    return out


def environment_yml() -> dict:
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with the notebook tools (.venv)")
    return yaml.safe_load((ROOT / "environment.yml").read_text())


def test_jax_range_is_the_supported_one():
    assert BASE["jax"].specifier == JAX_RANGE, f"pyproject: expected jax{JAX_RANGE}, got {BASE['jax']}"
    for version in PIN_FILES.values():
        assert Version(version) in JAX_RANGE


def test_environment_yml_takes_python_floor_and_everything_else_from_pyproject():
    env = environment_yml()
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    pip_lists = [d["pip"] for d in env["dependencies"] if isinstance(d, dict)]
    assert env.get("channels") == ["conda-forge"], f"environment.yml: expected channel conda-forge, got {env}"
    # Python floor: the same as requires-python.
    python = [d for d in conda if re.match(r"python\b", d)]
    assert len(python) == 1, f"environment.yml: expected one python entry, got {conda}"
    env_floor = re.fullmatch(r"python\s*>=\s*([\d.]+)", python[0])
    req_floor = re.fullmatch(r">=\s*([\d.]+)", PYPROJECT["requires-python"])
    assert env_floor and req_floor and env_floor.group(1) == req_floor.group(1), (
        f"python floor: environment.yml has {python[0]!r}, "
        f"pyproject requires-python {PYPROJECT['requires-python']!r}")
    # Nothing else from conda (a second source of versions would drift): only pip itself.
    others = sorted(set(conda) - {python[0], "pip"})
    assert not others, f"environment.yml: expected only python and pip from conda, got also {others}"
    # pip installs the package with every extra, nothing on the side.
    assert len(pip_lists) == 1, f"environment.yml: expected one pip section, got {pip_lists}"
    entries = pip_lists[0]
    assert len(entries) == 1, f"environment.yml: expected only the package under pip, got {entries}"
    match = re.fullmatch(r"-e\s+\.\[([\w,\s-]+)\]", entries[0])
    assert match, f"environment.yml: expected '-e .[extras]' under pip, got {entries[0]!r}"
    extras = {e.strip() for e in match.group(1).split(",")}
    assert extras == set(EXTRAS), (
        f"environment.yml installs extras {sorted(extras)}, pyproject has {sorted(EXTRAS)}")


@pytest.mark.parametrize("filename", sorted(PIN_FILES))
def test_pins_fall_inside_pyproject_ranges(filename):
    pinned = pins(filename)
    needed = dict(BASE)
    if filename == "ci-jax0.10.2.txt":  # the full environment: every extra too
        for reqs in EXTRAS.values():
            needed.update(reqs)
    else:  # unit tests only
        needed["pytest"] = EXTRAS["dev"]["pytest"]
    for name, req in needed.items():
        assert name in pinned, f"requirements/{filename}: expected a pin for {req}, found none"
        assert pinned[name] in req.specifier, (
            f"requirements/{filename}: {name}=={pinned[name]} is outside pyproject's range {req}")
    assert pinned["jax"] == Version(PIN_FILES[filename]), f"requirements/{filename}: jax=={pinned['jax']}"
    assert pinned["jaxlib"] == pinned["jax"], f"requirements/{filename}: jaxlib {pinned['jaxlib']} != jax"
    # ci/_venv.py installs the package with --no-build-isolation: setuptools must satisfy the build floor.
    build = requirements(tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"])
    assert pinned["setuptools"] in build["setuptools"].specifier


def test_notebook_extras_cover_what_notebooks_import():
    # The packages notebooks import beyond the base dependencies must come from the notebooks extra.
    assert {"matplotlib", "ipywidgets", "tqdm"} <= set(EXTRAS["notebooks"])


def test_every_supported_minor_release_has_a_pinned_environment():
    # The release matrix (ci/test.py's releases stage) covers every JAX minor release pyproject admits,
    # each with its own pin file and environment in ci/_venv.py.
    import importlib.util

    spec = importlib.util.spec_from_file_location("_venv", ROOT / "ci" / "_venv.py")
    venv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(venv)
    assert sorted(venv.RELEASES, key=Version) == list(venv.RELEASES), f"oldest first: {venv.RELEASES}"
    assert {venv.ENVS[r].pins.name for r in venv.RELEASES} == set(PIN_FILES), (
        f"ci/_venv.py pins {sorted(venv.ENVS[r].pins.name for r in venv.RELEASES)}, "
        f"this test {sorted(PIN_FILES)}")
    for release in venv.RELEASES:
        assert PIN_FILES[venv.ENVS[release].pins.name] == release
    minors = {Version(r).minor for r in venv.RELEASES}
    floor, ceiling = Version("0.7.2"), Version("0.11")
    assert all(Version(r) in JAX_RANGE for r in venv.RELEASES)
    expected = set(range(floor.minor, ceiling.minor))
    assert minors == expected, (
        f"JAX minor releases {sorted(expected)} are supported, the matrix has {sorted(minors)}")


def colab_freeze() -> dict[str, Version]:
    """Colab's published TPU-runtime freeze (requirements/colab-tpu.txt), URL lines left out."""
    out = {}
    for line in (ROOT / "requirements" / "colab-tpu.txt").read_text().splitlines():
        if line.startswith("#") or " @ " in line or not line.strip():
            continue
        name, _, version = line.partition("==")
        assert version, f"requirements/colab-tpu.txt: expected 'name==version' or 'name @ url', got {line!r}"
        out[canonicalize_name(name)] = Version(version)
    return out


def test_colab_runtime_satisfies_the_package_and_its_flax_extra():
    """A learner's Colab TPU runtime installs the package without changing a version: its freeze
    satisfies every dependency and the flax extra (the install cell asks pip for the package alone),
    and has what the notebooks import."""
    colab = colab_freeze()
    for name, requirement in {**BASE, **EXTRAS["flax"]}.items():
        assert name in colab, f"Colab's TPU runtime has no {name} (the package needs {requirement})"
        assert colab[name] in requirement.specifier, f"Colab's {name} {colab[name]} is outside {requirement}"
    for name in ("matplotlib", "ipywidgets", "tqdm", "optax", "orbax-checkpoint", "libtpu"):
        assert name in colab, f"the notebooks import {name}; Colab's TPU runtime has none"
    # The oldest supported release is Colab's: its JAX is the range's floor (an upgrade of Colab's pins
    # that leaves the floor behind is a choice to make in pyproject.toml, not by accident).
    assert f">={colab['jax']}" in str(JAX_RANGE), f"Colab's JAX {colab['jax']} is not {JAX_RANGE}'s floor"
