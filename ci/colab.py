"""Colab's TPU runtime, here: the package installed as a learner's notebook installs it.

    python3 ci/colab.py     # build .venv-colab if needed, then run a notebook's install cell in it

``.venv-colab`` holds Colab's TPU runtime as Google publishes it (``requirements/colab-tpu.txt``;
``ci/_venv.py``'s :class:`ColabEnv`). This runs the install cell of ``notebooks/01_*.py`` -- the cell every
notebook carries, as ``ci/install_cell.py`` generates it -- in that environment's Python with
``google.colab`` standing in (an empty module: the cell acts only where that module is loaded), its
``git+https://...@ref`` pointed at this checkout's HEAD commit (``git+file://``), so pip clones, builds
and installs exactly what a learner's cell would, from here instead of GitHub. Then it checks that
nothing of Colab's changed: every distribution Colab's freeze names still has Colab's version, and
``tpuattn`` imports from the environment's site-packages (not the checkout). It prints what pip
added. Uncommitted changes are not installed (the cell installs a commit); it says so when there are
some. The test command's ``colab`` stage runs this before its notebooks and puzzle checks.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _venv  # noqa: E402
import install_cell  # noqa: E402

ROOT = _venv.ROOT


def head() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def uncommitted() -> bool:
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    return bool(status.strip())


def cell_for_checkout(commit: str) -> str:
    """The install cell of the first notebook, its git URL pointed at ``commit`` of this checkout."""
    notebook = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))[0]
    found = install_cell.CELL.search(notebook.read_text())
    if found is None:
        raise SystemExit(f"{notebook.name}: no install cell (python3 ci/install_cell.py --write)")
    repo, ref = install_cell.source()
    published = f"git+{repo}@{ref}"
    if published not in found.group(0):
        raise SystemExit(f"{notebook.name}: the install cell does not install {published!r}")
    return found.group(0).replace(published, f"git+file://{ROOT}@{commit}")


def main() -> int:
    env = _venv.COLAB.ensure()
    if _venv.colab_mismatches(env):  # an earlier install left something of its own: start again
        shutil.rmtree(env.path)
        env.ensure()
    commit = head()
    if uncommitted():
        print(f"note: installs HEAD ({commit[:12]}); the working tree's uncommitted changes are not in it")
    before = _venv.installed(env)
    # A new commit of the same version: pip would call it already satisfied.
    subprocess.run([str(env.python), "-m", "pip", "uninstall", "--quiet", "--yes", "tpuattn"], cwd=ROOT,
                   check=False, capture_output=True)
    with tempfile.TemporaryDirectory(prefix="tpuattn-colab-") as tmp:
        cell = Path(tmp) / "install_cell.py"
        cell.write_text(cell_for_checkout(commit))
        run = ("import sys, types\n"
               "sys.modules['google.colab'] = types.ModuleType('google.colab')  # standing in for Colab\n"
               f"exec(compile(open({str(cell)!r}).read(), 'install cell', 'exec'))\n")
        result = subprocess.run([str(env.python), "-c", run], cwd=tmp)
    if result.returncode != 0:
        print(f"FAILED: the install cell exited {result.returncode}")
        return 1
    after = _venv.installed(env)
    added = sorted(f"{name} {version}" for name, version in after.items()
                   if name not in before and name != "tpuattn")
    print(f"the install cell added {len(added)} distribution(s) to Colab's: {', '.join(added) or 'none'}")
    problems = [f"changed from Colab's pins: {item}" for item in _venv.colab_mismatches(env)]
    problems += [f"changed by the install: {name} {before[name]} -> {after[name]}"
                 for name in sorted(before) if name != "tpuattn" and after.get(name) != before[name]]
    probe = "import tpuattn; print(tpuattn.__file__, tpuattn.__version__)"
    where = subprocess.run([str(env.python), "-c", probe], cwd=tempfile.gettempdir(),
                           capture_output=True, text=True)
    location = where.stdout.strip()
    if where.returncode != 0 or str(env.path) not in location:
        problems.append(f"tpuattn does not import from {env.name}: {location or where.stderr.strip()}")
    for problem in problems:
        print("FAILED: " + problem)
    if not problems:
        print(f"tpuattn installed from {commit[:12]} through the install cell: {location}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
