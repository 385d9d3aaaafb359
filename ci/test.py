"""The test command: lint, pairs, unit, compile, notebooks on JAX 0.10.2 and on Colab's stack, releases.

    python3 ci/test.py                       # everything (what .ci/run calls)
    python3 ci/test.py --quick               # the edit loop: ruff, pairs, quick (a few minutes)
    python3 ci/test.py --only unit-jax0.10.2 # one stage (repeatable); --skip works the same way

On first use it builds ``.venv`` (JAX 0.10.2 + tools), ``.venv-jax0.7.2`` and (for ``releases``)
``.venv-jax0.8.3`` and ``.venv-jax0.9.2`` from the pin files in ``requirements/`` (see ci/_venv.py), all
at once. ``--quick`` runs ``ruff``, ``pairs`` and:

* ``quick``           ``pytest -m quick`` in ``.venv`` (tests/conftest.py selects the tests): each registered
                      implementation once against the float64 oracle (forward and gradients, small
                      shapes; decode's implementations against decode's oracle), the Pallas kernel
                      compiled for every chip the TPU compiler knows, the package's layering. Never part
                      of the full run (which runs all of those anyway).

The full run's stages, cheapest first:

* ``ruff``            ``ruff check`` over tpuattn, tests, the notebook twins and ci
* ``pairs``           each ``notebooks/NN_*.ipynb`` has a ``.py`` twin equal to ``jupytext --to py:percent``
                      of it, and every code cell of the committed notebook has been executed
                      (nbval skips cells without a stored execution count), and its Colab badge and
                      install cell are the ones ci/install_cell.py generates. Writes nothing.
* ``unit-jax0.10.2``  pytest tests/ on JAX 0.10.2
* ``unit-jax0.7.2``   pytest tests/ on JAX 0.7.2 (Colab's JAX; the ``colab`` stage runs Colab's whole stack)
* ``compile``         tests/test_aot*.py in ``.venv`` (JAX 0.10.2 + libtpu, ``JAX_PLATFORMS=cpu``): every
                      implementation through the real TPU compiler for every chip, the model held to the
                      compiler (compiled, not run; no TPU needed). The unit stages leave this file out.
* ``compile-jax0.7.2`` the same file on JAX 0.7.2 with its libtpu (0.0.23): everything compiles for every
                      chip there too (the facts recorded with the newer compiler, and the tests marked
                      ``newest_compiler``, are checked only above)
* ``nbval``           ``pytest --nbval`` over each committed notebook (one pytest per notebook) on the
                      venv's Python, as on another machine (``XLA_FLAGS=--xla_cpu_max_isa=AVX2``: the
                      outputs were made with AVX-512); compares outputs except stderr and cells tagged
                      ``nbval-ignore-output`` (whose property the notebook asserts); figures go to a
                      temporary folder (TPUATTN_FIGURES_DIR) so the working tree is not modified.
* ``colab``           Colab's TPU runtime exactly, as Google publishes it (``requirements/colab-tpu.txt``:
                      Python 3.13, JAX 0.7.2, libtpu 0.0.21.1, flax 0.11.2, numpy 2.1.3, ipywidgets 7.7.1,
                      ...; ``.venv-colab``, see ci/_venv.py). First ``ci/colab.py`` installs the package
                      there through a notebook's own install cell (its URL pointed at this checkout's
                      HEAD) and checks that no Colab version changed; then every notebook is executed
                      top to bottom with papermill on that environment's kernel (``ci/notebooks.py --jax
                      colab``), two at a time, XLA's costlier CPU compile passes off
                      (``FAST_XLA_FLAGS``: nothing is compared), ``RUN_MEMORY = False`` (the child-process
                      memory measurements run in nbval) and notebook 10 without its §5 compiles
                      (``COLAB_SKIPS``); and the puzzle tests (every stub fails, every solution passes,
                      each compiled for v5e by libtpu 0.0.21.1; a right answer passes its compile) run
                      with that environment's pytest against the installed package
* ``releases``        the release matrix: on each JAX minor release between those two (0.8.3, 0.9.2; each in
                      its own ``.venv-jaxV`` with that release's libtpu), the smoke subset: the quick
                      tier's oracle checks (each implementation once, forward and gradients; decode's),
                      its compiles (the Pallas kernel for every chip) and notebook 03 under
                      papermill (``RUN_MEMORY = False``, ``RELEASE_SKIPS``). The command ends with the
                      matrix as a Markdown table (release, libtpu, what passed; 0.7.2 and 0.10.2 from
                      their full stages): the README shows it.
* ``dry-run``         notebooks 03-05 (the ones whose TPU-runtime paths differ) under papermill on JAX
                      0.10.2 with a CPU standing in for a TPU v5e (``TPUATTN_STAND_IN_TPU=v5e``,
                      ``tpuattn.measure.runtime``), at small sizes: every ``ON_TPU`` cell's Python runs,
                      kernels in interpret mode (``DRY_RUN_SKIPS``); nothing printed is a TPU number,
                      nothing is compared
* ``book``            ``ci/book.py`` builds the site in ``out/book/`` from the committed outputs;
                      ``ci/browser_check.py`` opens every page in headless chromium (console errors,
                      failed or external loads, broken links and anchors, alt text) and takes
                      screenshots at desktop and phone widths into ``out/book/screenshots/``
* ``lab``             ``ci/lab_check.py``: notebook 03 run in JupyterLab in chromium, a slider of its grid
                      widget moved and the figure seen to change (screenshots before and after)

From ``nbval`` on, the stages are one pool of jobs run two at a time, longest first by their seconds
in an earlier run (each notebook's kernel, each pytest, the book's build and browser check, the lab
compute on about one core); their table rows say they ran side by side. The lab starts once no run of
notebook 03 and no book build is left. The pytest stages before them run two workers each (``-n 2
--dist worksteal``).

The book and lab stages need Debian's chromium (``/usr/bin/chromium``): as root the command installs
it (``apt-get install -y chromium chromium-driver``, in CI or not); as another user those two stages
fail saying what to install. After the stages, ``git status --porcelain`` may list nothing it did not
list before the run (the ``clean checkout`` row): nothing the command made lands in the checkout. Every
stage runs; the command prints a table of stage, seconds, result
(the set-up of the environments included, and which ran side by side) and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _venv  # noqa: E402

ROOT = _venv.ROOT
NOTEBOOKS = ROOT / "notebooks"
STAGES = ("ruff", "pairs", "unit-jax0.10.2", "unit-jax0.7.2", "compile", "compile-jax0.7.2", "nbval",
          "colab", "releases", "dry-run", "book", "lab")
# The release matrix: the releases between the two the full stages test get the smoke subset only.
MIDDLE_RELEASES = tuple(v for v in _venv.RELEASES if _venv.ENVS[v] not in (_venv.MAIN, _venv.JAX_0_7))
RELEASE_NOTEBOOKS = ("03",)  # the Pallas lesson: what a release most often breaks
# The smoke subset's tests: the quick tier's oracle checks (each implementation once, forward and
# gradients; decode's against its oracle) and its compiles (the Pallas kernel for every chip).
RELEASE_ORACLE_FILES = ("tests/test_oracle_suite.py", "tests/test_decode.py")
RELEASE_COMPILE_FILES = ("tests/test_aot.py",)
QUICK_STAGES = ("ruff", "pairs", "quick")
# The files that hold the quick tier's tests (tests/conftest.py marks them): collecting only these
# keeps the quick stage's start short.
QUICK_FILES = ("tests/test_architecture.py", "tests/test_oracle_suite.py", "tests/test_decode.py",
               "tests/test_aot.py")
# The unit stages' CPU programs are small and run once: LLVM's optimisation passes are about half of
# their compile time (tests/test_blockwise.py: 55 s of CPU time at the default level, 28 s without)
# and change no result beyond float rounding, which every test's tolerance allows (XLA keeps its own
# HLO passes, and fast math stays off). The notebook runs whose outputs nobody compares (papermill on
# JAX 0.7.2, the release matrix, the dry run) set it too: they check that every cell runs, and their
# CPU timings are not the ones a reader gets (notebook 03 on JAX 0.7.2: 52 s of CPU time at the default
# level, 41 s without). XLA's newer CPU fusion emitters (MLIR) cost more to compile than its classic
# loop emitter for these small programs: without them tests/test_sinks.py, test_pallas.py and
# test_fuzz.py take 199 s of CPU time instead of 246 (JAX 0.10.2), test_sinks.py and
# test_hardening.py 175 s instead of 227 (JAX 0.7.2); every release from 0.7.2 to 0.10.2 takes the flag.
# nbval keeps XLA's defaults: its printed numbers are the committed ones. The compile stages do not
# set it either (the TPU compiler's programs are what they check).
FAST_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                  "--xla_cpu_use_fusion_emitters=false")
FAST_CPU_COMPILE = {"XLA_FLAGS": FAST_XLA_FLAGS}  # the environment of the unit stages and the runs above
COMPILE_TESTS = "tests/test_aot*.py"  # the compile stages' files; the unit stages leave them out
# Every pytest but nbval's: without nbval's plugin (installed in .venv, it loads in every pytest
# process otherwise and imports nbformat's jsonschema, whose IRI checker builds a grammar: about 8 s
# of CPU per process, three processes per two-worker stage; measured with python -X importtime).
PYTEST = ["-m", "pytest", "-p", "no:cacheprovider", "-p", "no:nbval"]
PYTEST_EXIT = {0: "passed", 1: "tests failed", 2: "interrupted", 3: "internal error", 4: "usage error",
               5: "no tests collected"}


def notebook_files(suffix: str) -> list[Path]:
    return sorted(NOTEBOOKS.glob(f"[0-9][0-9]_*{suffix}"))


_PRINT = threading.Lock()  # one job's log at a time when stages run side by side
_CAPTURE = threading.local()  # .lines: a list collecting this thread's commands' output, or None


def run(cmd: list[str], env: dict | None = None) -> int:
    shown = "$ " + " ".join(os.path.relpath(c, ROOT) if c.startswith(str(ROOT)) else c for c in cmd)
    lines = getattr(_CAPTURE, "lines", None)
    if lines is None:
        print(shown, flush=True)
        return subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}).returncode
    result = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines.append(f"{shown}\n{result.stdout}")
    return result.returncode


def pytest_result(code: int) -> str:
    # Exit code 5 (nothing collected) is a failure here: every stage that runs pytest expects tests.
    return "ok" if code == 0 else f"FAILED (pytest exit {code}: {PYTEST_EXIT.get(code, 'unknown')})"


def stage_ruff() -> str:
    targets = ["tpuattn", "tests", "ci", *(str(p.relative_to(ROOT)) for p in notebook_files(".py"))]
    code = run([str(_venv.MAIN.bin("ruff")), "check", *targets])
    return "ok" if code == 0 else f"FAILED (ruff exit {code})"


def stage_pairs() -> str:
    import nbformat

    problems = []
    ipynbs, pys = notebook_files(".ipynb"), notebook_files(".py")
    for py in pys:
        if not py.with_suffix(".ipynb").exists():
            problems.append(f"{py.name}: no .ipynb twin (python3 ci/notebooks.py --update {py.stem})")
    # Regenerate each .py from its .ipynb in a scratch copy (same jupytext.toml, same relative layout)
    # and compare with the committed .py: the working tree is never written.
    with tempfile.TemporaryDirectory(prefix="tpuattn-pairs-") as tmp:
        scratch = Path(tmp)
        (scratch / "notebooks").mkdir()
        shutil.copyfile(ROOT / "jupytext.toml", scratch / "jupytext.toml")
        copies = [scratch / "notebooks" / ipynb.name for ipynb in ipynbs]
        for ipynb, copy in zip(ipynbs, copies, strict=True):
            shutil.copyfile(ipynb, copy)
        if copies:
            cmd = [str(_venv.MAIN.bin("jupytext")), "--quiet", "--to", "py:percent", *map(str, copies)]
            result = subprocess.run(cmd, cwd=scratch, capture_output=True, text=True)
            if result.returncode != 0:
                problems.append(f"jupytext failed: {result.stdout}{result.stderr}".strip())
        for ipynb, copy in zip(ipynbs, copies, strict=True):
            py = ipynb.with_suffix(".py")
            if not py.exists():
                problems.append(f"{ipynb.name}: no .py twin")
            else:
                regenerated = copy.with_suffix(".py")
                if not regenerated.exists() or regenerated.read_text() != py.read_text():
                    problems.append(f"{ipynb.name} and {py.name} differ (edit the .py, then "
                                    f"python3 ci/notebooks.py --update {ipynb.stem})")
            nb = nbformat.read(ipynb, as_version=4)
            unexecuted = [i for i, c in enumerate(nb.cells)
                          if c.cell_type == "code" and c.execution_count is None]
            if unexecuted:
                problems.append(f"{ipynb.name}: code cells {unexecuted} have no stored outputs "
                                f"(python3 ci/notebooks.py --update {ipynb.stem})")
    import install_cell  # the badge and install cell of every notebook, generated from pyproject.toml

    problems += [p for py in pys for p in install_cell.problems(py)]
    for problem in problems:
        print("  " + problem)
    print(f"  {len(ipynbs)} notebook pair(s) checked")
    return "ok" if not problems else f"FAILED ({len(problems)} problem(s))"


# The fuzz seeds each unit stage draws (tests/fuzz_cases.py; FUZZ_SEEDS in the environment wins): one
# seed a JAX version, a different one on each, so that a CI run checks the cases of both default seeds
# at the cost of one (the fuzz was about 220 s of a core a version with both).
UNIT_FUZZ_SEEDS = {"0.10.2": "1", "0.7.2": "0"}


def release_of(env: _venv.Env) -> str:
    return next(release for release, other in _venv.ENVS.items() if other is env)


def stage_unit(env: _venv.Env) -> str:
    # --durations: the slowest tests are named in every CI log, so the 25-minute budget can be watched.
    # -n 2: two pytest-xdist workers, one per core. Most of the time is XLA compiling (one thread
    # each), so two workers come close to halving the stage. The compile tests have their own stage.
    # --dist worksteal: a worker that runs out of tests takes queued ones from the other, so the
    # stage does not end on one worker's backlog of slow tests while the other core idles.
    # XLA_FLAGS (FAST_XLA_FLAGS): LLVM's optimisation and the fusion emitters off for the CPU programs
    # the tests compile.
    # TPUATTN_TEST_COMPILATION_CACHE: JAX's persistent compilation cache in a folder new to this stage,
    # shared by its two workers (tests/conftest.py turns it on in the pytest processes only). The tests
    # compile many identical CPU programs: a function traced again at the same shapes compiles again.
    # Measured on JAX 0.10.2, this stage: 397 s and 725 s of CPU with it, 450 s and 835 s without. The
    # notebook runs do not use it: notebook 03 took 116 s with it against 97 s (fewer repeats, and every
    # program it compiles is written).
    seeds = os.environ.get("FUZZ_SEEDS") or UNIT_FUZZ_SEEDS[release_of(env)]
    with tempfile.TemporaryDirectory(prefix="tpuattn-compilation-cache-") as cache:
        return pytest_result(run([str(env.python), *PYTEST, "--durations=15", "-n", "2", "--dist",
                                  "worksteal", f"--ignore-glob={COMPILE_TESTS}", "tests"],
                                 env={**_venv.CPU_WITH_TPU_COMPILER, **FAST_CPU_COMPILE, "FUZZ_SEEDS": seeds,
                                      "TPUATTN_TEST_COMPILATION_CACHE": cache}))


def stage_compile(env: _venv.Env) -> str:
    # An older release leaves out the ``newest_compiler`` tests (pyproject.toml's markers): analyses of
    # the optimised program held on the newest compiler (about 300 s of a core on JAX 0.7.2); the
    # kernels they compile are compiled on every release by the other tests.
    variables = {**_venv.CPU_WITH_TPU_COMPILER, "TPUATTN_REQUIRE_TPU_COMPILER": "1"}
    files = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(COMPILE_TESTS))
    select = [] if env is _venv.MAIN else ["-m", "not newest_compiler"]
    return pytest_result(run([str(env.python), *PYTEST, "--durations=10", "-n", "2", "--dist", "worksteal",
                              *select, *files], env=variables))


def stage_quick() -> str:
    # The edit loop's tier (tests/conftest.py marks it): the compile tests need the TPU compiler, as in
    # the compile stage, so a missing libtpu fails instead of skipping.
    variables = {**_venv.CPU_WITH_TPU_COMPILER, "TPUATTN_REQUIRE_TPU_COMPILER": "1"}
    return pytest_result(run([str(_venv.MAIN.python), *PYTEST, "--durations=10", "-n", "2", "--dist",
                              "worksteal", "-m", "quick", *QUICK_FILES], env=variables))


@dataclasses.dataclass
class Job:
    """One piece of a pooled stage: ``run()`` returns (ok, log); the pool times it."""

    stage: str
    label: str
    run: object
    weight: float = 0.0  # its expected seconds (:data:`EXPECTED_SECONDS`), to start the longest first
    apart_from: tuple[str, ...] = ()  # starts only once no job whose label contains one of these is left
    ok: bool = False
    start: float = 0.0
    end: float = 0.0

    def __post_init__(self) -> None:
        if not self.weight:
            self.weight = EXPECTED_SECONDS.get(self.label, DEFAULT_SECONDS)


# Each pooled job's seconds in a clean-clone run of the full command on 2 cores (2026-12-07, commit
# 45124fe, two jobs at a time). Only the order in which the jobs start depends on them: the longest
# first, so that no long job starts last and leaves one core idle at the end (notebook 10 started last
# by its file size and ran alone for its final 100 s). A job not listed counts as DEFAULT_SECONDS.
EXPECTED_SECONDS = {
    "book": 137, "lab": 169,
    "nbval 10_in_a_model": 288, "nbval 03_pallas_kernel": 184, "nbval 02_online_softmax": 94,
    "nbval 05_measure": 72, "nbval 04_native_attention": 71, "nbval 01_naive_attention": 62,
    "nbval 07_decode": 43, "nbval 06_scale_out": 27, "nbval 11_the_hard_way": 22,
    "nbval 09_puzzles_backward": 16, "nbval 12_capstones": 15, "nbval 08_puzzles_forward": 14,
    "colab 03_pallas_kernel": 123, "colab 10_in_a_model": 66, "colab 05_measure": 47, "colab puzzles": 45,
    "colab 04_native_attention": 41, "colab 07_decode": 37, "colab 02_online_softmax": 27,
    "colab 06_scale_out": 19, "colab 01_naive_attention": 17, "colab 11_the_hard_way": 14,
    "colab 09_puzzles_backward": 13, "colab 08_puzzles_forward": 13, "colab 12_capstones": 12,
    "0.9.2 03_pallas_kernel": 90, "0.8.3 03_pallas_kernel": 77, "0.9.2 oracle": 13, "0.8.3 oracle": 12,
    "0.9.2 compile": 7, "0.8.3 compile": 6,
    "dry-run 03_pallas_kernel": 77, "dry-run 04_native_attention": 34, "dry-run 05_measure": 34,
}
DEFAULT_SECONDS = 30.0


def command_job(stage: str, label: str, cmd: list[str], env: dict, **fields) -> Job:
    """A job that runs ``cmd`` with ``env`` (the whole environment) and passes when it exits 0."""
    def run() -> tuple[bool, str]:
        result = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        shown = " ".join(os.path.relpath(c, ROOT) if c.startswith(str(ROOT)) else c for c in cmd)
        return result.returncode == 0, f"$ {shown}\n{result.stdout}"

    return Job(stage, label, run, **fields)


# nbval runs as on another machine: XLA's CPU code generation held to AVX2 (the committed outputs come
# from a machine with AVX-512, whose vector width changes the order of float sums), so that only
# outputs that are the same on every x86 machine are compared, and those that are not are tagged
# ``nbval-ignore-output`` with their property asserted in the notebook. Off x86 the flag means nothing.
OTHER_MACHINE_XLA_FLAGS = "--xla_cpu_max_isa=AVX2" if platform.machine() in ("x86_64", "AMD64") else ""


def nbval_jobs(tmp: Path) -> list[Job]:
    """``nbval``: ``pytest --nbval`` over each committed notebook on the venv's Python, one notebook per
    job (its cells in order, in one kernel); outputs compared except stderr and cells tagged
    ``nbval-ignore-output``; XLA's CPU code held to another instruction set
    (:data:`OTHER_MACHINE_XLA_FLAGS`); figures to a temporary folder (``TPUATTN_FIGURES_DIR``)."""
    jobs = []
    for ipynb in notebook_files(".ipynb"):
        cmd = [str(_venv.MAIN.python), "-m", "pytest", "-p", "no:cacheprovider", "-p", "nbval_plugin", "-q",
               "--nbval", "--nbval-current-env", "--nbval-cell-timeout", "300",
               "--nbval-sanitize-with", "ci/nbval_sanitize.cfg", str(ipynb.relative_to(ROOT))]
        env = {**os.environ, "PYTHONPATH": str(ROOT / "ci"),
               "TPUATTN_FIGURES_DIR": str(tmp / f"figures-nbval-{ipynb.stem}"), **_venv.CPU_WITH_TPU_COMPILER,
               "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {OTHER_MACHINE_XLA_FLAGS}".strip(),
               # The committed outputs include the hidden solutions' checks (ci/notebooks.py runs them).
               "TPUATTN_RUN_SOLUTIONS": "1"}
        jobs.append(command_job("nbval", f"nbval {ipynb.stem}", cmd, env))
    return jobs


def notebook_job(stage: str, release: str, stem: str, tmp: Path, parameters: dict, *,
                 extra_env: dict | None = None, label: str | None = None) -> Job:
    """One notebook executed top to bottom with papermill on ``release``'s kernel (``ci/notebooks.py
    --jax``); the executed copy and figures go to ``tmp`` and nobody compares them (so
    :data:`FAST_CPU_COMPILE`); ``extra_env`` is added to its kernel's."""
    env = {**os.environ, "TPUATTN_FIGURES_DIR": str(tmp / "figures"), **_venv.CPU_WITH_TPU_COMPILER,
           **FAST_CPU_COMPILE, **(extra_env or {})}
    unknown = sorted(set(parameters) - notebook_parameters(stem))
    if unknown:  # papermill only warns, and the notebook would run at its own sizes
        raise ValueError(f"parameters {unknown} are not assigned one per line in {stem}'s parameters cell "
                         f"(it assigns {sorted(notebook_parameters(stem))})")
    label = label or f"{release} {stem}"
    cmd = [str(_venv.MAIN.python), str(ROOT / "ci" / "notebooks.py"), "--jax", release,
           "--out", str(tmp / f"notebooks-{label.replace(' ', '-')}"), stem]
    for name, value in parameters.items():
        cmd += ["-p", name, repr(value)]
    return command_job(stage, label, cmd, env)


