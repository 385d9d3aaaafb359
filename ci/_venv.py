"""Create and reuse the CI virtual environments (standard library only).

Four environments live at the repository root, each built from an exact pin file:

* ``.venv``            JAX 0.10.2 with libtpu (the TPU compiler, compile-only here) plus the notebook and
                       dev tools (``requirements/ci-jax0.10.2.txt``); used with ``JAX_PLATFORMS=cpu``
                       (:data:`CPU_WITH_TPU_COMPILER`) so JAX does not look for a TPU at start
* ``.venv-jax0.7.2``   JAX 0.7.2, Colab's TPU runtime, with its libtpu, for the unit and compile tests
                       (``requirements/ci-jax0.7.2.txt``)
* ``.venv-colab``      Colab's TPU runtime exactly, as Google publishes it (``requirements/colab-tpu.txt``:
                       its Python, 3.13, and the version of every package the course uses, libtpu
                       0.0.21.1 included), without the package: the test command's ``colab`` stage
                       installs it through the notebooks' own install cell (:class:`ColabEnv`)
* ``.venv-jax0.8.3``, ``.venv-jax0.9.2``  the middle releases with their libtpu, for the release matrix's
                       smoke subset (``requirements/ci-jax0.8.3.txt``, ``ci-jax0.9.2.txt``): the quick
                       tier's tests and notebook 03, through kernels ``tpuattn-jax0.8.3`` and ``-0.9.2``

The pins are installed with uv (``requirements/uv.txt`` pins it; it is fetched once into ``.venv-uv/``
with the system's pip): it downloads and unpacks wheels in parallel and links shared ones from its cache,
so the four environments build in a fraction of pip's time (measured: see ``setup()`` in ci/test.py).
The package is installed editable with ``--no-deps`` so an environment holds exactly its pin file.
A stamp file records a hash of the pin file, the dependencies declared in ``pyproject.toml`` and the
Python version; when any of them changes the environment is rebuilt from scratch. ``.venv`` also
gets a Jupyter kernel named ``tpuattn`` (installed under the venv's prefix) that papermill uses, so
notebooks always run on the venv's Python whatever kernels the user has installed elsewhere;
``.venv-jax0.7.2`` gets ``tpuattn-jax0.7.2`` (with Colab's ipywidgets 7.7.1), so that
``python3 ci/notebooks.py --jax 0.7.2`` runs every notebook on Colab's JAX too.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNEL_NAME = "tpuattn"


class Env:
    def __init__(self, name: str, pins: str, kernel: str | None):
        self.name = name
        self.path = ROOT / name
        self.pins = ROOT / "requirements" / pins
        self.kernel = kernel  # the Jupyter kernel name it installs (None: no kernel)

    @property
    def jupyter_path(self) -> Path:
        """Where its kernel spec lives (add it to ``JUPYTER_PATH`` to use the kernel from another env)."""
        return self.path / "share" / "jupyter"

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    def bin(self, tool: str) -> Path:
        return self.path / "bin" / tool

    def _fingerprint(self) -> str:
        """Pins, the package's declared dependencies and build system, and the Python version.

        Only those parts of pyproject.toml: editing, say, the ruff settings must not rebuild the venvs
        (the package is installed editable, so code changes need no reinstall either)."""
        pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
        project = pyproject.get("project", {})
        keys = ("dependencies", "optional-dependencies", "requires-python")
        declared = {key: project.get(key) for key in keys}
        declared["build-system"] = pyproject.get("build-system")
        digest = hashlib.sha256(self.pins.read_bytes())
        digest.update(json.dumps(declared, sort_keys=True).encode())
        digest.update(sys.version.encode())
        return digest.hexdigest()

    @property
    def _stamp(self) -> Path:
        return self.path / ".tpuattn-stamp"

    def is_current(self) -> bool:
        return (self.python.exists() and self._stamp.exists()
                and self._stamp.read_text().strip() == self._fingerprint())

    def ensure(self) -> Env:
        """Build the environment unless an up-to-date one exists; return self."""
        if self.is_current():
            return self
        start = time.perf_counter()
        print(f"[setup] building {self.name} from {self.pins.relative_to(ROOT)} (first use or pins changed)",
              flush=True)
        if self.path.exists():
            shutil.rmtree(self.path)
        self._fill()
        if self.kernel:
            _run([str(self.python), "-m", "ipykernel", "install", "--sys-prefix", "--name", self.kernel,
                  "--display-name", self.display_name])
        self._stamp.write_text(self._fingerprint() + "\n")
        print(f"[setup] {self.name} ready in {time.perf_counter() - start:.0f} s", flush=True)
        return self

    @property
    def display_name(self) -> str:
        return f"Python 3 (tpuattn {self.name})"

    def _fill(self) -> None:
        """Create the venv and install into it: the pins, then the package (editable, no dependencies)."""
        # A plain venv (with pip, for users who install into it by hand); uv fills it. uv writes no
        # bytecode unless asked: Python writes it for the modules that are imported, on first import.
        _run([sys.executable, "-m", "venv", str(self.path)])
        pip = [str(uv()), "pip", "install", "--quiet", "--python", str(self.python)]
        _run([*pip, "-r", str(self.pins)])
        # Exactly the pins: the package itself adds no dependency (the check below verifies the pins
        # satisfy its ranges).
        _run([*pip, "--no-deps", "--no-build-isolation", "-e", str(ROOT)])
        _run([str(uv()), "pip", "check", "--quiet", "--python", str(self.python)])


MAIN = Env(".venv", "ci-jax0.10.2.txt", kernel=KERNEL_NAME)
JAX_0_7 = Env(".venv-jax0.7.2", "ci-jax0.7.2.txt", kernel="tpuattn-jax0.7.2")
# The release matrix's middle releases: the smoke subset only (ci/test.py's ``releases`` stage).
JAX_0_8 = Env(".venv-jax0.8.3", "ci-jax0.8.3.txt", kernel="tpuattn-jax0.8.3")
JAX_0_9 = Env(".venv-jax0.9.2", "ci-jax0.9.2.txt", kernel="tpuattn-jax0.9.2")


COLAB_PINS = ROOT / "requirements" / "colab-tpu.txt"
# What the course uses of Colab's image, each installed at the version Colab's published freeze
# names (the freeze is the constraints file): the package's own dependencies, what the notebooks
# import (Flax, optax and orbax for notebook 10), the kernel papermill talks to, pip (the install
# cell runs Colab's), and pytest (which Colab ships) for the stage's puzzle checks. Nothing else of
# the image is installed.
COLAB_PACKAGES = ("pip", "jax", "jaxlib", "libtpu", "numpy", "absl-py", "matplotlib", "ipywidgets", "tqdm",
                  "flax", "optax", "orbax-checkpoint", "ipykernel", "ipython", "pytest")


def colab_pins() -> dict[str, str]:
    """Colab's published freeze as ``{normalised name: version}`` (lines naming a URL, Colab's own
    builds, left out)."""
    pins = {}
    for line in COLAB_PINS.read_text().splitlines():
        if line.startswith("#") or "==" not in line or " @ " in line:
            continue
        name, version = line.split("==", 1)
        pins[normalise(name)] = version.strip()
    return pins


def colab_python_version() -> str:
    """The Python version Colab's runtime publishes (the pins file's ``# python:`` line)."""
    found = re.search(r"^# python: (\d+\.\d+)\.\d+", COLAB_PINS.read_text(), re.M)
    if not found:
        raise SystemExit(f"[setup] {COLAB_PINS.relative_to(ROOT)} has no '# python: X.Y.Z' line")
    return found.group(1)


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def find_python(version: str) -> Path:
    """A ``pythonX.Y`` interpreter that runs: one of pyenv's, or on PATH (a pyenv shim on PATH may name a
    version that is installed but not selected, and fail)."""
    name = f"python{version}"
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates = sorted(glob.glob(os.path.join(root, "versions", f"{version}.*", "bin", name)), reverse=True)
    candidates.append(shutil.which(name))
    for candidate in filter(None, candidates):
        if subprocess.run([candidate, "-c", "pass"], capture_output=True).returncode == 0:
            return Path(candidate)
    raise SystemExit(f"[setup] Colab's TPU runtime runs Python {version} "
                     f"({COLAB_PINS.relative_to(ROOT)}), and no {name} is here: install it "
                     f"(pyenv install {version}, or your system's python{version} package)"
                     " and run the command again")


