"""The test command: lint, notebook pairs, unit tests on JAX 0.10.2 and 0.7.2, nbval.

    python3 ci/test.py                       # everything (what .ci/run calls)
    python3 ci/test.py --quick               # the edit loop: ruff, pairs, quick (a few minutes)
    python3 ci/test.py --only unit-jax0.10.2 # one stage (repeatable); --skip works the same way

On first use it builds ``.venv`` (JAX 0.10.2 + tools) and ``.venv-jax0.7.2`` from the pin files in
``requirements/`` (see ci/_venv.py), the two side by side. ``--quick`` runs ``ruff``, ``pairs`` and:

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
* ``unit-jax0.7.2``   pytest tests/ on JAX 0.7.2 (Colab's TPU runtime)
* ``compile``         tests/test_aot*.py in ``.venv`` (JAX 0.10.2 + libtpu, ``JAX_PLATFORMS=cpu``): every
                      implementation through the real TPU compiler for every chip, the model held to the
                      compiler (compiled, not run; no TPU needed). The unit stages leave this file out.
* ``compile-jax0.7.2`` the same file on JAX 0.7.2 with its libtpu (0.0.23): everything compiles for every
                      chip there too (the facts recorded with the newer compiler are checked only above)
* ``nbval``           ``pytest --nbval`` over the committed notebooks on the venv's Python; compares
                      outputs except stderr and cells tagged ``nbval-ignore-output``; figures go to a
                      temporary folder (TPUATTN_FIGURES_DIR) so the working tree is not modified.
* ``papermill-jax0.7.2`` every notebook executed top to bottom with papermill on JAX 0.7.2 (Colab's TPU
                      runtime, with its ipywidgets 7.7.1) through ``ci/notebooks.py --jax 0.7.2``, two
                      notebooks at a time (one kernel each, as nbval does); outputs and figures to a
                      temporary folder
* ``book``            ``ci/book.py`` builds the site in ``out/book/`` from the committed outputs;
                      ``ci/browser_check.py`` opens every page in headless chromium (console errors,
                      failed or external loads, broken links and anchors, alt text) and takes
                      screenshots at desktop and phone widths into ``out/book/screenshots/``
* ``lab``             ``ci/lab_check.py``: notebook 03 run in JupyterLab in chromium, a slider of its grid
                      widget moved and the figure seen to change (screenshots before and after)

When the full command runs, ``book`` runs beside ``papermill-jax0.7.2`` as one more job of its two
(each of those jobs computes on about one core); its table row says so. ``lab`` runs after them.
The pytest stages run two workers (``-n 2 --dist worksteal``).

The book and lab stages need Debian's chromium (``/usr/bin/chromium``): as root the command installs
it (``apt-get install -y chromium chromium-driver``, in CI or not); as another user those two stages
fail saying what to install. Every stage runs; the command prints a table of stage, seconds, result
(the set-up of the two environments included, and which ran side by side) and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import os
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
          "papermill-jax0.7.2", "book", "lab")
QUICK_STAGES = ("ruff", "pairs", "quick")
# The files that hold the quick tier's tests (tests/conftest.py marks them): collecting only these
# keeps the quick stage's start short.
QUICK_FILES = ("tests/test_architecture.py", "tests/test_oracle_suite.py", "tests/test_decode.py",
               "tests/test_aot.py")
# The unit stages' CPU programs are small and run once: LLVM's optimisation passes are about half of
# their compile time (tests/test_blockwise.py: 55 s of CPU time at the default level, 28 s without)
# and change no result beyond float rounding, which every test's tolerance allows (XLA keeps its own
# HLO passes, and fast math stays off). The notebooks (nbval, papermill) keep XLA's defaults: their
# printed numbers and timings are the ones a reader gets. The compile stages do not set it either.
UNIT_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
COMPILE_TESTS = "tests/test_aot*.py"  # the compile stages' files; the unit stages leave them out
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


def stage_unit(env: _venv.Env) -> str:
    # --durations: the slowest tests are named in every CI log, so the 25-minute budget can be watched.
    # -n 2: two pytest-xdist workers, one per core. Most of the time is XLA compiling (one thread
    # each), so two workers come close to halving the stage. The compile tests have their own stage.
    # --dist worksteal: a worker that runs out of tests takes queued ones from the other, so the
    # stage does not end on one worker's backlog of slow tests while the other core idles.
    # XLA_FLAGS (UNIT_XLA_FLAGS): LLVM's optimisation off for the CPU programs the tests compile.
    return pytest_result(run([str(env.python), "-m", "pytest", "-p", "no:cacheprovider", "--durations=15",
                              "-n", "2", "--dist", "worksteal", f"--ignore-glob={COMPILE_TESTS}", "tests"],
                             env={**_venv.CPU_WITH_TPU_COMPILER, "XLA_FLAGS": UNIT_XLA_FLAGS}))


def stage_compile(env: _venv.Env) -> str:
    variables = {**_venv.CPU_WITH_TPU_COMPILER, "TPUATTN_REQUIRE_TPU_COMPILER": "1"}
    files = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(COMPILE_TESTS))
    return pytest_result(run([str(env.python), "-m", "pytest", "-p", "no:cacheprovider",
                              "--durations=10", "-n", "2", "--dist", "worksteal", *files], env=variables))


def stage_quick() -> str:
    # The edit loop's tier (tests/conftest.py marks it): the compile tests need the TPU compiler, as in
    # the compile stage, so a missing libtpu fails instead of skipping.
    variables = {**_venv.CPU_WITH_TPU_COMPILER, "TPUATTN_REQUIRE_TPU_COMPILER": "1"}
    return pytest_result(run([str(_venv.MAIN.python), "-m", "pytest", "-p", "no:cacheprovider",
                              "--durations=10", "-n", "2", "--dist", "worksteal", "-m", "quick",
                              *QUICK_FILES], env=variables))


def stage_nbval() -> str:
    ipynbs = [str(p.relative_to(ROOT)) for p in notebook_files(".ipynb")]
    if not ipynbs:
        return "FAILED (no notebooks/NN_*.ipynb to check)"
    with tempfile.TemporaryDirectory(prefix="tpuattn-nbval-figures-") as figures:
        code = run([str(_venv.MAIN.python), "-m", "pytest", "-p", "no:cacheprovider", "-p", "nbval_plugin",
                    "--nbval", "--nbval-current-env", "--nbval-cell-timeout", "300",
                    # One notebook per worker, its cells in order, two notebooks at a time.
                    "-n", "2", "--dist", "loadfile",
                    "--nbval-sanitize-with", "ci/nbval_sanitize.cfg", *ipynbs],
                   env={"PYTHONPATH": str(ROOT / "ci"), "TPUATTN_FIGURES_DIR": figures,
                        **_venv.CPU_WITH_TPU_COMPILER})
    return pytest_result(code)


def stage_papermill_jax07(beside=None) -> str:
    """Every notebook top to bottom on Colab's JAX (0.7.2, ipywidgets 7.7.1) with papermill; the
    executed copies and figures go to a temporary folder, the working tree is not written.

    A notebook's kernel computes on about one core (mostly compiling, one thread), so two jobs run at
    a time, each notebook in its own ``ci/notebooks.py`` (as nbval runs two): ``beside`` (a function:
    the book and lab stages, when the full command runs) first, then the biggest committed notebooks
    first, so that a long one does not start last. Each job's log is printed whole when it ends."""
    stems = [p.stem for p in sorted(notebook_files(".ipynb"), key=lambda p: -p.stat().st_size)]
    if not stems:
        return "FAILED (no notebooks/NN_*.ipynb to run)"
    with tempfile.TemporaryDirectory(prefix="tpuattn-papermill-") as tmp:
        env = {**os.environ, "TPUATTN_FIGURES_DIR": str(Path(tmp) / "figures"), **_venv.CPU_WITH_TPU_COMPILER}

        def one(stem: str) -> tuple[str, int]:
            cmd = [str(_venv.MAIN.python), str(ROOT / "ci" / "notebooks.py"), "--jax", "0.7.2",
                   "--out", str(Path(tmp) / "notebooks"), stem]
            start = time.perf_counter()
            result = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
            with _PRINT:
                print(f"$ python ci/notebooks.py --jax 0.7.2 --out ... {stem}\n{result.stdout}"
                      f"[papermill] {stem}: exit {result.returncode} ({time.perf_counter() - start:.1f} s)",
                      flush=True)
            return stem, result.returncode

        jobs = ([beside] if beside else []) + [lambda stem=stem: one(stem) for stem in stems]
        with ThreadPoolExecutor(max_workers=2) as pool:
            codes = dict(code for code in pool.map(lambda job: job(), jobs) if code is not None)
    failed = [stem for stem, code in codes.items() if code != 0]
    return "ok" if not failed else f"FAILED (ci/notebooks.py failed for {', '.join(failed)})"


