"""Call a learner's function on the grader's inputs and hand back what it returned.

This module runs in two places:

* inside :func:`fa_lab.grading.check`, in the learner's own notebook;
* inside the grading sandbox, where the runner (:mod:`fa_lab.grading.runner`) has the kernel
  call :func:`serve`, which writes the outputs in the format of :mod:`fa_lab.grading.wire`.
  The grader trusts nothing of that: it validates the bytes and judges them in its own process.

While the learner's code runs, :class:`CallGuard` watches every Python and C
call (``sys.setprofile`` sees both) and records calls to what the exercise asks
the learner to write: PyTorch's SDPA (all its back ends), FlexAttention,
``fa_lab.attention`` and the course's own implementations and solutions, plus
what an exercise forbids itself (e.g. ``fa_lab.fp8`` in lab 04), except what it
allows (a reference the exercise may call, together with everything that calls).
The guard lives in the learner's process, so it only gives a friendly message:
while grading, what an exercise forbids is absent from the sandbox instead
(:mod:`fa_lab.grading.view`), and a call to such a placeholder is recorded the same way.
:class:`TensorProbe` records the largest tensor any operator creates (any dtype: a
bool mask counts too), so a check can tell a tiled algorithm from one that builds the full
(Nq, Nk) score matrix.

Only the standard library, torch and :mod:`~fa_lab.grading.wire` are imported here.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import wire

CALLING_CONVENTIONS = ("call", "autograd")
# Modules whose every function counts as "calling the answer" (fa_lab.kernels' submodules hold
# the kernels; fa_lab.kernels itself also has helpers such as load_triton, which stay allowed).
FORBIDDEN_MODULES = ("fa_lab.flash_torch", "fa_lab.online_softmax", "fa_lab.kernels.", "fa_lab.grading.labs",
                     "fa_lab.impls", "fa_lab.varlen", "fa_lab.kvcache", "fa_lab.sparse", "fa_lab.context_parallel",
                     "fa_lab.linear")
# Exceptions among them: the interpreter fixes that load_triton installs, which Triton's interpreter
# calls from inside any kernel (the learner's too).
ALLOWED_MODULES = ("fa_lab.kernels.interpreter_fixes",)
# Single functions of modules that the learner may otherwise use (e.g. fa_lab.reference.causal_mask).
FORBIDDEN_FUNCTIONS = frozenset({
    ("fa_lab", "attention"),
    ("fa_lab", "attention_varlen"),
    ("fa_lab", "attention_with_kvcache"),
    ("fa_lab.kernels", "triton_attention"),
    ("fa_lab.reference", "naive_attention"),
    ("fa_lab.reference", "reference_attention"),
})


def listed(qualified: str, names) -> bool:
    """True when ``qualified`` ("module.function") is one of ``names`` or lies in one of them
    (a name may be a module: "fa_lab.fp8" lists every function of fa_lab.fp8)."""
    return any(qualified == name or qualified.startswith(name + ".") for name in names)


def forbidden_torch_name(name: str) -> bool:
    """SDPA and each of its back ends, FlexAttention (checked on every call: kept cheap)."""
    return "scaled_dot_product" in name or "flex_attention" in name


class CallGuard:
    """Record forbidden calls made while the context is active.

    ``calls`` lists the outermost forbidden calls (not what they call in turn), in
    order, without repeats. Switching the monitor off (``sys.setprofile`` or
    ``threading.setprofile`` from inside the call) is itself recorded. ``removed``
    says that the monitor was gone at the end without such a call: Python drops a
    profile function that raised, which a RecursionError does (see :func:`run_cases`).
    forbidden, allowed: dotted names of functions or modules (see :func:`listed`)
    forbidden on top of the course-wide list, or let through with everything
    they call.
    """

    def __init__(self, forbidden=(), allowed=()):
        self.calls: list[str] = []
        self.forbidden, self.allowed = tuple(forbidden), tuple(allowed)
        self._active = False
        self.removed = False
        self._outer = None  # the frame, or the builtin, of the forbidden (or allowed) call in progress
        self._hook = self._profile  # one bound-method object, so that sys.getprofile() can be compared to it

    def _record(self, what: str, outer) -> None:
        if what not in self.calls:
            self.calls.append(what)
        if self._outer is None:
            self._outer = outer

    def _profile(self, frame, event, arg):
        if not self._active:
            return
        if event == "call":
            module = frame.f_globals.get("__name__") or ""
            name = frame.f_code.co_name
            if module == "threading" and name == "setprofile":
                self._record("threading.setprofile (it switches the grader's call monitor off)", None)
            elif self._outer is None:
                qualified = f"{module}.{name}" if self.forbidden or self.allowed else ""
                if self.allowed and listed(qualified, self.allowed):
                    self._outer = frame  # allowed: what it calls in turn is not examined
                    return
                what = _forbidden_frame(module, name, frame)
                if not what and self.forbidden and listed(qualified, self.forbidden):
                    what = None if _importing(frame) else qualified
                if what:
                    self._record(what, frame)
        elif event == "c_call":
            if arg is sys.setprofile:
                self._record("sys.setprofile (it switches the grader's call monitor off)", None)
            elif self._outer is None:
                name = getattr(arg, "__name__", "") or ""
                if forbidden_torch_name(name):
                    self._record(f"torch: {name}", arg)
        elif arg is self._outer if event in ("c_return", "c_exception") else frame is self._outer:
            self._outer = None

    def __enter__(self) -> "CallGuard":
        self._active = True
        threading.setprofile(self._hook)
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc_info) -> None:
        self.removed = sys.getprofile() is not self._hook
        self._active = False
        sys.setprofile(None)
        threading.setprofile(None)


def _importing(frame) -> bool:
    """True when the frame runs as part of an import (importing a module is not calling it)."""
    while frame is not None:
        if frame.f_globals.get("__name__") == "importlib._bootstrap":
            return True
        frame = frame.f_back
    return False


def _forbidden_frame(module: str, name: str, frame) -> str | None:
    """What a Python call is, when it is forbidden: "fa_lab.attention", "torch: aten.<op>", ..."""
    forbidden_module = module.startswith(FORBIDDEN_MODULES) and not module.startswith(ALLOWED_MODULES)
    if forbidden_module or (module, name) in FORBIDDEN_FUNCTIONS:
        return None if _importing(frame) else f"{module}.{name}"
    if not module.startswith("torch"):
        return None
    if forbidden_torch_name(name):
        return f"torch: {name}"
    # torch.ops.aten.<op>(...) and <op>.default(...) run through OpOverload(Packet).__call__.
    if module == "torch._ops" and name == "__call__":
        op = str(frame.f_locals.get("self", name))
        return f"torch: {op}" if forbidden_torch_name(op) else None
    return None


class TensorProbe(TorchDispatchMode):
    """Track ``largest``: the most elements of any tensor an operator returned, whatever its dtype."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return result