class ColabEnv(Env):
    """Colab's TPU runtime as published: its Python (major.minor) and :data:`COLAB_PACKAGES` at the
    versions of ``requirements/colab-tpu.txt``, and a Jupyter kernel, but not the package: the
    ``colab`` stage installs it as a learner does, through a notebook's install cell."""

    def _fingerprint(self) -> str:
        digest = hashlib.sha256(self.pins.read_bytes())
        digest.update(" ".join(COLAB_PACKAGES).encode())
        digest.update(str(find_python(colab_python_version())).encode())
        return digest.hexdigest()

    display_name = "Python 3 (tpuattn, Colab's TPU runtime)"

    def _fill(self) -> None:
        _run([str(find_python(colab_python_version())), "-m", "venv", str(self.path)])
        constraints = self.path / "colab-constraints.txt"
        constraints.write_text("".join(f"{name}=={version}\n" for name, version in colab_pins().items()))
        _run([str(uv()), "pip", "install", "--quiet", "--python", str(self.python), "-c", str(constraints),
              *COLAB_PACKAGES])
        wrong = colab_mismatches(self)
        if wrong:
            raise SystemExit(f"[setup] {self.name} differs from Colab's pins: {', '.join(wrong)}")


def installed(env: Env) -> dict[str, str]:
    """``{normalised name: version}`` of every distribution in ``env`` (asked of its own Python)."""
    code = ("import importlib.metadata as m, json; "
            "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))")
    out = subprocess.run([str(env.python), "-c", code], capture_output=True, text=True, check=True).stdout
    return {normalise(name): version for name, version in json.loads(out).items()}