def side_by_side(stages: list[str], actions: dict) -> list[tuple[str, float, str, str]]:
    """``papermill-jax0.7.2`` with ``book`` beside it, two jobs at a time: the book's Sphinx build and
    its browser check use about one core, as one notebook's kernel does. Each stage's own seconds are
    in the table, marked as run side by side; the total is the wall clock.

    ``lab`` is not run beside the notebooks: with the lab's JupyterLab kernel running, papermill's
    kernel waited the whole 300 s cell timeout on notebook 03's grid widget (measured in a clean
    clone), so the lab runs after them, alone."""
    rows = []

    def book_beside():
        _CAPTURE.lines = []
        for stage in ("book",):
            if stage in stages:
                start = time.perf_counter()
                result = actions[stage]()
                rows.append((stage, time.perf_counter() - start, result, "beside papermill-jax0.7.2"))
                _CAPTURE.lines.append(f"===== {stage}: {result} ({rows[-1][1]:.1f} s)\n")
        with _PRINT:
            print("===== book (beside papermill-jax0.7.2) =====\n" + "".join(_CAPTURE.lines), flush=True)
        _CAPTURE.lines = None
        return None

    start = time.perf_counter()
    result = stage_papermill_jax07(beside=book_beside)
    beside = ", ".join(stage for stage, *_ in rows)
    return [("papermill-jax0.7.2", time.perf_counter() - start, result, f"beside {beside}"), *rows]


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


