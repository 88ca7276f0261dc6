"""fa_lab.show.source: what it prints, and that nbval's sanitizer compares the frame, not the code."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from fa_lab.block_info import causal_visible
from fa_lab.show import source

CONFIG = Path(__file__).with_name("nbval_sanitize.cfg")


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
