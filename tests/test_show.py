"""fa_lab.show.source: what it prints, that nbval's sanitizer compares the frame, not the code, and that the
listings stored in notebooks are still the package's code."""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from fa_lab.block_info import causal_visible
from fa_lab.show import source

CONFIG = Path(__file__).with_name("nbval_sanitize.cfg")
ROOT = Path(__file__).resolve().parents[1]
LISTING = re.compile(r"(?s)# ([\w./-]+\.py)\n(.*?)\n# \(end of (\w+)\)")
STORED_NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "solutions").glob("*.ipynb"))


def _sanitize(text: str) -> str:
    """What nbval does with the sanitize file: each (regex, replace) pair in order."""
    plugin = pytest.importorskip("nbval.plugin")  # the GPU machine has no nbval
    for regex, replace in plugin.get_sanitize_patterns(CONFIG.read_text()):
        text = re.sub(regex, replace, text)
    return text


def test_source_prints_the_file_the_code_and_an_end_line(capsys):
    source(causal_visible)
    out = capsys.readouterr().out
    assert out.startswith("# fa_lab/block_info.py\ndef causal_visible(")
    assert out.rstrip().endswith("# (end of causal_visible)")


def test_a_jit_function_shows_its_python_source(capsys):
    from fa_lab.kernels import load_triton

    load_triton()
    from fa_lab.kernels.portable.block_range import key_range

    source(key_range)
    out = capsys.readouterr().out
    assert "def key_range(" in out and out.startswith("# fa_lab/kernels/portable/block_range.py\n")


def test_the_sanitizer_replaces_the_code_but_keeps_the_frame(capsys):
    source(causal_visible)
    shown = capsys.readouterr().out
    edited = shown.replace("return", "return  # an edit", 1)
    assert shown != edited and _sanitize(shown) == _sanitize(edited)
    assert _sanitize(shown).startswith("# fa_lab/block_info.py\nSOURCE\n# (end of causal_visible)")
    assert _sanitize(shown.replace("block_info.py", "reference.py")) != _sanitize(shown)


def stale_listings(notebook: Path) -> list[str]:
    """The listings of `source` in a notebook's stored outputs whose code is no longer in the file they name,
    as 'cell N: path (name)'."""
    stale, texts = [], {}  # texts: each named file read once
    for index, cell in enumerate(nbformat.read(notebook, as_version=4).cells):
        for output in cell.get("outputs", []):
            for path, code, name in LISTING.findall(output.get("text", "")):
                if path not in texts:
                    shown = ROOT / path
                    texts[path] = shown.read_text() if shown.is_file() else None
                if texts[path] is None or code not in texts[path]:
                    stale.append(f"cell {index}: {path} ({name})")
    return stale


@pytest.mark.parametrize("notebook", STORED_NOTEBOOKS, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_stored_listings_show_the_current_source(notebook):
    """nbval skips the code inside a listing, so this is what keeps a learner from reading code the package no
    longer has: after an edit to a listed function, re-execute the notebook that prints it."""
    stale = stale_listings(notebook)
    assert not stale, f"re-execute {notebook.relative_to(ROOT)}: {stale}"


def test_a_listing_of_edited_code_is_stale(tmp_path, capsys):
    source(causal_visible)
    shown = capsys.readouterr().out
    for text, stale in ((shown, False), (shown.replace("return", "return  # an edit", 1), True)):
        cell = nbformat.v4.new_code_cell("source(causal_visible)", outputs=[
            nbformat.v4.new_output("stream", name="stdout", text=text)])
        path = tmp_path / "listing.ipynb"
        nbformat.write(nbformat.v4.new_notebook(cells=[cell]), path)
        assert stale_listings(path) == (["cell 0: fa_lab/block_info.py (causal_visible)"] if stale else [])
