"""Run notebooks' code cells as scripts, for the GPU machine, which has no Jupyter: on a CUDA GPU, notebooks 02-04
take their live branches (03 and 04 run every cell on the GPU), which CI, with CUDA hidden, never runs.

Usage: python3 benchmarks/notebook_as_script.py OUTDIR NOTEBOOK...

Each notebook runs in a process of its own, its code cells in order in one namespace, as a kernel would run them:
IPython magics dropped, each cell's source readable by ``inspect`` (as ``@triton.jit`` needs), a cell's last
expression shown, ``IPython.display.display`` stood in for (figures saved as OUTDIR/<notebook>_cell<N>_<k>.png,
anything else printed), matplotlib on its Agg back end. A notebook stops at its first cell that raises, and the
log names that cell. Prints one line a cell with its seconds; exits 1 if any notebook failed.
"""
from __future__ import annotations

import ast
import json
import linecache
import os
import subprocess
import sys
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def without_magics(source: str) -> str:
    """A cell's source without its IPython magics and shell escapes (lines starting with % or !)."""
    return "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))


def code_cells(notebook: Path) -> list[tuple[int, str]]:
    """(index among all cells, source without magics) of each code cell."""
    cells = json.loads(notebook.read_text())["cells"]
    return [(i, without_magics("".join(c["source"]))) for i, c in enumerate(cells) if c["cell_type"] == "code"]


def _stand_in_display(out: Path, stem: str, cell: list[int]):
    """Install a stand-in for IPython.display whose display() saves figures under ``out`` and prints the rest;
    return that display()."""
    import matplotlib.figure

    count = [0]

    def display(*objects, **_):
        for obj in objects:
            if isinstance(obj, matplotlib.figure.Figure):
                count[0] += 1
                obj.savefig(out / f"{stem}_cell{cell[0]}_{count[0]}.png", dpi=60)
            else:
                print(repr(obj))

    ipython, shown = types.ModuleType("IPython"), types.ModuleType("IPython.display")
    shown.display = display
    ipython.display, ipython.get_ipython = shown, lambda: None  # matplotlib asks for a shell: there is none
    ipython.version_info = (9, 0)  # and for the version, to choose its hooks
    sys.modules.update({"IPython": ipython, "IPython.display": shown})
    return display


def run_notebook(notebook: Path, out: Path) -> int:
    """Run one notebook's cells in this process; 0 if every cell ran."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    os.chdir(notebook.parent)  # as Jupyter starts a notebook's kernel
    sys.path.insert(0, str(ROOT))
    cell = [0]
    display = _stand_in_display(out, notebook.stem, cell)
    namespace = {"__name__": "__main__"}
    for index, source in code_cells(notebook):
        cell[0] = index
        start = time.perf_counter()
        try:
            # The cell's source is registered under a file name, as IPython does, so that inspect (and so
            # @triton.jit, which reads a kernel's source) finds it.
            filename = str(out / f"{notebook.stem}_cell{index}.py")
            linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
            tree = ast.parse(source)
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            exec(compile(tree, filename, "exec"), namespace)
            if last is not None:
                value = eval(compile(ast.Expression(last.value), filename, "eval"), namespace)
                if value is not None:
                    display(value)
        except BaseException:
            traceback.print_exc()
            print(f"{notebook.name}: cell {index} FAILED after {time.perf_counter() - start:.1f} s", flush=True)
            return 1
        print(f"{notebook.name}: cell {index} ran in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "--one":
        return run_notebook(Path(argv[1]).resolve(), Path(argv[2]).resolve())
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for notebook in argv[1:]:
        done = subprocess.run([sys.executable, __file__, "--one", notebook, str(out)])
        if done.returncode:
            failed.append(notebook)
    print("every notebook ran" if not failed else f"failed: {' '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
