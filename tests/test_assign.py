"""Lab generation (fa-lab assign) and working copies (fa-lab start)."""
from __future__ import annotations

import shutil
from pathlib import Path

import nbformat
import pytest

from fa_lab import cli
from fa_lab.grading.assign import AssignError, assign, make_lab, orphan_labs, start, strip_solutions
from fa_lab.grading.registry import UnknownLab, get_lab, lab_ids

ROOT = Path(__file__).resolve().parents[1]


def test_labs_are_generated_from_the_current_solutions():
    stale = assign(ROOT, check=True)
    assert not stale, f"out of date (run fa-lab assign): {[str(p) for p in stale]}"


def test_every_lab_module_has_its_solution_and_lab_notebook():
    for lab_id in lab_ids():
        lab = get_lab(lab_id)
        for folder in ("solutions", "labs"):
            nb = nbformat.read(ROOT / folder / lab.notebook, as_version=4)
            assert nb.metadata["fa_lab"] == {"lab": lab_id}
            assert nb.metadata["kernelspec"]["name"] == "python3"


def test_a_lab_has_no_solution_code_and_no_outputs():
    for lab_id in lab_ids():
        solution = nbformat.read(ROOT / "solutions" / get_lab(lab_id).notebook, as_version=4)
        lab = nbformat.read(ROOT / "labs" / get_lab(lab_id).notebook, as_version=4)
        code = [c for c in lab.cells if c.cell_type == "code"]
        assert all(c.outputs == [] and c.execution_count is None for c in code)
        assert not any("SOLUTION" in c.source for c in code)
        regions = sum(c.source.count("# BEGIN SOLUTION") for c in solution.cells)
        assert sum(c.source.count("raise NotImplementedError") for c in code) == regions > 0
        assert [c.cell_type for c in lab.cells] == [c.cell_type for c in solution.cells]


def test_strip_solutions_keeps_indentation_and_the_hint():
    source = ("def f(x):\n"
              "    y = 1\n"
              "    # BEGIN SOLUTION: add one to x\n"
              "    y = x + 1\n"
              "    # END SOLUTION\n"
              "    return y\n"
              "# BEGIN SOLUTION\n"
              "z = 3\n"
              "# END SOLUTION")
    assert strip_solutions(source) == ("def f(x):\n"
                                       "    y = 1\n"
                                       "    # TODO: add one to x\n"
                                       "    raise NotImplementedError\n"
                                       "    return y\n"
                                       "# TODO: your code here\n"
                                       "raise NotImplementedError")


@pytest.mark.parametrize("source, said", [
    ("# BEGIN SOLUTION\nx = 1", "never closed"),
    ("x = 1\n# END SOLUTION", "without a # BEGIN SOLUTION"),
    ("# BEGIN SOLUTION\n# BEGIN SOLUTION\n# END SOLUTION", "inside the region opened at line 1"),
])
def test_unbalanced_markers_are_refused(source, said):
    with pytest.raises(ValueError, match=said):
        strip_solutions(source)


def test_make_lab_drops_outputs_and_foreign_metadata():
    solution = nbformat.v4.new_notebook()
    solution.metadata.update(kernelspec={"name": "python3"}, fa_lab={"lab": "lab01"}, language_info={"x": 1})
    cell = nbformat.v4.new_code_cell("# BEGIN SOLUTION\nprint(2)\n# END SOLUTION", execution_count=3,
                                     outputs=[nbformat.v4.new_output("stream", text="2\n")],
                                     metadata={"tags": ["nbval-ignore-output"], "scrolled": True})
    solution.cells = [nbformat.v4.new_markdown_cell("# Title"), cell]
    lab = make_lab(solution)
    assert lab.metadata == {"kernelspec": {"name": "python3"}, "fa_lab": {"lab": "lab01"}}
    assert lab.cells[1].outputs == [] and lab.cells[1].execution_count is None
    assert lab.cells[1].metadata == {"tags": ["nbval-ignore-output"]}
    assert lab.cells[1].id == cell.id and lab.cells[0].source == "# Title"


def _course_copy(tmp_path: Path) -> Path:
    for folder in ("solutions", "labs"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    return tmp_path


def test_assign_rewrites_stale_labs_and_removes_orphans_only_when_asked(tmp_path):
    root = _course_copy(tmp_path)
    notebook = get_lab("lab01").notebook
    lab_path = root / "labs" / notebook
    lab_path.write_text(lab_path.read_text().replace("raise NotImplementedError", "pass", 1))
    orphan = root / "labs" / "lab77_gone.ipynb"
    orphan.write_text("{}")
    assert assign(root, check=True) == [lab_path] and orphan_labs(root) == [orphan]
    assert set(assign(root, check=True, prune=True)) == {lab_path, orphan}
    assert assign(root) == [lab_path] and orphan.exists()  # a file in labs/ may be someone's work
    assert lab_path.read_text() == (ROOT / "labs" / notebook).read_text()
    assert assign(root, prune=True) == [orphan]
    assert not orphan.exists() and assign(root, check=True, prune=True) == [] and orphan_labs(root) == []


def test_assign_changes_nothing_without_solutions_or_with_a_broken_one(tmp_path):
    root = _course_copy(tmp_path)
    labs = {p.name: p.read_bytes() for p in (root / "labs").iterdir()}
    shutil.rmtree(root / "solutions")
    with pytest.raises(AssignError, match="no solutions/ folder"):
        assign(root, prune=True)
    assert {p.name: p.read_bytes() for p in (root / "labs").iterdir()} == labs
    root = _course_copy(tmp_path / "second")
    broken = root / "solutions" / get_lab("lab02").notebook
    for text, said in (("", "JSON"), (broken.read_text().replace("# END SOLUTION", "# END SOLUTON", 1),
                                      "never closed")):
        broken.write_text(text)
        with pytest.raises(AssignError, match=said) as caught:
            assign(root)
        assert str(broken) in str(caught.value)
    assert {p.name: p.read_bytes() for p in (root / "labs").iterdir()} == labs


def test_start_copies_a_lab_into_work_and_keeps_the_learners_copy(tmp_path):
    root = _course_copy(tmp_path)
    copy = start("lab01", root)
    assert copy == root / "work" / get_lab("lab01").notebook
    assert copy.read_bytes() == (root / "labs" / copy.name).read_bytes()
    copy.write_text("my work")
    with pytest.raises(FileExistsError, match="--force"):
        start("lab01", root)
    assert copy.read_text() == "my work"
    start("lab01", root, force=True)
    assert copy.read_bytes() == (root / "labs" / copy.name).read_bytes()
    with pytest.raises(UnknownLab, match="lab01"):
        start("lab42", root)


def test_start_refuses_a_folder_where_its_copy_or_work_would_go(tmp_path):
    root = _course_copy(tmp_path)
    (root / "work" / get_lab("lab02").notebook).mkdir(parents=True)
    with pytest.raises(FileExistsError, match="is a folder, not a notebook"):
        start("lab02", root, force=True)
    root = _course_copy(tmp_path / "second")
    (root / "work").write_text("notes")
    with pytest.raises(FileExistsError, match="is a file"):
        start("lab02", root)
    assert (root / "work").read_text() == "notes"


def test_cli_assign_check_passes_on_the_repository(capsys):
    assert cli.main(["assign", "--check"]) == 0
    assert capsys.readouterr().out == ""


def test_cli_start_refuses_an_unknown_lab(capsys):
    assert cli.main(["start", "lab42"]) == 1
    assert "unknown lab 'lab42'" in capsys.readouterr().err
