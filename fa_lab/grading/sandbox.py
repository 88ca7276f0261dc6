"""Run the grading runner in a bubblewrap sandbox, bounded and watched from outside.

The sandbox (`bubblewrap <https://github.com/containers/bubblewrap>`_, ``bwrap``):

* its own user, PID, mount, network (loopback only), IPC, UTS and cgroup namespaces,
  no capabilities, no nested user namespaces, a new session, and SIGKILL when the
  grader dies (``--unshare-all --unshare-user --disable-userns --cap-drop ALL
  --new-session --die-with-parent``);
* run by root, the grader first gives the sandbox a fresh unprivileged uid of its own
  (``setpriv``; the sources of the bind mounts are first bound, in a private mount
  namespace, where that uid can reach them), so it owns nothing on the host;
* a read-only root with read-only bind mounts only: /usr (and /bin, /lib... as the host has them), a few
  files of /etc, the Python installation and virtual environment, the lab's view of
  the package (:mod:`~fa_lab.grading.view`) over every copy of fa_lab on the path,
  the runner's tools and the inputs; a private /tmp (a tmpfs of bounded size), a
  /proc of its own PID namespace and a minimal /dev;
* a small environment (:func:`sandbox_env`), and limits per process applied by
  ``prlimit`` before the runner starts: address space, processes (counted in the
  sandbox's own user namespace), file size, CPU time, no core dumps.

From outside, the grader gives the whole run one wall-clock budget, reads the
channel within limits (:class:`~fa_lab.grading.channel.FrameReader`), then kills
the sandbox's init (PID 1 of its namespace) and waits until it is gone: the kernel
has then killed every process of that PID namespace, setsid'd and stopped ones
included. As root it also checks that no process of the sandbox's uid is left.
Nothing in the sandbox can signal the grader: it is outside the PID namespace.

``sandboxed=False`` (``fa-lab grade --no-sandbox``) runs the same command as a plain
child process in its own session, with the same budget and limits; see
:data:`NO_SANDBOX_WARNING` for what that gives up.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .channel import ChannelBroken, Frame, FrameReader

SANDBOX_UID = 1000  # the user inside the sandbox
ROOT_UIDS = (2_000_000_000, 2_100_000_000)  # as root: the host uid of a sandbox is drawn from here
STDERR_TAIL = 16 * 1024
TEARDOWN_TIMEOUT = 30.0
NO_SANDBOX_WARNING = (
    "grading without a sandbox (--no-sandbox): each notebook runs as you, with your files, network "
    "and processes. It can read the answers and the hidden cases' seed, change the course, the "
    "installed package and other submissions, and leave processes behind; only the time budget and "
    "the per-process limits (on Linux) still hold. Grade only notebooks you trust this way.")
INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install "
                "bubblewrap; `make setup` does it as root), or pass --no-sandbox (see fa-lab grade --help)")


class SandboxUnavailable(RuntimeError):
    """This machine cannot run the sandbox (bwrap missing, user namespaces disabled, ...)."""


@dataclass(frozen=True)
class Limits:
    """budget: wall-clock seconds for the whole run. memory: bytes of address space per process.
    processes: processes and threads of the sandbox. file_size: bytes per file written.
    tmp_size: bytes of the sandbox's /tmp. cpu: CPU seconds per process (default: twice the budget)."""

    budget: float = 900.0
    memory: int = 8 << 30
    processes: int = 512
    file_size: int = 512 << 20
    tmp_size: int = 1 << 30
    cpu: int | None = None

    def prlimit(self, processes: bool) -> list[str]:
        cpu = self.cpu or int(2 * self.budget) + 10
        args = ["prlimit", f"--as={self.memory}", f"--fsize={self.file_size}", f"--cpu={cpu}", "--core=0"]
        return args + ([f"--nproc={self.processes}"] if processes else []) + ["--"]


@dataclass
class Outcome:
    """What came out: the frames read, whether the budget ran out, why reading stopped early
    (``broken``), the exit status of the sandbox's outer process and the tail of its stderr."""

    frames: list[Frame] = field(default_factory=list)
    budget_exceeded: bool = False
    broken: str | None = None
    exit_status: int | None = None
    stderr: str = ""


def _system_binds() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for name in ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime"):
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    return args


_NAMESPACES = ["--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
               "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--cap-drop", "ALL", "--hostname", "grading"]


def python_trees() -> list[str]:
    """The folders that this Python needs (its installation and its virtual environment), outside /usr."""
    trees = sorted({sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                    str(Path(os.path.realpath(sys.executable)).parents[1])})
    return [t for t in trees if not any(t != o and t.startswith(o.rstrip("/") + "/") for o in trees)
            and not (t == "/usr" or t.startswith("/usr/"))]


