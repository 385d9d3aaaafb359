"""Execute every notebook with papermill on the default backend; figures to out/figures/.

    python3 ci/notebooks.py                 # all notebooks -> out/notebooks/, figures -> out/figures/
    python3 ci/notebooks.py 01 03           # only notebooks whose name contains 01 or 03
    python3 ci/notebooks.py -p RUN_BENCHMARKS True    # override a parameters-cell value
    python3 ci/notebooks.py --update        # also write the outputs back into the committed .ipynb
                                            # and the committed figures/
    python3 ci/notebooks.py --figures       # only the committed figures/ (no .ipynb written)
    python3 ci/notebooks.py --jax 0.7.2     # on Colab's JAX (a kernel in .venv-jax0.7.2)

On first use it builds ``.venv`` from ``requirements/ci-jax0.10.2.txt`` (see ci/_venv.py) and re-runs
itself inside it. Notebooks run from ``notebooks/`` on the venv's ``tpuattn`` kernel. The run ends
with a table (notebook, seconds, status); a failing notebook fails the command and its cell is named.

Figures (``tpuattn.viz.style.save_figure``) go where ``TPUATTN_FIGURES_DIR`` says: ``figures/``, the
committed ones, with ``--update`` or ``--figures``; else the caller's ``TPUATTN_FIGURES_DIR`` (the test
command's temporary folder); else ``out/figures/``, which git ignores, so a plain run leaves the
checkout clean.

``--update`` is how committed notebooks get their outputs: the ``.py`` twin is the source; its cells
are merged into the ``.ipynb`` (``jupytext --update`` keeps cell ids), executed, cleaned of
papermill's traces (the ``injected-parameters`` cell, papermill/timing metadata, widget state, the
CI kernel name), written back, and the ``.py`` twin is regenerated from it so the pair is in sync.
Before the timing metadata goes, the seconds the notebook's code cells took are summed per section
(level-2 heading; ``""`` for the cells before the first) into ``notebooks/run_seconds.json``, with
the machine and JAX that ran them: the workshop plan's measured run times (tests/test_workshop.py).

Hidden solution cells run only when their notebook's ``RUN_SOLUTIONS`` parameter is true, which is
``TPUATTN_RUN_SOLUTIONS=1`` in the environment unless papermill's ``-p`` says otherwise: a learner's
Run All shows only the learner's own results. This command sets ``TPUATTN_RUN_SOLUTIONS=1`` for its
kernels unless the caller set it, so the committed outputs (and nbval, which the test command runs
with it) include the solutions' checks.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
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
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def discover(patterns: list[str]) -> list[str]:
    """Notebook stems ``NN_name`` that have a .py or .ipynb in notebooks/, filtered by substrings."""
    stems = sorted({p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*") if p.suffix in (".py", ".ipynb")})
    if patterns:
        stems = [s for s in stems if any(pat in s for pat in patterns)]
    return stems


def jupytext(*args: str) -> None:
    cmd = [str(_venv.MAIN.bin("jupytext")), "--quiet", *args]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"jupytext failed: {' '.join(cmd)}\n{result.stdout}{result.stderr}")


def prepare_input(stem: str, scratch: Path, update: bool) -> Path:
    """The notebook to execute: the committed .ipynb, or (``--update`` / no .ipynb) the .py's cells."""
    ipynb, py = NOTEBOOKS / f"{stem}.ipynb", NOTEBOOKS / f"{stem}.py"
    target = scratch / f"{stem}.ipynb"
    if ipynb.exists() and not (update and py.exists()):
        shutil.copyfile(ipynb, target)
        return target
    if ipynb.exists():
        import nbformat

        # papermill gives every cell an empty "tags" list. jupytext --update restores cell metadata
        # the text format does not show (an empty list) over the .py's, so a tag added in the .py to
        # a cell executed before would be lost: drop the empty lists first.
        nb = nbformat.read(ipynb, as_version=4)
        for cell in nb.cells:
            if cell.metadata.get("tags") == []:
                del cell.metadata["tags"]
        nbformat.write(nb, target)
        jupytext("--to", "ipynb", "--update", "--output", str(target), str(py))
    else:
        jupytext("--to", "ipynb", "--output", str(target), str(py))
    return target


