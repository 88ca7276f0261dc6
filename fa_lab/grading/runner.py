"""Inside the sandbox: run the submission, call each exercise's function, send back what came out.

The grader copies this package's runner, kernel, harness, wire, channel and prelude
modules into a folder of the sandbox as the package ``_fa_lab_grader`` and starts::

    python -m _fa_lab_grader.runner IN_DIR

IN_DIR (read-only) holds ``submission.ipynb``, ``request.json`` (``{"timeout": seconds
per cell, "exercises": [{"function": name, "guard": bool}, ...]}``) and ``cases.pt``
(the arguments of every case, written by the grader with torch.save). The runner
copies the notebook into a fresh working folder, runs it in a kernel
(:class:`~fa_lab.grading.kernel.KernelSession`: a limit per cell, restarts) after the
prelude (:mod:`~fa_lab.grading.prelude`), then has the kernel run
:func:`~fa_lab.grading.harness.serve` for each exercise. It sends on its standard
output, as frames (:mod:`~fa_lab.grading.channel`): ``started`` once the kernel is up
(before any of the notebook's code runs), a ``cell`` frame for each problem
of a notebook cell, an ``exercise`` frame with the reply the kernel wrote (``replied``
false when it wrote none), and ``done``. Its standard output is moved to a private descriptor before the kernel
starts, so that what the notebook prints cannot land on the channel by accident.

The notebook's code runs as the same user and can change all of this: the grader
trusts none of it (it validates the bytes, judges in its own process and bounds
the whole run from outside).
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

import nbformat

from .channel import write_frame
from .kernel import KernelSession

TOOLS = str(Path(__file__).resolve().parents[1])  # the folder that holds _fa_lab_grader
MAX_PROBLEM = 4000  # characters of a cell's problem sent to the grader

_LOAD = """\
import sys
sys.path.insert(0, {tools!r})
try:
    import _fa_lab_grader.{module} as _fa_lab_module
finally:
    sys.path.remove({tools!r})
"""
PRELUDE = _LOAD.format(tools=TOOLS, module="prelude") + """\
_fa_lab_module.block_torch_attention()
del _fa_lab_module
"""
SNIPPET = """\
def _fa_lab_serve():
{load}
    _fa_lab_module.serve(globals(), {cases!r}, {number}, {reply!r}, {guard!r})
_fa_lab_serve()
del _fa_lab_serve
"""


def _private_stdout() -> int:
    """A private (close-on-exec) copy of standard output; standard output itself becomes /dev/null."""
    channel = os.dup(1)
    os.set_inheritable(channel, False)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    sys.stdout = open(1, "w", closefd=False)
    return channel


async def _run(in_dir: Path, channel: int) -> None:
    request = json.loads((in_dir / "request.json").read_text(encoding="utf-8"))
    work = Path(tempfile.mkdtemp(prefix="fa-lab-work-"))
    replies = Path(tempfile.mkdtemp(prefix="fa-lab-replies-"))
    nb = nbformat.read(in_dir / "submission.ipynb", as_version=4)

    def problem(index: int, message: str) -> None:
        write_frame(channel, {"type": "cell", "index": index, "problem": message[:MAX_PROBLEM]})

    async with KernelSession(nb, str(work), float(request["timeout"]), prelude=PRELUDE,
                             on_problem=problem) as session:
        write_frame(channel, {"type": "started"})
        await session.run_notebook()
        for number, exercise in enumerate(request["exercises"]):
            reply = replies / f"{number}.bin"
            load = "\n".join("    " + line for line in _LOAD.format(tools=TOOLS, module="harness").splitlines())
            run = await session.run_snippet(SNIPPET.format(load=load, cases=str(in_dir / "cases.pt"),
                                                           number=number, reply=str(reply),
                                                           guard=bool(exercise["guard"])))
            header = {"type": "exercise", "number": number, "error": run.error, "timed_out": run.timed_out,
                      "replied": reply.is_file()}
            if header["replied"]:
                with reply.open("rb") as stream:
                    write_frame(channel, header, stream)
                reply.unlink()
            else:
                write_frame(channel, header)
    write_frame(channel, {"type": "done"})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    channel = _private_stdout()
    asyncio.run(_run(Path(argv[0]), channel))
    return 0


if __name__ == "__main__":
    sys.exit(main())