def sandbox_env(extra: dict[str, str]) -> dict[str, str]:
    """The whole environment inside the sandbox: nothing of the grader's own."""
    return {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": "/tmp/home", "USER": "learner",
            "LOGNAME": "learner", "LANG": "C.UTF-8", "TMPDIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONNOUSERSITE": "1", "MALLOC_ARENA_MAX": "4", **extra}


def _as_root() -> bool:
    return os.geteuid() == 0


@functools.cache
def unavailable_reason() -> str | None:
    """None when the sandbox works on this machine, else why not (and what to do)."""
    if shutil.which("bwrap") is None:
        return f"bubblewrap (bwrap) is not installed: {INSTALL_HINT}"
    if not hasattr(os, "pidfd_open"):
        return "the sandbox needs Linux 5.3 or later (pidfd_open): pass --no-sandbox or upgrade"
    wrapper = []
    if _as_root():
        missing = [tool for tool in ("setpriv", "unshare", "mount", "prlimit") if shutil.which(tool) is None]
        if missing:
            return f"running as root, the sandbox needs util-linux's {', '.join(missing)}"
        uid = ROOT_UIDS[0] - 1
        wrapper = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    command = [*wrapper, "bwrap", *_NAMESPACES, *_system_binds(), "--proc", "/proc", "--dev", "/dev", "true"]
    try:
        probe = subprocess.run(command, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap could not be run: {exc}"
    if probe.returncode != 0:
        return (f"bwrap fails on this machine ({probe.stderr.strip()[:300] or f'exit {probe.returncode}'}); "
                "unprivileged user namespaces may be disabled (sysctl kernel.unprivileged_userns_clone or "
                "user.max_user_namespaces), or pass --no-sandbox")
    return None


def _free_uid() -> int:
    used = {_owner(pid) for pid in _pids()}
    while True:
        uid = random.randrange(*ROOT_UIDS)
        if uid not in used:
            return uid


def _pids() -> list[str]:
    return [name for name in os.listdir("/proc") if name.isdigit()]


def _owner(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def _alive_of(uid: int) -> list[int]:
    """The processes (not zombies) whose /proc entry belongs to ``uid``."""
    alive = []
    for pid in _pids():
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            alive.append(int(pid))
    return alive


@dataclass
class _Fds:
    """Descriptors the sandbox's outer process inherits, and those the grader keeps."""

    passed: list[int] = field(default_factory=list)

    def data(self, content: bytes) -> int:
        read, write = os.pipe()
        os.write(write, content)  # small: fits in the pipe's buffer
        os.close(write)
        self.passed.append(read)
        return read

    def pipe(self) -> tuple[int, int]:
        read, write = os.pipe()
        self.passed.append(write)
        return read, write

    def close(self) -> None:
        for fd in self.passed:
            os.close(fd)
        self.passed.clear()


def _bwrap_args(binds, env: dict[str, str], chdir: str, limits: Limits, fds: _Fds, info: int) -> list[str]:
    # /tmp first: a bind under /tmp (a package or an environment there) must land on the tmpfs
    args = [*_NAMESPACES, "--proc", "/proc", "--dev", "/dev", "--size", str(limits.tmp_size), "--tmpfs",
            "/tmp", "--dir", "/tmp/home", *_system_binds()]
    for name, content in (("passwd", f"learner:x:{SANDBOX_UID}:{SANDBOX_UID}::/tmp/home:/bin/sh\n"),
                          ("group", f"learner:x:{SANDBOX_UID}:\n")):
        args += ["--ro-bind-data", str(fds.data(content.encode())), f"/etc/{name}"]
    for source, target in binds:
        args += ["--ro-bind", source, target]
    args += ["--remount-ro", "/", "--chdir", chdir, "--clearenv", "--info-fd", str(info)]
    for key, value in env.items():
        args += ["--setenv", key, value]
    return args


def _as_sandbox_user(binds, uid: int, stage: Path):
    """As root: the command prefix that runs bwrap as ``uid`` after binding each source into ``stage``,
    where that uid can reach it (in a private mount namespace of the prefix: the host sees empty
    folders), and the binds with those sources. Returns (prefix, binds)."""
    staged, mounts = [], []
    for number, (source, target) in enumerate(binds):
        point = stage / str(number)
        point.mkdir()
        mounts += [source, str(point)]
        staged.append((str(point), target))
    os.chmod(stage, 0o755)
    script = 'n=$1; shift; while [ "$n" -gt 0 ]; do mount --bind "$1" "$2" || exit 125; shift 2; n=$((n-1)); ' \
             'done; exec "$@"'
    prefix = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh",
              str(len(binds)), *mounts, "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    return prefix, staged


def run(command: list[str], binds: list[tuple[str, str]], env: dict[str, str], chdir: str, limits: Limits,
        reader: FrameReader, sandboxed: bool = True) -> Outcome:
    """Run ``command`` (it writes frames on its stdout) and read its frames with ``reader``.

    binds: (host path, path in the sandbox) pairs, all read-only. env: the whole environment.
    chdir: the working directory (in the sandbox). Returns when every process of the run is gone.
    """
    if not sandboxed:
        return _run_plain(command, env, chdir, limits, reader)
    reason = unavailable_reason()
    if reason:
        raise SandboxUnavailable(reason)
    fds = _Fds()
    uid = _free_uid() if _as_root() else None
    # /tmp, not TMPDIR: the sandbox's uid must be able to reach the mount points
    stage = Path(tempfile.mkdtemp(prefix="fa-lab-stage-", dir="/tmp")) if uid else None
    try:
        info_read, info_write = fds.pipe()
        prefix: list[str] = []
        if stage:
            prefix, binds = _as_sandbox_user(binds, uid, stage)
        args = _bwrap_args(binds, env, chdir, limits, fds, info_write)
        launch = [*prefix, "bwrap", "--args", str(fds.data(b"\0".join(a.encode() for a in args) + b"\0")),
                  *limits.prlimit(processes=True), *command]
        process = subprocess.Popen(launch, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   pass_fds=fds.passed, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        fds.close()
        deadline = time.monotonic() + limits.budget
        init = _init_pidfd(info_read, deadline)
        try:
            outcome = _supervise(process, reader, deadline)
        finally:
            _teardown(process, init, uid)
        outcome.exit_status = process.returncode
        return outcome
    finally:
        fds.close()
        if stage:  # empty mount points on the host: the binds lived in the wrapper's namespace only
            for point in stage.iterdir():
                point.rmdir()
            stage.rmdir()


def _init_pidfd(info: int, deadline: float) -> int | None:
    """A pidfd of the sandbox's init, from bwrap's --info-fd (None if bwrap failed before)."""
    data, decoder = b"", json.JSONDecoder()
    with selectors.DefaultSelector() as selector:
        selector.register(info, selectors.EVENT_READ)
        while time.monotonic() < deadline and selector.select(deadline - time.monotonic()):
            chunk = os.read(info, 4096)
            if not chunk:
                break
            data += chunk
            try:
                pid = decoder.raw_decode(data.decode().lstrip())[0]["child-pid"]
            except (ValueError, KeyError, TypeError):
                continue
            os.close(info)
            try:
                return os.pidfd_open(pid)
            except ProcessLookupError:  # already gone
                return None
    os.close(info)
    return None


def _supervise(process: subprocess.Popen, reader: FrameReader, deadline: float) -> Outcome:
    outcome = Outcome()
    stderr = bytearray()
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ, "channel")
        selector.register(process.stderr, selectors.EVENT_READ, "stderr")
        while "channel" in {key.data for key in selector.get_map().values()}:
            left = deadline - time.monotonic()
            if left <= 0:
                outcome.budget_exceeded = True
                break
            for key, _ in selector.select(left):
                data = os.read(key.fd, 1 << 20)
                if not data:
                    selector.unregister(key.fileobj)
                elif key.data == "stderr":
                    stderr = (stderr + data)[-STDERR_TAIL:]
                else:
                    try:
                        frames = reader.feed(data)
                    except ChannelBroken as exc:
                        outcome.broken = str(exc)
                        break
                    outcome.frames += frames
            if outcome.broken or any(f.header.get("type") == "done" for f in outcome.frames):
                break
    outcome.stderr = stderr.decode(errors="replace")
    return outcome


def _teardown(process: subprocess.Popen, init: int | None, uid: int | None) -> None:
    """Kill the sandbox and return once all its processes are gone."""
    if init is not None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(init, signal.SIGKILL)
        with selectors.DefaultSelector() as selector:  # readable once init has exited, its namespace emptied
            selector.register(init, selectors.EVENT_READ)
            gone = selector.select(TEARDOWN_TIMEOUT)
        os.close(init)
        if not gone:
            raise RuntimeError("the sandbox's init did not exit after SIGKILL")
    process.kill()
    process.wait()
    process.stdout.close()
    process.stderr.close()
    if uid is None:
        return
    end = time.monotonic() + TEARDOWN_TIMEOUT
    while _alive_of(uid) and time.monotonic() < end:  # only when init was never seen: they are dying
        for pid in _alive_of(uid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    if _alive_of(uid):
        raise RuntimeError(f"processes of the sandbox's uid {uid} outlived SIGKILL")


def _run_plain(command: list[str], env: dict[str, str], chdir: str, limits: Limits,
               reader: FrameReader) -> Outcome:
    # util-linux's prlimit is Linux's; elsewhere (macOS) only the wall-clock budget holds
    bounded = [*limits.prlimit(processes=False), *command] if shutil.which("prlimit") else command
    process = subprocess.Popen(bounded, cwd=chdir, env=env,
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)
    try:
        outcome = _supervise(process, reader, time.monotonic() + limits.budget)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        process.stdout.close()
        process.stderr.close()
    outcome.exit_status = process.returncode
    return outcome
