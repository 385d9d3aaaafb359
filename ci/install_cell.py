"""Each notebook's Colab badge and install cell, written from one place: ``pyproject.toml``.

    python3 ci/install_cell.py          # check: every notebook's badge and install cell as generated
    python3 ci/install_cell.py --write  # rewrite them in the .py twins and carry them into the .ipynb

The repository comes from ``[project.urls] Repository`` and the git ref (a release tag, or ``main``)
from ``[tool.tpuattn] git-ref``: the badge opens the notebook at that ref and the install cell
installs the package at the same ref, so a notebook always runs the code it was written for. The
``pairs`` stage of ``ci/test.py`` runs the check. (Standard library only.)
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
BADGE = re.compile(r"^# \[!\[Open In Colab\]\(.*\)\]\(.*\)$", re.M)
# The install cell: from its "# %%" header to the next cell header.
CELL = re.compile(r"^# %%\n# (?:On Colab, install|Installs the package on Colab).*?(?=^# %%)", re.M | re.S)


def source() -> tuple[str, str]:
    """``(repository URL, git ref)`` from pyproject.toml."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return pyproject["project"]["urls"]["Repository"].rstrip("/"), pyproject["tool"]["tpuattn"]["git-ref"]


def badge(stem: str) -> str:
    repo, ref = source()
    path = repo.removeprefix("https://github.com/")
    return ("# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
            f"(https://colab.research.google.com/github/{path}/blob/{ref}/notebooks/{stem}.ipynb)")


def install_cell() -> str:
    repo, ref = source()
    return f'''# %%
# On Colab, install the package at the version this notebook belongs to ({ref}); elsewhere this does
# nothing. Colab's image has everything else the notebooks import, at versions the package supports,
# so pip adds the package alone. (Written by ci/install_cell.py from pyproject.toml.)
import subprocess
import sys

TPUATTN = "tpuattn @ git+{repo}@{ref}"
if "google.colab" in sys.modules:
    result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", TPUATTN],
                            capture_output=True, text=True)
    print(result.stdout + result.stderr)  # pip's own messages, its errors included
    if result.returncode != 0:
        raise RuntimeError(
            f"pip could not install {{TPUATTN!r}} (exit {{result.returncode}}; its messages are above). "
            "If github.com is not reachable from this runtime, build a wheel from a clone elsewhere "
            "(python -m pip wheel --no-deps .), upload it to the runtime and pip install it.")

'''


def problems(py: Path) -> list[str]:
    text, stem, found = py.read_text(), py.stem, []
    fix = "(python3 ci/install_cell.py --write)"
    if BADGE.findall(text) != [badge(stem)]:
        found.append(f"{py.name}: the Colab badge is not the generated one {fix}")
    if CELL.findall(text) != [install_cell()]:
        found.append(f"{py.name}: the install cell is not the generated one {fix}")
    return found


def write(py: Path) -> bool:
    text = py.read_text()
    new = BADGE.sub(lambda _: badge(py.stem), text, count=1)
    new = CELL.sub(lambda _: install_cell(), new, count=1)
    if new == text:
        return False
    py.write_text(new)
    ipynb = py.with_suffix(".ipynb")
    if ipynb.exists():
        # Carry the new source into the notebook, keeping its outputs (the cell prints nothing off Colab).
        jupytext = ROOT / ".venv" / "bin" / "jupytext"
        subprocess.run([str(jupytext), "--quiet", "--update", "--to", "ipynb", str(py)], cwd=ROOT, check=True)
        subprocess.run([str(jupytext), "--quiet", "--to", "py:percent", str(ipynb)], cwd=ROOT, check=True)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    pys = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))
    if args.write:
        for py in pys:
            print(("rewrote " if write(py) else "unchanged ") + py.name)
    found = [p for py in pys for p in problems(py)]
    print("\n".join(found) or f"{len(pys)} notebooks: badge and install cell as generated")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