def pytest_job(stage: str, label: str, env: _venv.Env, args: list[str], variables: dict) -> Job:
    cmd = [str(env.python), *PYTEST, "-q", "--durations=5", *args]
    return command_job(stage, label, cmd, {**os.environ, **variables})


def notebook_parameters(stem: str) -> set[str]:
    """The names a notebook's parameters cell assigns (papermill warns about any other)."""
    source = (NOTEBOOKS / f"{stem}.py").read_text()
    cell = source.split('# %% tags=["parameters"]', 1)[-1].split("# %%", 1)[0]
    return {line.split("=")[0].strip() for line in cell.splitlines()
            if "=" in line and not line.startswith(("#", " "))}


# The colab stage's tests: the puzzle harness and every puzzle notebook's stubs and solutions, each
# solution compiled for v5e by Colab's libtpu, and the serialization version held to what it reads.
COLAB_TEST_FILES = ("tests/test_puzzles.py", "tests/test_puzzles_backward.py", "tests/test_aot_libtpu.py")


def colab_jobs(tmp: Path) -> list[Job]:
    """``colab``: the package installed into ``.venv-colab`` through a notebook's install cell
    (``ci/colab.py``, run here before the pool's jobs start: each job needs it), then every notebook on
    that environment's kernel, top to bottom, with ``RUN_MEMORY = False`` where a notebook has it (its
    peak-memory cells start one child process per point: on a CPU that measures host RSS, the same
    package code nbval runs; a third of these notebooks' time), and the puzzle tests with that
    environment's pytest (its console script, so the checkout is not on the import path: the
    installed package is what runs, and tests/conftest.py checks so)."""
    code = run([str(_venv.MAIN.python), str(ROOT / "ci" / "colab.py")])
    if code != 0:
        return [Job("colab", "colab install", lambda: (False, f"ci/colab.py exited {code}"))]
    jobs = [notebook_job("colab", "colab", p.stem, tmp,
                         {**without_memory(p.stem), **COLAB_SKIPS.get(p.stem[:2], {})})
            for p in notebook_files(".ipynb")]
    variables = {**_venv.CPU_WITH_TPU_COMPILER, **FAST_CPU_COMPILE, "TPUATTN_REQUIRE_TPU_COMPILER": "1",
                 "TPUATTN_EXPECT_INSTALLED_IN": str(_venv.COLAB.path)}
    cmd = [str(_venv.COLAB.bin("pytest")), "-p", "no:cacheprovider", "-q", "--durations=5", *COLAB_TEST_FILES]
    jobs.append(command_job("colab", "colab puzzles", cmd, {**os.environ, **variables}))
    return jobs


