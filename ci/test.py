"""The test command: lint, notebook pairs, unit tests on JAX 0.10.2 and 0.7.2, nbval.

    python3 ci/test.py                       # everything (what .ci/run calls)
    python3 ci/test.py --only unit-jax0.10.2 # one stage (repeatable); --skip works the same way

On first use it builds ``.venv`` (JAX 0.10.2 + tools) and ``.venv-jax0.7.2`` from the pin files in
``requirements/`` (see ci/_venv.py). Stages, cheapest first:

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
                      runtime, with its ipywidgets 7.7.1) through ``ci/notebooks.py --jax 0.7.2``;
                      outputs and figures to a temporary folder
* ``book``            ``ci/book.py`` builds the site in ``out/book/`` from the committed outputs;
                      ``ci/browser_check.py`` opens every page in headless chromium (console errors,
                      failed or external loads, broken links and anchors, alt text) and takes
                      screenshots at desktop and phone widths into ``out/book/screenshots/``
* ``lab``             ``ci/lab_check.py``: notebook 03 run in JupyterLab in chromium, a slider of its grid
                      widget moved and the figure seen to change (screenshots before and after)

Every stage runs; the command prints a table of stage, seconds, result and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _venv  # noqa: E402

ROOT = _venv.ROOT
NOTEBOOKS = ROOT / "notebooks"
STAGES = ("ruff", "pairs", "unit-jax0.10.2", "unit-jax0.7.2", "compile", "compile-jax0.7.2", "nbval",
          "papermill-jax0.7.2", "book", "lab")
COMPILE_TESTS = "tests/test_aot*.py"  # the compile stages' files; the unit stages leave them out
PYTEST_EXIT = {0: "passed", 1: "tests failed", 2: "interrupted", 3: "internal error", 4: "usage error",
               5: "no tests collected"}


def notebook_files(suffix: str) -> list[Path]:
    return sorted(NOTEBOOKS.glob(f"[0-9][0-9]_*{suffix}"))


def run(cmd: list[str], env: dict | None = None) -> int:
    shown = (os.path.relpath(c, ROOT) if c.startswith(str(ROOT)) else c for c in cmd)
    print("$ " + " ".join(shown), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}).returncode


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
    return pytest_result(run([str(env.python), "-m", "pytest", "-p", "no:cacheprovider", "--durations=15",
                              "-n", "2", f"--ignore-glob={COMPILE_TESTS}", "tests"],
                             env=_venv.CPU_WITH_TPU_COMPILER))


def stage_compile(env: _venv.Env) -> str:
    variables = {**_venv.CPU_WITH_TPU_COMPILER, "TPUATTN_REQUIRE_TPU_COMPILER": "1"}
    files = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(COMPILE_TESTS))
    return pytest_result(run([str(env.python), "-m", "pytest", "-p", "no:cacheprovider",
                              "--durations=10", "-n", "2", *files], env=variables))


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


def stage_papermill_jax07() -> str:
    """Every notebook top to bottom on Colab's JAX (0.7.2, ipywidgets 7.7.1) with papermill; the
    executed copies and figures go to a temporary folder, the working tree is not written."""
    with tempfile.TemporaryDirectory(prefix="tpuattn-papermill-") as tmp:
        code = run([str(_venv.MAIN.python), str(ROOT / "ci" / "notebooks.py"), "--jax", "0.7.2",
                    "--out", str(Path(tmp) / "notebooks")],
                   env={"TPUATTN_FIGURES_DIR": str(Path(tmp) / "figures"), **_venv.CPU_WITH_TPU_COMPILER})
    return "ok" if code == 0 else f"FAILED (ci/notebooks.py exit {code})"


def stage_book() -> str:
    # The site from the committed outputs, then every page opened in headless chromium.
    for script in ("book.py", "browser_check.py"):
        code = run([str(_venv.MAIN.python), str(ROOT / "ci" / script)])
        if code != 0:
            return f"FAILED (ci/{script} exit {code})"
    return "ok"


def stage_lab() -> str:
    code = run([str(_venv.MAIN.python), str(ROOT / "ci" / "lab_check.py")])
    return "ok" if code == 0 else f"FAILED (ci/lab_check.py exit {code})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=STAGES, help="run only this stage (repeatable)")
    parser.add_argument("--skip", action="append", choices=STAGES, default=[], help="skip this stage")
    args = parser.parse_args()
    stages = [s for s in (args.only or STAGES) if s not in args.skip]

    # Wall-clock start, kept across the re-exec into .venv so the total includes its set-up.
    begin = float(os.environ.setdefault("TPUATTN_CI_START", str(time.time())))
    _venv.reexec_in(_venv.MAIN)
    rows = []
    for stage, env in (("unit-jax0.7.2", _venv.JAX_0_7), ("compile-jax0.7.2", _venv.JAX_0_7),
                       ("papermill-jax0.7.2", _venv.JAX_0_7)):
        if stage in stages and not any(env.name in name for name, _, _ in rows):
            start = time.perf_counter()
            env.ensure()
            rows.append((f"setup {env.name}", time.perf_counter() - start, "ok"))
    actions = {"ruff": stage_ruff, "pairs": stage_pairs, "unit-jax0.10.2": lambda: stage_unit(_venv.MAIN),
               "unit-jax0.7.2": lambda: stage_unit(_venv.JAX_0_7),
               "compile": lambda: stage_compile(_venv.MAIN),
               "compile-jax0.7.2": lambda: stage_compile(_venv.JAX_0_7),
               "nbval": stage_nbval, "papermill-jax0.7.2": stage_papermill_jax07, "book": stage_book,
               "lab": stage_lab}
    for stage in stages:
        print(f"\n===== {stage} =====", flush=True)
        start = time.perf_counter()
        result = actions[stage]()
        seconds = time.perf_counter() - start
        print(f"===== {stage}: {result} ({seconds:.1f} s)", flush=True)
        rows.append((stage, seconds, result))

    print(f"\n{'stage':<22}  {'seconds':>8}  result")
    print(f"{'-' * 22}  {'-' * 8}  ------")
    for stage, seconds, result in rows:
        print(f"{stage:<22}  {seconds:8.1f}  {result}")
    failed = [stage for stage, _, result in rows if result != "ok"]
    print(f"{'total':<22}  {time.time() - begin:8.1f}  "
          + ("all passed" if not failed else f"FAILED: {', '.join(failed)}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
