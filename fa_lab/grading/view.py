"""The package a graded notebook sees: fa_lab without what its lab asks the learner to write.

For a lab, a top-level function or class of fa_lab is *hidden* when every exercise
of the lab forbids calling it (the course-wide lists of :mod:`~fa_lab.grading.harness`
plus the exercise's own ``forbidden``), no exercise allows it, and nothing that an
exercise allows uses it (followed through each module's imports, transitively:
``allowed`` lets a reference through with everything it calls).

:func:`write_view` copies the package into a folder that the sandbox mounts in
place of the real one (:mod:`fa_lab.grading.sandbox`):

* each hidden definition becomes a placeholder that raises ``HiddenWhileGrading``
  when used (:mod:`~fa_lab.grading.graded_view`), so that a notebook's imports still
  work, and the answer's code is not in the sandbox at all;
* ``fa_lab/grading`` is replaced by ``graded_view.py`` alone: no checks, cases,
  judges, hidden-case generators or solutions;
* no bytecode is copied; a module with hidden definitions is rewritten from its
  syntax tree (so without its comments), the others are copied as they are.

A name that one exercise forbids but another allows (in lab 04, the float64
reference and ``flash_forward``) stays visible; :attr:`View.unguarded` lists
them per exercise, and the grader keeps the in-process call guard on for those
exercises (a friendly check, not a guarantee).
"""
from __future__ import annotations

import ast
import shutil
from dataclasses import dataclass
from pathlib import Path

from .harness import ALLOWED_MODULES, FORBIDDEN_FUNCTIONS, FORBIDDEN_MODULES, listed
from .registry import Exercise, Lab

PACKAGE = "fa_lab"
GRADING = "grading"  # the subpackage that the view replaces
_PLACEHOLDER = "_fa_lab_hidden"
_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


@dataclass(frozen=True)
class View:
    """What a lab's view hides (qualified names, sorted), and per exercise the names it forbids
    that stay visible because another exercise of the lab allows them."""

    hidden: tuple[str, ...]
    unguarded: dict[str, tuple[str, ...]]


@dataclass
class _Module:
    name: str  # dotted: "fa_lab.kernels.portable.forward"
    path: Path
    tree: ast.Module
    package: str  # what a relative import starts from
    definitions: dict[str, ast.stmt]  # top-level name -> its def, class or lambda assignment


def _modules(package_dir: Path) -> dict[str, _Module]:
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir).with_suffix("").parts
        if parts[0] == GRADING or "__pycache__" in parts:
            continue
        is_package = parts[-1] == "__init__"
        dotted = ".".join((PACKAGE, *(parts[:-1] if is_package else parts)))
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        package = dotted if is_package else dotted.rpartition(".")[0]
        modules[dotted] = _Module(dotted, path, tree, package, _definitions(tree))
    return modules


def _definitions(tree: ast.Module) -> dict[str, ast.stmt]:
    found = {}
    for node in tree.body:
        if isinstance(node, _DEFINITIONS):
            found[node.name] = node
        elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Lambda) and len(node.targets) == 1
              and isinstance(node.targets[0], ast.Name)):
            found[node.targets[0].id] = node
    return found


