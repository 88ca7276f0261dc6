"""Launching a jit kernel without Triton's per-call argument binding.

``kernel[grid](*args)`` runs ``JITFunction.run`` on every call: it binds the arguments to the signature,
specializes each one (its type, a pointer's or an integer's divisibility by 16, an integer equal to 1, a
descriptor's dtype, block and layout), turns that into a cache key and only then finds the compiled kernel.
For the Gluon forward, with 22 arguments that are not constexpr, skipping that saves a fifth of a call's host
time (docs/experiments/hopper_forward.md, "Launch path: cached launches").

:class:`CachedLaunch` keeps, per kernel, the compiled kernel that the first call of each *launch key* got from
``JITFunction.run``, and launches later calls with that key through it directly. The launch key is a tuple of
features read cheaply from the arguments that fixes at least everything Triton's specialization reads, so two
calls with one launch key always have one specialization (``check_against_binder`` asserts it in the tests):

- an int: whether it is 1, whether it is a multiple of 16, and whether it fits int32 / int64;
- a tensor: its dtype and whether its address is a multiple of 16;
- a Gluon TMA descriptor: its tensor's dtype, its block shape and its shared-memory layout; a plain Triton one
  (``triton.tools.tensor_descriptor.TensorDescriptor``): its tensor's dtype and its block shape;
- a float or a bool: its type; a constexpr: its value; the launch options (num_warps, maxnreg, ...): their values;
  the device and Triton's debug switch. (Triton's instrumentation mode, a compile option from the environment, is
  taken as fixed for the process.)

Calls take the ordinary path when a launch hook is installed (a profiler such as Proton) and when an argument is
of another kind; under the CPU interpreter :func:`cached_launch` hands the kernel back unchanged.
"""
from __future__ import annotations

import inspect

import torch
from triton import knobs
from triton.runtime import driver
from triton.tools.tensor_descriptor import TensorDescriptor

_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT64 = (-(1 << 63), (1 << 63) - 1)


class _Unkeyable(Exception):
    """An argument whose specialization the launch key does not cover: the call takes the ordinary path."""


class _LayoutKeys:
    """A descriptor layout's key: its repr (what Triton's specialization reads), cached per layout object.
    The layouts are kept here, so an id is never reused for another layout while it is a key."""

    def __init__(self):
        self._by_id: dict[int, tuple[object, str]] = {}

    def __call__(self, layout) -> str:
        entry = self._by_id.get(id(layout))
        if entry is None:
            entry = self._by_id[id(layout)] = (layout, repr(layout))
        return entry[1]


_layout_key = _LayoutKeys()


def argument_feature(arg):
    """What the launch key holds of one argument that is not constexpr (module docstring)."""
    kind = type(arg)
    if kind is int:
        fits = 0 if _INT32[0] <= arg <= _INT32[1] else 1 if _INT64[0] <= arg <= _INT64[1] else 2
        return arg == 1, arg & 15 == 0, fits
    if kind is torch.Tensor or isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() & 15 == 0
    if kind is float:
        return float
    if kind is bool:
        return bool
    if arg is None:
        return None
    layout = getattr(arg, "layout", None)
    if layout is not None and hasattr(arg, "block_shape"):  # a Gluon TMA descriptor
        return arg.base.dtype, tuple(arg.block_shape), _layout_key(layout)
    if kind is TensorDescriptor:  # a plain Triton one: its specialization is "tensordesc<dtype[block]>"
        return TensorDescriptor, arg.base.dtype, tuple(arg.block_shape)
    raise _Unkeyable(kind)


class CachedLaunch:
    """``CachedLaunch(kernel)[grid](*args, **kwargs)`` launches like ``kernel[grid](*args, **kwargs)``.

    ``args`` are the kernel's leading parameters in order; ``kwargs`` the rest (constexprs among them) and the
    launch options. See the module docstring for what is cached and when the ordinary path is taken."""

    check_against_binder = False  # tests: on every cached launch, assert Triton's binder picks the same kernel

    def __init__(self, kernel):
        self.kernel = kernel
        self._compiled: dict[tuple, object] = {}
        params = kernel.params
        self._names = [p.name for p in params]
        self._parameters = frozenset(self._names)
        self._constexpr = [p.is_constexpr for p in params]
        self._defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _ordered(self, args, kwargs) -> tuple[list, tuple]:
        """(every parameter's value in signature order, the options: kwargs that are not parameters)."""
        values = list(args)
        for name in self._names[len(args):]:
            values.append(kwargs[name] if name in kwargs else self._defaults[name])
        parameters = self._parameters
        options = tuple(sorted(item for item in kwargs.items() if item[0] not in parameters))
        return values, options

    def launch(self, grid, args, kwargs):
        if knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls:
            return self.kernel[grid](*args, **kwargs)
        try:
            values, options = self._ordered(args, kwargs)
            key = (driver.active.get_current_device(), knobs.runtime.debug, options,
                   *[value if constexpr else argument_feature(value)
                     for value, constexpr in zip(values, self._constexpr)])
            compiled = self._compiled.get(key)
        except (_Unkeyable, KeyError, TypeError):  # (TypeError: a constexpr or option that cannot be hashed)
            return self.kernel[grid](*args, **kwargs)
        if compiled is None:
            self._compiled[key] = self.kernel[grid](*args, **kwargs)
            return self._compiled[key]
        if self.check_against_binder:
            self._check(compiled, key[0], args, kwargs)
        grid = tuple(grid) + (1,) * (3 - len(grid))
        stream = driver.active.get_current_stream(key[0])
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, None, None,
                     None, *values)
        return compiled

    def _check(self, compiled, device, args, kwargs) -> None:
        """Assert that JITFunction.run would launch ``compiled`` for these arguments (test-only: it binds them)."""
        from triton.runtime.jit import compute_cache_key

        kernel_cache, key_cache, _target, _backend, binder = self.kernel.device_caches[device]
        kwargs = dict(kwargs, debug=kwargs.get("debug", self.kernel.debug) or knobs.runtime.debug,
                      instrumentation_mode=knobs.compilation.instrumentation_mode)
        _bound, specialization, options = binder(*args, **kwargs)
        expected = kernel_cache.get(compute_cache_key(key_cache, specialization, options))
        assert expected is compiled, "CachedLaunch picked another compiled kernel than Triton's binder"


_LAUNCHES: dict[object, CachedLaunch] = {}


def cached_launch(kernel):
    """The one :class:`CachedLaunch` of ``kernel`` (its cache lives as long as the process); the kernel itself
    where it is not compiled (the interpreter's kernels have no binder to skip)."""
    if not hasattr(kernel, "device_caches"):
        return kernel
    launch = _LAUNCHES.get(kernel)
    if launch is None:
        launch = _LAUNCHES[kernel] = CachedLaunch(kernel)
    return launch