def without_memory(stem: str) -> dict:
    return {"RUN_MEMORY": False} if "RUN_MEMORY" in notebook_parameters(stem) else {}


# What the papermill runs beside nbval leave out, by notebook number: the longest compiled-for-TPU cells,
# whose programs nbval compiles on the newest JAX, each kept once on Colab's stack. Notebook 10's §5
# (the whole model's train and decode steps for v5e with every implementation) is about 200 of its 270 s
# (papermill's cell times, 2026-12-07); on Colab's stack the package's kernels, forward and backward,
# are compiled for v5e by notebook 03's wrapper-moves cell, which the colab stage keeps. That cell is
# about a minute of notebook 03 on each middle release and in the dry run; their compiles are the
# lesson's kernels (what a release breaks), and the dry run's subject is the ON_TPU cells.
COLAB_SKIPS = {"10": {"RUN_COMPILES": False}}
RELEASE_SKIPS = {"03": {"RUN_WRAPPER_MOVES": False}}
DRY_RUN_SKIPS = RELEASE_SKIPS


def release_jobs(tmp: Path) -> list[Job]:
    """``releases``: the smoke subset on each middle release (``MIDDLE_RELEASES``), in its own venv with
    its own libtpu: the quick tier's oracle checks (every implementation once, forward and gradients,
    and decode's), its compiles (the Pallas kernel for every chip the release's compiler knows) and
    notebook 03 (the Pallas lesson) under papermill with ``RUN_MEMORY = False`` (its child-process memory
    measurements are the same package code on every release, and the full runs on 0.7.2 and 0.10.2
    make them)."""
    jobs = []
    compiler = {**_venv.CPU_WITH_TPU_COMPILER, "TPUATTN_REQUIRE_TPU_COMPILER": "1"}
    for release in MIDDLE_RELEASES:
        env = _venv.ENVS[release]
        jobs.append(pytest_job("releases", f"{release} oracle", env,
                               ["-m", "quick", *RELEASE_ORACLE_FILES], {**compiler, **FAST_CPU_COMPILE}))
        jobs.append(pytest_job("releases", f"{release} compile", env,
                               ["-m", "quick", *RELEASE_COMPILE_FILES], compiler))
        for p in notebook_files(".ipynb"):
            if p.stem[:2] in RELEASE_NOTEBOOKS:
                jobs.append(notebook_job("releases", release, p.stem, tmp,
                                         {**without_memory(p.stem), **RELEASE_SKIPS.get(p.stem[:2], {})}))
    return jobs