def clean(nb) -> None:
    """Remove papermill's traces so the notebook can be committed and nbval-checked."""
    nb.cells = [c for c in nb.cells if "injected-parameters" not in c.metadata.get("tags", [])]
    nb.metadata.pop("papermill", None)
    # Widget state changes on every run (random model ids) and can hold whole images: not committed.
    nb.metadata.pop("widgets", None)
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    for cell in nb.cells:
        cell.metadata.pop("papermill", None)
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            for output in cell.get("outputs", []):
                output.get("metadata", {}).pop("papermill", None)


SECONDS = NOTEBOOKS / "run_seconds.json"  # seconds per notebook section in the committed runs


def section_seconds(nb) -> dict[str, float]:
    """Seconds of the executed notebook's code cells (papermill's timing) per level-2 heading, ``""``
    for the cells before the first heading, every heading listed (0.0 where no code ran)."""
    seconds, current = {"": 0.0}, ""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("## "):
                    current = line[3:].strip()
                    seconds.setdefault(current, 0.0)
        elif cell.cell_type == "code":
            seconds[current] += float(cell.metadata.get("papermill", {}).get("duration") or 0.0)
    return {heading: round(value, 1) for heading, value in seconds.items()}


def record_seconds(stem: str, nb) -> None:
    """Write ``stem``'s seconds per section into :data:`SECONDS` (the other notebooks' entries kept)."""
    from importlib.metadata import version

    table = json.loads(SECONDS.read_text()) if SECONDS.exists() else {}
    table["about"] = ("Seconds each notebook's code cells took, per level-2 section ('' = before the "
                      "first), in the run that made its committed outputs (python3 ci/notebooks.py "
                      "--update); tests/test_workshop.py adds them to the workshop plan's slots.")
    sections = section_seconds(nb)
    table.setdefault("notebooks", {})[stem] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (os.cpu_count), JAX_PLATFORMS="
                   f"{os.environ.get('JAX_PLATFORMS', '')}",
        "jax": version("jax"), "total_s": round(sum(sections.values()), 1), "sections": sections}
    table["notebooks"] = dict(sorted(table["notebooks"].items()))
    SECONDS.write_text(json.dumps(table, indent=1, ensure_ascii=False) + "\n")


def describe_failure(error, source_nb) -> str:
    """'cell 7 (In [5]): <first line>' for a PapermillExecutionError, numbered as in the source notebook."""
    first_line = next((line for line in error.source.splitlines() if line.strip()), "")
    index = next((i for i, c in enumerate(source_nb.cells) if c.source == error.source), error.cell_index)
    return (f"cell {index} (In [{error.exec_count}]): {first_line.strip()[:80]!r}\n"
            f"    {error.ename}: {str(error.evalue).strip().splitlines()[0] if error.evalue else ''}")


def figures_dir(*, committed: bool) -> Path:
    """Where the notebooks' figures go (see the module docstring), absolute: they run from notebooks/."""
    if committed:
        path = ROOT / "figures"
    elif os.environ.get("TPUATTN_FIGURES_DIR"):
        path = Path(os.environ["TPUATTN_FIGURES_DIR"]).resolve()
    else:
        path = ROOT / "out" / "figures"
    path.mkdir(parents=True, exist_ok=True)
    return path


