"""fa_lab.kernels.launch: a kernel's later calls launch through the compiled kernel its first call got, and only
when every argument specializes as it did then. Checked on the CPU with a stand-in kernel; the gpu tests of the
Gluon kernels run with CachedLaunch.check_against_binder on (tests/test_hopper.py)."""
import inspect
import types

import pytest
import torch

pytest.importorskip("triton")

from triton import knobs  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from fa_lab.kernels import launch  # noqa: E402


class Compiled:
    """A stand-in compiled kernel: records what its launcher was given."""

    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class Kernel:
    """A stand-in jit kernel f(x, n, scale, BLOCK: constexpr, flag: constexpr = True): ``kernel[grid](...)``
    records the call (the ordinary path) and returns a new Compiled."""

    def __init__(self):
        def f(x, n, scale, BLOCK, flag=True):
            pass

        constexprs = {"BLOCK", "flag"}
        self.params = [types.SimpleNamespace(name=p.name, is_constexpr=p.name in constexprs, default=p.default)
                       for p in inspect.signature(f).parameters.values()]
        self.ordinary = []

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.ordinary.append((grid, args, kwargs))
            return Compiled()
        return call


@pytest.fixture
def device(monkeypatch):
    monkeypatch.setattr(launch.CachedLaunch, "check_against_binder", False)  # (the stand-in has no binder)
    active = types.SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 1234)
    monkeypatch.setattr(launch, "driver", types.SimpleNamespace(active=active))


def test_a_repeated_call_launches_through_the_compiled_kernel(device, generator):
    kernel = Kernel()
    cached = launch.CachedLaunch(kernel)
    x = torch.randn(64, generator=generator)
    first = cached[(3,)](x, 32, 0.5, BLOCK=16, num_warps=4)
    assert len(kernel.ordinary) == 1 and not first.runs
    again = cached[(5, 2)](x, 48, 0.25, BLOCK=16, num_warps=4)  # 48: still a multiple of 16, not 1
    assert again is first and len(kernel.ordinary) == 1
    (grid_x, grid_y, grid_z, stream, function, metadata, launch_metadata, enter, leave, *values), = first.runs
    assert (grid_x, grid_y, grid_z, stream, function, metadata) == (5, 2, 1, 1234, "function", "metadata")
    assert (launch_metadata, enter, leave) == (None, None, None)
    assert values[0] is x and values[1:] == [48, 0.25, 16, True]  # every parameter in order, defaults filled in


@pytest.mark.parametrize("change", ["int not a multiple of 16", "int 1", "int past int32", "dtype",
                                    "misaligned pointer", "constexpr", "option", "descriptor block",
                                    "descriptor dtype"])
def test_a_call_that_specializes_differently_takes_the_ordinary_path(change, device, generator):
    kernel = Kernel()
    cached = launch.CachedLaunch(kernel)
    x = torch.randn(64, generator=generator)
    args, kwargs = [x, 32, 0.5], {"BLOCK": 16, "num_warps": 4}
    if change.startswith("descriptor"):  # a plain Triton TMA descriptor in x's place
        args[0] = TensorDescriptor.from_tensor(x.view(4, 16), [2, 16])
    cached[(1,)](*args, **kwargs)
    if change == "int not a multiple of 16":
        args[1] = 33
    elif change == "int 1":
        args[1] = 1
    elif change == "int past int32":
        args[1] = 1 << 32
    elif change == "dtype":
        args[0] = x.double()
    elif change == "misaligned pointer":
        args[0] = x[1:]
    elif change == "descriptor block":
        args[0] = TensorDescriptor.from_tensor(x.view(4, 16), [4, 16])
    elif change == "descriptor dtype":
        args[0] = TensorDescriptor.from_tensor(x.double().view(4, 16), [2, 16])
    elif change == "constexpr":
        kwargs["BLOCK"] = 32
    else:
        kwargs["num_warps"] = 8
    cached[(1,)](*args, **kwargs)
    assert len(kernel.ordinary) == 2


def test_a_plain_triton_descriptor_of_the_same_dtype_and_block_launches_through_the_cached_kernel(device, generator):
    """A plain TensorDescriptor specializes as its dtype and block shape only: another tensor or shape with those
    takes the cached path."""
    kernel = Kernel()
    cached = launch.CachedLaunch(kernel)
    x, y = torch.randn(64, generator=generator), torch.randn(96, generator=generator)
    first = cached[(1,)](TensorDescriptor.from_tensor(x.view(4, 16), [2, 16]), 32, 0.5, BLOCK=16)
    again = cached[(1,)](TensorDescriptor.from_tensor(y.view(6, 16), [2, 16]), 32, 0.5, BLOCK=16)
    assert again is first and len(kernel.ordinary) == 1 and len(first.runs) == 1


def test_launch_hooks_and_unknown_arguments_take_the_ordinary_path(device, generator):
    kernel = Kernel()
    cached = launch.CachedLaunch(kernel)
    x = torch.randn(64, generator=generator)
    cached[(1,)](x, 32, 0.5, BLOCK=16)
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        cached[(1,)](x, 32, 0.5, BLOCK=16)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(kernel.ordinary) == 2
    cached[(1,)](x, [32], 0.5, BLOCK=16)  # a list: not a kind the launch key covers
    assert len(kernel.ordinary) == 3
    cached[(1,)](x, 32, 0.5, BLOCK=16)  # and the cached path is still there
    assert len(kernel.ordinary) == 3


def test_a_kernel_without_a_binder_is_launched_as_it_is():
    """The interpreter's kernels are not compiled: cached_launch hands them back."""
    interpreted = types.SimpleNamespace()
    assert launch.cached_launch(interpreted) is interpreted
    kernel = Kernel()
    kernel.device_caches = {}
    assert launch.cached_launch(kernel) is launch.cached_launch(kernel)
    assert isinstance(launch.cached_launch(kernel), launch.CachedLaunch)