# The dry run: the notebooks whose TPU-runtime paths differ from their CPU ones, executed on JAX 0.10.2
# with a CPU standing in for a TPU v5e (TPUATTN_STAND_IN_TPU: tpuattn.measure.runtime), so that the
# Python of every ON_TPU cell runs in CI: Pallas kernels in interpret mode, device memory the child
# process's RSS. Their sizes are made small here (the TPU sizes would take hours in interpret mode);
# nothing they print is a TPU number and nothing is compared.
DRY_RUN_CHIP = "v5e"
DRY_RUN = {
    "03": {"BENCH_SEQ_LENS": [256], "BENCH_BATCH": 1, "BENCH_HEADS": 2, "BENCH_HEAD_DIM": 128},
    "04": {"TIMING_LENGTHS": [128], "ERROR_LENGTHS": [128]},
    "05": {"TPU_SEQ_LENS": [128], "TPU_BATCH": 1, "TPU_HEADS": 2, "TPU_KV_HEADS": 2, "TPU_HEAD_DIM": 128,
           "INTERPRET_SEQ_LENS": [128], "MEMORY_SEQ_LENS": [256]},
}


def dry_run_jobs(tmp: Path) -> list[Job]:
    """``dry-run``: :data:`DRY_RUN`'s notebooks under papermill with a CPU standing in for a TPU."""
    jobs = []
    for p in notebook_files(".ipynb"):
        if p.stem[:2] in DRY_RUN:
            jobs.append(notebook_job("dry-run", "0.10.2", p.stem, tmp,
                                     {**DRY_RUN[p.stem[:2]], **DRY_RUN_SKIPS.get(p.stem[:2], {})},
                                     extra_env={"TPUATTN_STAND_IN_TPU": DRY_RUN_CHIP},
                                     label=f"dry-run {p.stem}"))
    return jobs