def parse_value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="run only notebooks whose name contains one of these")
    parser.add_argument("--update", action="store_true",
                        help="write outputs back into notebooks/*.ipynb and re-sync the .py twins; "
                             "implies --figures")
    parser.add_argument("--figures", action="store_true",
                        help="save figures into the committed figures/ (default: out/figures/, ignored)")
    parser.add_argument("--out", default="out/notebooks", help="folder for executed notebooks")
    parser.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                        help="override a parameters-cell variable (Python literal)")
    parser.add_argument("--cell-timeout", type=int, default=300, help="seconds per cell")
    parser.add_argument("--jax", choices=sorted(_venv.ENVS), default="0.10.2",
                        help="the JAX the notebooks' kernel runs (0.7.2: Colab's TPU runtime)")
    args = parser.parse_args()
    if args.update and args.jax != "0.10.2":
        parser.error("--update writes the committed outputs, which come from JAX 0.10.2")

    kernel_env = _venv.ENVS[args.jax]
    if kernel_env is not _venv.MAIN:
        kernel_env.ensure()
        # papermill (in .venv) finds the other environment's kernel through JUPYTER_PATH.
        existing = os.environ.get("JUPYTER_PATH", "").split(os.pathsep)
        paths = [str(kernel_env.jupyter_path), *filter(None, existing)]
        os.environ["JUPYTER_PATH"] = os.pathsep.join(dict.fromkeys(paths))
    _venv.reexec_in(_venv.MAIN)
    # .venv has libtpu (the TPU compiler, for the compiled cells): keep JAX on the CPU unless the
    # caller chose a platform (JAX_PLATFORMS=tpu on a TPU machine).
    for name, value in _venv.CPU_WITH_TPU_COMPILER.items():
        os.environ.setdefault(name, value)
    # The notebooks' hidden solution cells run (their RUN_SOLUTIONS parameter reads this): the
    # committed outputs hold their checks, as nbval's run does.
    os.environ.setdefault("TPUATTN_RUN_SOLUTIONS", "1")
    import nbformat
    import papermill as pm
    from papermill.exceptions import PapermillExecutionError

    stems = discover(args.names)
    if not stems:
        print(f"no notebooks matched {args.names} in {NOTEBOOKS}", file=sys.stderr)
        return 1
    out_dir = (ROOT / args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = figures_dir(committed=args.figures or args.update)
    os.environ["TPUATTN_FIGURES_DIR"] = str(figures)  # the kernels papermill starts inherit it
    parameters = {name: parse_value(value) for name, value in args.parameter}
    rows = []
    with tempfile.TemporaryDirectory(prefix="tpuattn-nb-") as tmp:
        scratch = Path(tmp)
        for n, stem in enumerate(stems, 1):
            print(f"\n[{n}/{len(stems)}] {stem}", flush=True)
            source = prepare_input(stem, scratch, args.update)
            output = out_dir / f"{stem}.ipynb"
            start = time.perf_counter()
            status = "ok"
            try:
                pm.execute_notebook(str(source), str(output), parameters=parameters,
                                    kernel_name=kernel_env.kernel, cwd=str(NOTEBOOKS), progress_bar=True,
                                    execution_timeout=args.cell_timeout)
            except PapermillExecutionError as error:
                status = "FAILED " + describe_failure(error, nbformat.read(source, as_version=4))
            except Exception as error:  # kernel died, timeout, bad notebook...
                status = f"FAILED {type(error).__name__}: {str(error).strip()[:200]}"
            seconds = time.perf_counter() - start
            print(f"[{n}/{len(stems)}] {stem}: {status} ({seconds:.1f} s)", flush=True)
            if status == "ok" and args.update:
                nb = nbformat.read(output, as_version=4)
                record_seconds(stem, nb)
                clean(nb)
                nbformat.write(nb, NOTEBOOKS / f"{stem}.ipynb")
                jupytext("--to", "py:percent", str(NOTEBOOKS / f"{stem}.ipynb"))
                print(f"    updated notebooks/{stem}.ipynb and notebooks/{stem}.py", flush=True)
            rows.append((stem, seconds, status))

    width = max(len(s) for s, _, _ in rows)
    print(f"\n{'notebook':<{width}}  {'seconds':>8}  status")
    print(f"{'-' * width}  {'-' * 8}  ------")
    for stem, seconds, status in rows:
        print(f"{stem:<{width}}  {seconds:8.1f}  {status}")
    total = sum(s for _, s, _ in rows)
    failed = [stem for stem, _, status in rows if status != "ok"]
    print(f"{'total':<{width}}  {total:8.1f}  {len(rows) - len(failed)} ok, {len(failed)} failed")
    shown = [os.path.relpath(path, ROOT) if path.is_relative_to(ROOT) else str(path)
             for path in (out_dir, figures)]
    print(f"executed notebooks: {shown[0]}/   figures: {shown[1]}/")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
