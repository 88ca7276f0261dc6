"""environment.yml (conda) and pyproject.toml (pip) name the same dependencies with the same bounds."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pyproject():
    tomllib = pytest.importorskip("tomllib")
    with open(ROOT / "pyproject.toml", "rb") as source:
        return tomllib.load(source)


def _environment():
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((ROOT / "environment.yml").read_text())


def _normalized(requirement: str) -> str:
    return requirement.replace(" ", "").replace('"', "'")


def test_environment_mirrors_pyproject():
    project = _pyproject()["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["dev"]
    pip_section = next(item["pip"] for item in _environment()["dependencies"] if isinstance(item, dict))
    pinned = [line for line in pip_section if not line.startswith("-e")]
    assert sorted(map(_normalized, pinned)) == sorted(map(_normalized, wanted))
    assert "-e .[dev]" in pip_section


def test_python_versions_agree():
    conda_python = [d for d in _environment()["dependencies"] if isinstance(d, str) and d.startswith("python")]
    assert conda_python == ["python" + _pyproject()["project"]["requires-python"]]


def test_makefile_pins_triton_to_the_gpu_machine_minor_version():
    makefile = (ROOT / "Makefile").read_text()
    assert "TRITON_SPEC ?= triton==3.6.*" in makefile and "TORCH_SPEC ?= torch==2.13.0" in makefile