def action_job(stage: str, action, **fields) -> Job:
    """A stage's own function (``stage_book``, ``stage_lab``) as a job, its commands' output captured."""
    def run() -> tuple[bool, str]:
        _CAPTURE.lines = []
        try:
            result = action()
            return result == "ok", "".join(_CAPTURE.lines) + f"{stage}: {result}"
        finally:
            _CAPTURE.lines = None

    return Job(stage, stage, run, **fields)


POOLED = ("nbval", "colab", "releases", "dry-run", "book", "lab")
# The lab runs JupyterLab on notebook 03 and writes its screenshots beside the book's: it starts once no
# run of notebook 03 (with the lab's kernel running, papermill's kernel once waited the whole 300 s cell
# timeout on 03's grid widget, in a clean clone) and no book build is left.
LAB_APART_FROM = ("03_", "book")


def run_pool(jobs: list[Job], workers: int = 2) -> None:
    """Run ``jobs`` ``workers`` at a time, longest first: a free worker takes the longest job that may
    start (see ``Job.apart_from``), else waits for one to end. Each job's log is printed when it ends."""
    waiting = sorted(jobs, key=lambda job: -job.weight)
    running: list[Job] = []
    changed = threading.Condition()

    def may_start(job: Job) -> bool:
        return not any(part in other.label for part in job.apart_from
                       for other in waiting + running if other is not job)

    def worker() -> None:
        while True:
            with changed:
                while True:
                    if not waiting:
                        return
                    job = next((j for j in waiting if may_start(j)), None)
                    if job is not None:
                        break
                    changed.wait()
                waiting.remove(job)
                running.append(job)
            job.start = time.perf_counter()
            try:
                job.ok, log = job.run()
            except Exception as error:  # a job that cannot start fails, the others go on
                job.ok, log = False, f"{type(error).__name__}: {error}"
            job.end = time.perf_counter()
            with _PRINT:
                status = "ok" if job.ok else "FAILED"
                print(f"===== {job.label}: {status} ({job.end - job.start:.1f} s)\n{log}", flush=True)
            with changed:
                running.remove(job)
                changed.notify_all()

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def pooled(stages: list[str], actions: dict) -> tuple[list[tuple[str, float, str, str]], list[Job]]:
    """The pooled stages that were asked for, as one queue of jobs run two at a time, longest first
    (:func:`run_pool`): each notebook's kernel, each pytest, the book's Sphinx build with its browser
    check and the lab compute on about one core. A stage's seconds run from its first job's start to
    its last job's end (marked as run beside the others); the total is the wall clock."""
    wanted = [stage for stage in POOLED if stage in stages]
    with tempfile.TemporaryDirectory(prefix="tpuattn-pool-") as tmp:
        jobs = []
        if "nbval" in wanted:
            jobs += nbval_jobs(Path(tmp))
        if "book" in wanted:
            jobs.append(action_job("book", actions["book"]))
        if "lab" in wanted:
            jobs.append(action_job("lab", actions["lab"], apart_from=LAB_APART_FROM))
        if "colab" in wanted:
            jobs += colab_jobs(Path(tmp))
        if "releases" in wanted:
            jobs += release_jobs(Path(tmp))
        if "dry-run" in wanted:
            jobs += dry_run_jobs(Path(tmp))
        run_pool(jobs)
    rows = []
    for stage in wanted:
        mine = [job for job in jobs if job.stage == stage]
        failed = [job.label for job in mine if not job.ok]
        result = "ok" if not failed else f"FAILED ({', '.join(failed)})"
        others = [other for other in wanted if other != stage]
        note = f"beside {', '.join(others)}" if others else ""
        seconds = max(job.end for job in mine) - min(job.start for job in mine) if mine else 0.0
        rows.append((stage, seconds, result if mine else "FAILED (nothing to run)", note))
    return rows, jobs