def _imports(node: ast.AST, module: _Module) -> dict[str, str]:
    """Local name -> dotted target, for every import statement within ``node``."""
    names = {}
    for statement in ast.walk(node):
        if isinstance(statement, ast.Import):
            for alias in statement.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    names[top] = top
        elif isinstance(statement, ast.ImportFrom):
            base = statement.module or ""
            if statement.level:
                anchor = module.package.split(".")
                anchor = anchor[:len(anchor) - statement.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in statement.names:
                names[alias.asname or alias.name] = f"{base}.{alias.name}"
    return names


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else None
    return None


class _Index:
    """Every definition of the package and what each one refers to."""

    def __init__(self, modules: dict[str, _Module]):
        self.modules = modules
        self.definitions = {f"{m.name}.{name}": (m, node) for m in modules.values()
                            for name, node in m.definitions.items()}
        self._module_imports = {m.name: _imports(ast.Module(
            body=[n for n in m.tree.body if isinstance(n, (ast.Import, ast.ImportFrom))], type_ignores=[]), m)
            for m in modules.values()}

    def references(self, qualified: str) -> set[str]:
        """The package's definitions that ``qualified``'s code names."""
        module, node = self.definitions[qualified]
        local = {**self._module_imports[module.name], **_imports(node, module)}
        found = set()
        for sub in ast.walk(node):
            dotted = _dotted(sub) if isinstance(sub, (ast.Name, ast.Attribute)) else None
            if dotted is None:
                continue
            head, _, rest = dotted.partition(".")
            if head in module.definitions:
                target = f"{module.name}.{head}"
            elif head in local:
                target = local[head] + (f".{rest}" if rest else "")
            else:
                continue
            target = self._definition_in(target)
            if target and target != qualified:
                found.add(target)
        return found

    def _definition_in(self, dotted: str) -> str | None:
        """The definition that ``dotted`` ("fa_lab.x.y.attr") names or starts with, if any."""
        parts = dotted.split(".")
        for end in range(len(parts), 1, -1):
            candidate = ".".join(parts[:end])
            if candidate in self.definitions:
                return candidate
            if candidate in self.modules:
                return None
        return None


def _forbidden(qualified: str, exercise: Exercise) -> bool:
    module, _, name = qualified.rpartition(".")
    course_wide = ((module.startswith(FORBIDDEN_MODULES) and not module.startswith(ALLOWED_MODULES))
                   or (module, name) in FORBIDDEN_FUNCTIONS)
    return course_wide or listed(qualified, exercise.forbidden)


def _plan(lab: Lab, index: _Index) -> View:
    allowed = [d for d in index.definitions if any(listed(d, e.allowed) for e in lab.exercises)]
    visible, todo = set(allowed), list(allowed)
    while todo:  # what the allowed names use stays, with what that uses in turn
        for target in index.references(todo.pop()) - visible:
            visible.add(target)
            todo.append(target)
    hidden = {d for d in index.definitions
              if d not in visible and all(_forbidden(d, e) for e in lab.exercises)}
    unguarded = {e.name: tuple(sorted(d for d in index.definitions
                                      if d not in hidden and _forbidden(d, e) and not listed(d, e.allowed)))
                 for e in lab.exercises}
    return View(tuple(sorted(hidden)), unguarded)


def plan_view(lab: Lab, package_dir: Path) -> View:
    """What the view of ``lab`` hides, without writing it."""
    return _plan(lab, _Index(_modules(Path(package_dir))))


def _rewritten(module: _Module, hidden: set[str]) -> str:
    body, future = [], 0
    for node in module.tree.body:
        name = next((n for n, d in module.definitions.items() if d is node), None)
        if name and f"{module.name}.{name}" in hidden:
            call = ast.Call(ast.Name(_PLACEHOLDER, ast.Load()), [ast.Constant(f"{module.name}.{name}")], [])
            node = ast.Assign([ast.Name(name, ast.Store())], call, lineno=0)
        body.append(node)
    for position, node in enumerate(body):  # after the docstring and the __future__ imports
        if (isinstance(node, ast.ImportFrom) and node.module == "__future__") or (
                position == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            future = position + 1
    body.insert(future, ast.ImportFrom(f"{PACKAGE}.{GRADING}", [ast.alias("hidden", _PLACEHOLDER)], 0))
    return ast.unparse(ast.fix_missing_locations(ast.Module(body=body, type_ignores=[]))) + "\n"


def write_view(lab: Lab, package_dir, target) -> View:
    """Write the view of ``lab`` of the package at ``package_dir`` into the folder ``target``
    (created; it becomes the package's directory in the sandbox). Returns what it hides."""
    package_dir, target = Path(package_dir), Path(target)
    index = _Index(_modules(package_dir))
    view = _plan(lab, index)
    hidden = set(view.hidden)
    rewritten = {m.path: m for m in index.modules.values()
                 if any(f"{m.name}.{name}" in hidden for name in m.definitions)}
    for source in sorted(package_dir.rglob("*")):
        relative = source.relative_to(package_dir)
        if relative.parts[0] == GRADING or "__pycache__" in relative.parts or source.suffix == ".pyc":
            continue
        destination = target / relative
        if source.is_dir():
            destination.mkdir(parents=True, exist_ok=True)
        elif source in rewritten:
            destination.parent.mkdir(parents=True, exist_ok=True)
            destination.write_text(_rewritten(rewritten[source], hidden), encoding="utf-8")
        elif source.is_file():
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, destination)
    (target / GRADING).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(__file__).with_name("graded_view.py"), target / GRADING / "__init__.py")
    return view
