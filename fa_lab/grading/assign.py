"""``fa-lab assign`` and ``fa-lab start``: labs/ from solutions/, and a learner's working copy.

A solution notebook is the single source of truth. In its code cells, every
region between a ``# BEGIN SOLUTION`` line and a ``# END SOLUTION`` line becomes
``# TODO: ...`` and ``raise NotImplementedError`` at the indentation of the
BEGIN line (text after the marker, e.g. ``# BEGIN SOLUTION: fold each block
into (m, l)``, becomes the TODO's text). Outputs, execution counts and all
metadata except the kernelspec, the lab id and cell tags are dropped, so a lab
only changes when its solution's source does.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import nbformat

from .registry import get_lab


class AssignError(ValueError):
    """labs/ cannot be generated: solutions/ is missing, or a solution notebook cannot be read or stripped
    (the message names the notebook and, where it applies, the cell and line)."""


BEGIN = "# BEGIN SOLUTION"
END = "# END SOLUTION"
DEFAULT_TODO = "your code here"


def repo_root() -> Path:
    """The folder that holds fa_lab/, solutions/ and labs/ (fa_lab installed from a clone)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "labs").is_dir() and not (root / "solutions").is_dir():
        raise FileNotFoundError(f"no labs/ or solutions/ next to the fa_lab package in {root}: run this "
                                "from a clone of the course (pip install -e .)")
    return root


def strip_solutions(source: str) -> str:
    """The cell source with every solution region replaced by a TODO and ``raise NotImplementedError``."""
    lines, inside = [], None
    for number, line in enumerate(source.split("\n"), start=1):
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            if inside is not None:
                raise ValueError(f"line {number}: {BEGIN} inside the region opened at line {inside}")
            inside = number
            indent = line[:len(line) - len(line.lstrip())]
            todo = stripped[len(BEGIN):].lstrip(" :-") or DEFAULT_TODO
            lines += [f"{indent}# TODO: {todo}", f"{indent}raise NotImplementedError"]
        elif stripped.startswith(END):
            if inside is None:
                raise ValueError(f"line {number}: {END} without a {BEGIN}")
            inside = None
        elif inside is None:
            lines.append(line)
    if inside is not None:
        raise ValueError(f"line {inside}: {BEGIN} is never closed by {END}")
    return "\n".join(lines)


def make_lab(solution):
    """The lab notebook generated from a solution notebook (both nbformat v4 nodes)."""
    lab = nbformat.v4.new_notebook()
    lab.metadata = {key: solution.metadata[key] for key in ("kernelspec", "fa_lab")
                    if key in solution.metadata}
    for index, cell in enumerate(solution.cells):
        kept = {"tags": cell.metadata["tags"]} if cell.metadata.get("tags") else {}
        if cell.cell_type == "code":
            try:
                source = strip_solutions(cell.source)
            except ValueError as exc:
                raise ValueError(f"cell {index + 1}: {exc}") from None
            new = nbformat.v4.new_code_cell(source, metadata=kept)
        elif cell.cell_type == "markdown":
            new = nbformat.v4.new_markdown_cell(cell.source, metadata=kept)
        else:
            new = nbformat.v4.new_raw_cell(cell.source, metadata=kept)
        new.id = cell.get("id", new.id)
        lab.cells.append(new)
    return lab


def _lab_text(solution_path: Path) -> str:
    try:
        solution = nbformat.read(solution_path, as_version=4)
        if not isinstance(solution.metadata.get("fa_lab"), dict):
            raise ValueError('no {"fa_lab": {"lab": ...}} in the notebook metadata')
        return nbformat.writes(make_lab(solution)) + "\n"
    except Exception as exc:  # not JSON, not a notebook, no lab id, unbalanced markers
        raise AssignError(f"{solution_path}: {exc}") from None


def _solutions(root: Path) -> list[Path]:
    folder = root / "solutions"
    if not folder.is_dir():
        raise AssignError(f"no solutions/ folder in {root}: labs/ is generated from it, so nothing was changed")
    return sorted(folder.glob("lab*.ipynb"))


def orphan_labs(root=None) -> list[Path]:
    """The labs/lab*.ipynb that have no solution notebook of the same name."""
    root = Path(root) if root else repo_root()
    names = {p.name for p in _solutions(root)}
    return [p for p in sorted((root / "labs").glob("lab*.ipynb")) if p.name not in names]


def assign(root=None, check: bool = False, prune: bool = False) -> list[Path]:
    """Write labs/labNN_*.ipynb from solutions/labNN_*.ipynb; with ``prune``, also remove the labs that have no
    solution (:func:`orphan_labs`; without it they stay, since a file in labs/ may be someone's work).

    With ``check``, change nothing. Returns the labs that were out of date (written or removed, or to be with
    ``check``). Every solution is read and stripped before anything is written: a broken one raises
    :class:`AssignError` with labs/ untouched.
    """
    root = Path(root) if root else repo_root()
    labs_dir = root / "labs"
    texts = {solution_path.name: _lab_text(solution_path) for solution_path in _solutions(root)}
    stale = []
    for name, text in texts.items():
        lab_path = labs_dir / name
        if not lab_path.exists() or lab_path.read_text(encoding="utf-8") != text:
            stale.append(lab_path)
            if not check:
                labs_dir.mkdir(exist_ok=True)
                lab_path.write_text(text, encoding="utf-8")
    if prune:
        for orphan in orphan_labs(root):
            stale.append(orphan)
            if not check:
                orphan.unlink()
    return stale


def start(lab_id: str, root=None, force: bool = False) -> Path:
    """Copy labs/<lab's notebook> into work/ (git-ignored) and return the copy's path.

    Refuses to overwrite an existing copy (the learner's work) unless ``force``.
    """
    lab = get_lab(lab_id)
    root = Path(root) if root else repo_root()
    source = root / "labs" / lab.notebook
    if not source.exists():
        raise FileNotFoundError(f"{source} does not exist; run fa-lab assign first")
    target = root / "work" / lab.notebook
    if target.parent.exists() and not target.parent.is_dir():
        raise FileExistsError(f"{target.parent} is a file; the labs are copied into a folder of that name: "
                              "move the file away")
    if target.is_dir():
        raise FileExistsError(f"{target} is a folder, not a notebook: move it away")
    if target.exists() and not force:
        raise FileExistsError(f"{target} already exists and holds your work; open it, or pass --force "
                              "to replace it with a fresh copy of the lab")
    target.parent.mkdir(exist_ok=True)
    shutil.copyfile(source, target)
    return target