def colab_mismatches(env: Env) -> list[str]:
    """Every installed distribution Colab's freeze names at another version (``name: here != Colab``)."""
    pins = colab_pins()
    return [f"{name} {version} (Colab: {pins[name]})" for name, version in sorted(installed(env).items())
            if name in pins and pins[name] != version]


COLAB = ColabEnv(".venv-colab", "colab-tpu.txt", kernel="tpuattn-colab")
ENVS = {"0.10.2": MAIN, "0.7.2": JAX_0_7, "0.8.3": JAX_0_8, "0.9.2": JAX_0_9, "colab": COLAB}
# Every JAX minor release the package supports, oldest first: Colab's TPU runtime's to the newest.
RELEASES = ("0.7.2", "0.8.3", "0.9.2", "0.10.2")

# The environment variables every command in ``.venv`` runs with: the CPU backend, the TPU compiler
# available (libtpu guards itself with a lockfile against two processes; compile-only use is safe
# to share, so the pytest workers may each load it).
CPU_WITH_TPU_COMPILER = {"JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


UV_PINS = ROOT / "requirements" / "uv.txt"
UV_HOME = ROOT / ".venv-uv"  # uv itself, installed with the system's pip (--target: no venv needed)
_UV_LOCK = threading.Lock()  # the environments build side by side; uv is fetched once


def uv() -> Path:
    """The pinned uv executable, fetched on first use."""
    with _UV_LOCK:
        pinned = UV_PINS.read_text()
        stamp = UV_HOME / ".tpuattn-stamp"
        executable = UV_HOME / "bin" / "uv"
        if not (executable.exists() and stamp.exists() and stamp.read_text() == pinned):
            if UV_HOME.exists():
                shutil.rmtree(UV_HOME)
            _run([sys.executable, "-m", "pip", "--disable-pip-version-check", "install", "--quiet",
                  "--target", str(UV_HOME), "-r", str(UV_PINS)])
            stamp.write_text(pinned)
        return executable


def _run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, cwd=ROOT)
    if result.returncode != 0:
        sys.exit(f"[setup] failed ({result.returncode}): {' '.join(cmd)}")


def reexec_in(env: Env) -> None:
    """Re-run the calling script with ``env``'s Python unless it already is that Python."""
    env.ensure()
    if Path(sys.prefix).resolve() != env.path.resolve():
        script = Path(sys.argv[0]).resolve()
        os.execv(str(env.python), [str(env.python), str(script), *sys.argv[1:]])