def setup(stages: list[str]) -> None:
    """Build the environments the stages need, side by side, before the re-exec into ``.venv``; their
    times travel to the re-executed command in ``TPUATTN_CI_SETUP`` for the table."""
    if os.environ.get("TPUATTN_CI_SETUP") is not None:
        return  # already done, before the re-exec
    envs = [_venv.MAIN] + ([_venv.JAX_0_7] if any("jax0.7.2" in stage for stage in stages) else [])
    todo = [env for env in envs if not env.is_current()]

    def build(env: _venv.Env) -> tuple[str, float, str]:
        start = time.perf_counter()
        try:
            env.ensure()
            result = "ok"
        except SystemExit as failure:  # _venv reports a failed command this way
            result = f"FAILED ({failure})"
        return env.name, time.perf_counter() - start, result

    with ThreadPoolExecutor(max_workers=2) as pool:
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

    # Wall-clock start, kept across the re-exec into .venv so the total includes its set-up.
    begin = float(os.environ.setdefault("TPUATTN_CI_START", str(time.time())))
    setup(stages)
    _venv.reexec_in(_venv.MAIN)
    rows = setup_rows()
    actions = {"ruff": stage_ruff, "pairs": stage_pairs, "unit-jax0.10.2": lambda: stage_unit(_venv.MAIN),
               "unit-jax0.7.2": lambda: stage_unit(_venv.JAX_0_7),
               "compile": lambda: stage_compile(_venv.MAIN),
               "compile-jax0.7.2": lambda: stage_compile(_venv.JAX_0_7),
               "nbval": stage_nbval, "papermill-jax0.7.2": stage_papermill_jax07, "book": stage_book,
               "lab": stage_lab, "quick": stage_quick}
    together = "papermill-jax0.7.2" in stages and "book" in stages
    for stage in stages:
        if together and stage == "book":
            continue  # ran beside papermill-jax0.7.2
        print(f"\n===== {stage} =====", flush=True)
        if together and stage == "papermill-jax0.7.2":
            together_rows = side_by_side(stages, actions)
            rows += together_rows
            print(f"===== {stage}: {together_rows[0][2]} ({together_rows[0][1]:.1f} s)", flush=True)
            continue
        start = time.perf_counter()
        result = actions[stage]()
        seconds = time.perf_counter() - start
        print(f"===== {stage}: {result} ({seconds:.1f} s)", flush=True)
        rows.append((stage, seconds, result, ""))

    print(f"\n{'stage':<26}  {'seconds':>8}  result")
    print(f"{'-' * 26}  {'-' * 8}  ------")
    for stage, seconds, result, note in rows:
        print(f"{stage:<26}  {seconds:8.1f}  {result}" + (f" ({note})" if note else ""))
    failed = [stage for stage, _, result, _ in rows if result != "ok"]
    print(f"{'total (wall clock)':<26}  {time.time() - begin:8.1f}  "
          + ("all passed" if not failed else f"FAILED: {', '.join(failed)}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
