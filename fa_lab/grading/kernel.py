"""Run a notebook in a fresh kernel with a time limit per cell, surviving what the code does.

:class:`KernelSession` executes a notebook's code cells with nbclient (errors
allowed), then runs the grader's snippets in the same kernel. A cell that runs
past its limit is interrupted; if the kernel does not answer after that (the code
ignores SIGINT, or is stuck in C), or if it died, the kernel is restarted and the
notebook's cells are run again, skipping every cell that hung or killed it.

While grading, this runs inside the sandbox (:mod:`fa_lab.grading.runner`); the
grader's own limit on the whole notebook, restarts included, is enforced from
outside (:mod:`fa_lab.grading.sandbox`).
"""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Callable

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError

PROBE_TIMEOUT = 10  # seconds an interrupted kernel gets to answer before it is restarted


@dataclass(frozen=True)
class CellRun:
    """How a cell ended: ``error`` ("ZeroDivisionError: ..." or a timeout message) or None."""

    error: str | None = None
    timed_out: bool = False


def _stop_stale_output_readers() -> None:
    """nbclient leaves a timed-out cell's output reader running; it would swallow the next cell's
    messages (it reads the kernel's output channel and drops what is not its own)."""
    for task in asyncio.all_tasks():
        if task is not asyncio.current_task() and task.get_coro().__name__ == "_async_poll_output_msg":
            task.cancel()


class _KernelLost(Exception):
    """The kernel died, or did not answer after an interrupt: it must be restarted."""

    def __init__(self, message: str, timed_out: bool):
        super().__init__(message)
        self.timed_out = timed_out


class KernelSession:
    """One notebook in one kernel. Use as ``async with KernelSession(...) as session``.

    nb: the notebook (a copy; the session appends and removes snippet cells).
    workdir: the kernel's working directory. timeout: seconds per cell.
    prelude: code run in each new kernel before the notebook (after every restart too).
    on_problem(index, message): called each time a cell goes wrong (it raised, timed out, or killed the kernel).
    """

    def __init__(self, nb, workdir: str, timeout: float,
                 prelude: str | None = None, on_problem: Callable[[int, str], None] | None = None):
        self.nb = nb
        self.prelude = prelude
        self.on_problem = on_problem
        self.timeout = timeout
        self.workdir = workdir
        self.client = NotebookClient(nb, timeout=timeout, allow_errors=True, kernel_name="python3",
                                     interrupt_on_timeout=False, record_timing=False,
                                     resources={"metadata": {"path": workdir}})
        self.notebook_cells = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
        self._skip: set[int] = set()  # cells that hung or killed the kernel: not run again

    async def __aenter__(self) -> "KernelSession":
        await self._start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self._stop()

    async def _start(self) -> None:
        self.client.km = self.client.create_kernel_manager()
        await self.client.async_start_new_kernel(env=dict(os.environ), cwd=self.workdir)
        await self.client.async_start_new_kernel_client()
        if self.prelude:  # it must run, or the kernel would grade without what it sets up
            cell = await self._run_source(self.prelude, self.timeout)
            errors = [o for o in cell.outputs if o.output_type == "error"]
            if errors:
                raise RuntimeError(f"the grading kernel's prelude failed: {errors[0].ename}: {errors[0].evalue}")

    def _problem(self, index: int, message: str) -> None:
        if self.on_problem:
            self.on_problem(index, message)

    async def _stop(self) -> None:
        _stop_stale_output_readers()
        client = self.client
        if client.kc is not None:
            client.kc.stop_channels()
            client.kc = None
        if client.km is not None:
            if await client.km.is_alive():
                await client.km.shutdown_kernel(now=True)
            await client.km.cleanup_resources()
            client.km = None

    async def _run_cell(self, index: int, timeout: float):
        self.client.timeout = timeout
        return await self.client.async_execute_cell(self.nb.cells[index], index)

    async def _execute(self, index: int) -> CellRun:
        """Run cell ``index``; raises _KernelLost when the kernel must be restarted."""
        try:
            cell = await self._run_cell(index, self.timeout)
        except CellTimeoutError:
            _stop_stale_output_readers()
            if await self._answers_after_interrupt():
                return CellRun(f"timed out after {self.timeout:g} s and was interrupted", timed_out=True)
            raise _KernelLost(f"timed out after {self.timeout:g} s and did not stop when interrupted; "
                              "the kernel was restarted", timed_out=True) from None
        except DeadKernelError:
            raise _KernelLost("the kernel died while running it; it was restarted", timed_out=False) from None
        errors = [o for o in cell.outputs if o.output_type == "error"]
        return CellRun(f"{errors[0].ename}: {errors[0].evalue}" if errors else None)

    async def _run_source(self, source: str, timeout: float):
        """Run code that is not one of the notebook's cells (appended, then removed again)."""
        self.nb.cells.append(nbformat.v4.new_code_cell(source))
        try:
            return await self._run_cell(len(self.nb.cells) - 1, timeout)
        finally:
            self.nb.cells.pop()

    async def _answers_after_interrupt(self) -> bool:
        await self.client.km.interrupt_kernel()
        try:
            await self._run_source("pass", min(PROBE_TIMEOUT, self.timeout))
            return True
        except (CellTimeoutError, DeadKernelError):
            return False

    async def _restart(self) -> None:
        await self._stop()
        await self._start()

    async def run_notebook(self) -> None:
        """Run every code cell (except those that hung or killed the kernel before), in order."""
        while True:
            try:
                for index in self.notebook_cells:
                    if index in self._skip:
                        continue
                    run = await self._execute(index)
                    if run.error:
                        self._problem(index, run.error)
                    if run.timed_out:
                        self._skip.add(index)
                return
            except _KernelLost as lost:
                self._problem(index, str(lost))
                self._skip.add(index)
                await self._restart()

    async def run_snippet(self, source: str) -> CellRun:
        """Run grader code in the notebook's kernel. If the kernel must be restarted, the notebook
        runs again first, so that the next snippet finds the learner's definitions."""
        self.nb.cells.append(nbformat.v4.new_code_cell(source))
        try:
            return await self._execute(len(self.nb.cells) - 1)
        except _KernelLost as lost:
            outcome = CellRun(str(lost), lost.timed_out)
        finally:
            self.nb.cells.pop()
        await self._restart()
        await self.run_notebook()
        return outcome