def release_matrix(rows: list[tuple[str, float, str, str]], jobs: list[Job]) -> str:
    """The release matrix as a Markdown table (the README shows it): each supported JAX release, its
    libtpu, and what passed on it in this run. 0.7.2 and 0.10.2 report their full stages; the middle
    releases the smoke subset."""
    results = {stage: result for stage, _, result, _ in rows}
    by_label = {job.label: job for job in jobs}

    def full(stage: str) -> str:
        return "not run" if stage not in results else ("passed" if results[stage] == "ok" else "FAILED")

    def smoke(labels: list[str]) -> str:
        found = [by_label[label] for label in labels if label in by_label]
        if not found:
            return "not run"
        return "passed" if all(job.ok for job in found) else "FAILED"

    lines = ["| JAX | libtpu | against the oracle (forward, gradients) | compiled for every chip "
             "| notebooks |",
             "|---|---|---|---|---|"]
    for release in _venv.RELEASES:
        env = _venv.ENVS[release]
        libtpu = next((line.split("==")[1] for line in env.pins.read_text().splitlines()
                       if line.startswith("libtpu==")), "?")
        stems = [p.stem[:2] for p in notebook_files(".ipynb")]
        every = f"{stems[0]}-{stems[-1]}" if stems else "none"
        if release == "0.10.2":
            cells = (f"{full('unit-jax0.10.2')}: all unit tests", f"{full('compile')}: all compile tests",
                     f"{full('nbval')}: {every}, outputs compared (nbval)")
        elif release == "0.7.2":
            cells = (f"{full('unit-jax0.7.2')}: all unit tests",
                     f"{full('compile-jax0.7.2')}: all compile tests but the newest compiler's analyses",
                     "on Colab's stack: the row below")
        else:
            stems = [p.stem for p in notebook_files(".ipynb") if p.stem[:2] in RELEASE_NOTEBOOKS]
            cells = (f"{smoke([f'{release} oracle'])}: the quick tier",
                     f"{smoke([f'{release} compile'])}: the quick tier",
                     f"{smoke([f'{release} {stem}' for stem in stems])}: "
                     f"{'-'.join(dict.fromkeys((RELEASE_NOTEBOOKS[0], RELEASE_NOTEBOOKS[-1])))} executed, "
                     f"RUN_MEMORY = False{skipped(RELEASE_SKIPS)}")
        lines.append(f"| {release} | {libtpu} | " + " | ".join(cells) + " |")
    pins = _venv.colab_pins()
    colab = [job for job in jobs if job.stage == "colab" and job.label != "colab puzzles"]
    puzzles = smoke(["colab puzzles"])
    notebooks = "not run" if not colab else ("passed" if all(job.ok for job in colab) else "FAILED")
    lines.append(f"| {pins['jax']} on Colab's TPU runtime (Python {_venv.colab_python_version()}, "
                 f"`requirements/colab-tpu.txt`) | {pins['libtpu']} | {puzzles}: the puzzle checks "
                 f"| {puzzles}: every puzzle solution for v5e; notebook 03's compiled cells "
                 f"| {notebooks}: {every} executed, installed by their install cell, "
                 f"RUN_MEMORY = False{skipped(COLAB_SKIPS)} |")
    return "\n".join(lines)