def encode(value, depth: int = 0):
    """The plain data a reply may hold (see :mod:`fa_lab.grading.wire`).

    Tensors become plain detached CPU tensors, tuples and lists become lists,
    dicts keep their string keys, numbers, strings and None stay; anything else
    becomes a string naming its type.
    """
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu").as_subclass(torch.Tensor).clone()
    if isinstance(value, (tuple, list)) and depth < 2:
        return [encode(item, depth + 1) for item in value]
    if isinstance(value, dict) and depth < 2:
        return {key if type(key) is str else f"<{type(key).__name__} key>": encode(item, depth + 1)
                for key, item in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return f"<{type(value).__module__}.{type(value).__name__} object>"


def hidden_names(exc: BaseException) -> list[str]:
    """What grading hides that raised ``exc`` or an error it came from (the sandbox's placeholders
    set ``hidden_name``, see :mod:`fa_lab.grading.graded_view` and :mod:`fa_lab.grading.prelude`)."""
    names, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        name = getattr(exc, "hidden_name", None)
        if isinstance(name, str) and name not in names:
            names.append(name)
        exc = exc.__cause__ or exc.__context__
    return names


def describe_exception(exc: BaseException) -> str:
    """``"IndexError: ... (in flash_forward, at: acc[i] = ...)"``: the error and the learner's
    line that raised it, followed into the errors it was raised from (Triton's interpreter
    re-raises an error in a kernel as an InterpreterError from it)."""
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    frames, cause, seen = [], exc, set()
    while cause is not None and id(cause) not in seen:  # a chain can be made to loop
        seen.add(id(cause))
        frames = [f for f in traceback.extract_tb(cause.__traceback__)
                  if f.filename != __file__ and "site-packages" not in f.filename
                  and "/torch/" not in f.filename and f.line] or frames
        cause = cause.__cause__
    if frames:
        text += f" (in {frames[-1].name}, at: {frames[-1].line.strip()})"
    return text


def _call(fn, calling: str, args):
    """Run one case. ``call``: fn(*args). ``autograd``: fn is a torch.autograd.Function;
    args = (*inputs, grad_output): apply it, backpropagate grad_output from its first
    output, return (output, *gradients of the floating-point tensor inputs)."""
    if calling == "call":
        return fn(*args)
    if not (isinstance(fn, type) and issubclass(fn, torch.autograd.Function)):
        raise TypeError(f"expected a subclass of torch.autograd.Function, got {fn!r}")
    *inputs, grad_output = args
    leaves = [a.requires_grad_() for a in inputs if isinstance(a, torch.Tensor) and a.is_floating_point()]
    result = fn.apply(*inputs)
    out = result[0] if isinstance(result, (tuple, list)) else result
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{fn.__name__}.apply returned {type(out).__name__}, expected a tensor")
    if out.grad_fn is None:
        raise TypeError(f"the output of {fn.__name__}.apply has no grad_fn, so backward cannot reach "
                        "your backward(); did forward return a tensor?")
    out.backward(grad_output)
    return (out, *(leaf.grad for leaf in leaves))


def _fresh(value):
    """A copy of a case's arguments, so that a function that writes into its inputs changes nothing else."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_fresh(item) for item in value)
    return value


def run_cases(fn, calling: str, cases, forbidden=(), allowed=(), guard: bool = True) -> list[dict]:
    """Call ``fn`` on each case; cases: list of (args, probe) with probe True to run TensorProbe.
    forbidden, allowed: the exercise's own additions to the watched calls (see :class:`CallGuard`).
    guard: watch the calls (False while grading when the sandbox hides every forbidden name).

    Returns one dict per case: ``outputs`` (encoded, or None), ``error`` (str or None),
    ``forbidden`` (list of forbidden calls, hidden names included) and ``largest``
    (TensorProbe's count, or None).
    """
    if calling not in CALLING_CONVENTIONS:
        raise ValueError(f"calling must be one of {CALLING_CONVENTIONS}, got {calling!r}")
    results = []
    for args, probe in cases:
        result = {"outputs": None, "error": None, "forbidden": [], "largest": None}
        args = _fresh(args)
        tensor_probe = TensorProbe() if probe else None
        call_guard = CallGuard(forbidden, allowed)
        with call_guard if guard else contextlib.nullcontext():
            try:
                with tensor_probe if probe else contextlib.nullcontext():
                    result["outputs"] = encode(_call(fn, calling, args))
            except Exception as exc:  # the learner's error is a result, not the grader's failure
                result["error"] = describe_exception(exc)
                call_guard.calls += [name for name in hidden_names(exc) if name not in call_guard.calls]
        # Python removes a profile function that raised: at the recursion limit the monitor raises
        # RecursionError too, and the case has failed with that error anyway.
        if call_guard.removed and not (result["error"] or "").startswith("RecursionError"):
            call_guard.calls.append("the grader's call monitor was removed while your function ran")
        result["forbidden"] = call_guard.calls
        result["largest"] = tensor_probe.largest if probe else None
        results.append(result)
    return results


def serve(namespace: dict, cases_path: str, number: int, reply_path: str, guard: bool) -> None:
    """In the grading kernel: run exercise ``number`` of the request saved at ``cases_path``
    against ``namespace`` and write the reply to ``reply_path``.

    request (written by the grader with torch.save): a list, one {"function": name, "calling":
    convention, "cases": [[args, probe], ...], "forbidden": [...], "allowed": [...]} per exercise.
    reply: {"status": "ran" | "missing" | "not callable", "results": [...]}, see :func:`wire.dump`.
    """
    request = torch.load(cases_path, weights_only=True)[number]
    fn = namespace.get(request["function"])
    if fn is None:
        reply = {"status": "missing", "results": []}
    elif not callable(fn):
        reply = {"status": "not callable", "results": []}
    else:
        results = run_cases(fn, request["calling"], request["cases"], request["forbidden"],
                            request["allowed"], guard)
        reply = {"status": "ran", "results": results}
    with open(reply_path, "wb") as stream:
        wire.dump(reply, stream)
