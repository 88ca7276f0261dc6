"""environment.yml (conda) and pyproject.toml (pip) name the same dependencies with the same bounds, the Makefile
pins what the GPU machine runs, and the CPU track (chapters 00-02) needs no Triton."""
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


CPU_TRACK = sorted(ROOT.glob("notebooks/0[0-2]_*.ipynb")) + sorted(ROOT.glob("solutions/lab0[0-2]_*.ipynb"))
WITHOUT_TRITON = r'''
import ast, importlib, json, sys

class NoTriton:  # as on macOS or Windows, where Triton publishes no wheel
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "triton":
            raise ModuleNotFoundError(f"No module named {name!r}")

sys.meta_path.insert(0, NoTriton())
from IPython.core.inputtransformer2 import TransformerManager

notebooks, tests = json.loads(sys.argv[1]), sys.argv[2]
for path in notebooks:  # every import the CPU track's notebooks and solutions make
    for cell in json.load(open(path))["cells"]:
        if cell["cell_type"] == "code":
            tree = ast.parse(TransformerManager().transform_cell("".join(cell["source"])))
            for node in ast.walk(tree):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    exec(compile(ast.Module([node], []), path, "exec"), {})
import torch, fa_lab
q, k, v = (torch.randn(1, 2, 37, 16, requires_grad=True) for _ in range(3))
for impl in ("naive", "torch"):
    fa_lab.attention(q, k, v, causal=True, impl=impl).sum().backward()
try:
    fa_lab.attention(q.half(), k.half(), v.half(), impl="triton")
    raise SystemExit("impl='triton' ran without Triton")
except ImportError as error:
    assert "Linux wheels only" in str(error), error
sys.path.insert(0, tests)
for lab in ("lab00", "lab01", "lab02"):  # the labs' checks accept their solutions on the public cases
    checks = importlib.import_module(f"test_{lab}_checks").LAB
    for name in checks.exercise_names:
        checks.assert_solution_passes(name, seeds=())
assert not [name for name in sys.modules if name.split(".")[0] == "triton"]
print("the CPU track ran without triton")
'''


def test_the_cpu_track_runs_without_triton():
    """Chapters 00-02 and their labs promise a machine without Triton (macOS, Windows): with Triton's import
    refused, every import of their notebooks and solutions works, attention's torch and naive impls run forward
    and backward, impl="triton" says why it cannot, and the labs' checks accept the solutions."""
    import json
    import subprocess
    import sys

    assert len(CPU_TRACK) == 6, [path.name for path in CPU_TRACK]
    done = subprocess.run([sys.executable, "-c", WITHOUT_TRITON, json.dumps([str(p) for p in CPU_TRACK]),
                           str(ROOT / "tests")], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the CPU track ran without triton" in done.stdout