def skipped(skips: dict[str, dict]) -> str:
    """``skips`` (notebook number -> parameters) as the matrix says it: ``; 10: RUN_COMPILES = False``."""
    return "".join(f"; {stem}: " + ", ".join(f"{k} = {v!r}" for k, v in values.items())
                   for stem, values in skips.items())


def chromium_missing() -> str | None:
    """None when chromium is there (installed here first when running as root), else the failure."""
    import browser_check

    problem = browser_check.chromium_problem()
    return None if problem is None else f"FAILED ({problem})"


def stage_book() -> str:
    # The site from the committed outputs, then every page opened in headless chromium.
    if problem := chromium_missing():
        return problem
    for script in ("book.py", "browser_check.py"):
        code = run([str(_venv.MAIN.python), str(ROOT / "ci" / script)])
        if code != 0:
            return f"FAILED (ci/{script} exit {code})"
    return "ok"


def stage_lab() -> str:
    if problem := chromium_missing():
        return problem
    code = run([str(_venv.MAIN.python), str(ROOT / "ci" / "lab_check.py")])
    return "ok" if code == 0 else f"FAILED (ci/lab_check.py exit {code})"


def git_status() -> list[str]:
    """``git status --porcelain`` of the checkout (tracked changes and untracked, unignored files)."""
    result = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True)
    return result.stdout.splitlines() if result.returncode == 0 else [f"(git status failed: {result.stderr})"]


def stage_clean(before: list[str]) -> str:
    """The run left the checkout as it found it: outputs, figures and environments go to ignored places."""
    changed = sorted(set(git_status()) - set(before))
    for line in changed:
        print("  " + line)
    return "ok" if not changed else f"FAILED (the run changed {len(changed)} path(s) in the checkout)"


def setup(stages: list[str]) -> None:
    """Build the environments the stages need, side by side, before the re-exec into ``.venv``; their
    times travel to the re-executed command in ``TPUATTN_CI_SETUP`` for the table."""
    if os.environ.get("TPUATTN_CI_SETUP") is not None:
        return  # already done, before the re-exec
    envs = [_venv.MAIN] + ([_venv.JAX_0_7] if any("jax0.7.2" in stage for stage in stages) else [])
    envs += [_venv.COLAB] if "colab" in stages else []
    envs += [_venv.ENVS[release] for release in MIDDLE_RELEASES] if "releases" in stages else []
    todo = [env for env in envs if not env.is_current()]

    def build(env: _venv.Env) -> tuple[str, float, str]:
        start = time.perf_counter()
        try:
            env.ensure()
            result = "ok"
        except SystemExit as failure:  # _venv reports a failed command this way
            result = f"FAILED ({failure})"
        return env.name, time.perf_counter() - start, result

    # Mostly downloading and unpacking wheels: all of them at once.
    with ThreadPoolExecutor(max_workers=max(1, len(todo))) as pool:
        rows = list(pool.map(build, todo))
    os.environ["TPUATTN_CI_SETUP"] = ";".join(f"{name}={seconds:.3f}={result}"
                                              for name, seconds, result in rows)
    if any(result != "ok" for _, _, result in rows):
        for name, seconds, result in rows:
            print(f"setup {name}: {result} ({seconds:.1f} s)")
        sys.exit(1)


def setup_rows() -> list[tuple[str, float, str, str]]:
    rows = [item.split("=", 2) for item in os.environ.get("TPUATTN_CI_SETUP", "").split(";") if item]
    beside = "side by side" if len(rows) > 1 else ""
    return [(f"setup {name}", float(seconds), result, beside) for name, seconds, result in rows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    choices = (*STAGES, "quick")
    parser.add_argument("--quick", action="store_true", help=f"the edit loop: {', '.join(QUICK_STAGES)}")
    parser.add_argument("--only", action="append", choices=choices, help="run only this stage (repeatable)")
    parser.add_argument("--skip", action="append", choices=choices, default=[], help="skip this stage")
    args = parser.parse_args()
    if args.quick and args.only:
        parser.error("--quick and --only: choose one")
    stages = [s for s in (QUICK_STAGES if args.quick else args.only or STAGES) if s not in args.skip]

    # Bytecode is written and reused: with PYTHONDONTWRITEBYTECODE set (as on this project's CI
    # machines) every Python process the command starts -- pytest workers, notebook kernels, the
    # tests' child processes -- compiled JAX and the rest from source again: `import jax, tpuattn,
    # matplotlib.pyplot` took 8.0 s of CPU that way, 3.8 s from the venv's __pycache__ (measured).
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    # Wall-clock start, kept across the re-exec into .venv so the total includes its set-up.
    begin = float(os.environ.setdefault("TPUATTN_CI_START", str(time.time())))
    # What git says before anything runs, kept across the re-exec: the run must leave it so.
    os.environ.setdefault("TPUATTN_CI_GIT_STATUS", "\n".join(git_status()))
    setup(stages)
    _venv.reexec_in(_venv.MAIN)
    rows = setup_rows()
    actions = {"ruff": stage_ruff, "pairs": stage_pairs, "unit-jax0.10.2": lambda: stage_unit(_venv.MAIN),
               "unit-jax0.7.2": lambda: stage_unit(_venv.JAX_0_7),
               "compile": lambda: stage_compile(_venv.MAIN),
               "compile-jax0.7.2": lambda: stage_compile(_venv.JAX_0_7),
               "book": stage_book, "lab": stage_lab, "quick": stage_quick}
    pool_stages = [stage for stage in POOLED if stage in stages]
    jobs: list[Job] = []
    for stage in stages:
        if stage in pool_stages[1:]:
            continue  # ran in the pool with the first pooled stage
        if stage in pool_stages:
            print(f"\n===== {', '.join(pool_stages)} (pooled) =====", flush=True)
            pool_rows, jobs = pooled(stages, actions)
            rows += pool_rows
            for name, seconds, result, _ in pool_rows:
                print(f"===== {name}: {result} ({seconds:.1f} s)", flush=True)
            continue
        print(f"\n===== {stage} =====", flush=True)
        start = time.perf_counter()
        result = actions[stage]()
        seconds = time.perf_counter() - start
        print(f"===== {stage}: {result} ({seconds:.1f} s)", flush=True)
        rows.append((stage, seconds, result, ""))

    # Nothing the command made may land in the checkout.
    start = time.perf_counter()
    result = stage_clean(os.environ["TPUATTN_CI_GIT_STATUS"].splitlines())
    print(f"===== clean checkout: {result}", flush=True)
    rows.append(("clean checkout", time.perf_counter() - start, result, "git status --porcelain"))
    print(f"\n{'stage':<26}  {'seconds':>8}  result")
    print(f"{'-' * 26}  {'-' * 8}  ------")
    for stage, seconds, result, note in rows:
        print(f"{stage:<26}  {seconds:8.1f}  {result}" + (f" ({note})" if note else ""))
    failed = [stage for stage, _, result, _ in rows if result != "ok"]
    if "releases" in stages:
        print(f"\nrelease matrix (JAX_PLATFORMS=cpu; compiled, not run, for the TPU chips):\n"
              f"{release_matrix(rows, jobs)}\n")
    print(f"{'total (wall clock)':<26}  {time.time() - begin:8.1f}  "
          + ("all passed" if not failed else f"FAILED: {', '.join(failed)}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
