"""Shared pytest fixtures, the `gpu` marker's skip rule, and what is not collected without Jupyter."""
import importlib.util

import pytest
import torch

import fa_lab  # noqa: F401  (first: switches Triton's interpreter on before any test imports triton)

# The grading and lab tests run notebooks (nbformat, nbclient). The GPU machine has no Jupyter
# stack, so there they are left out rather than failing at import; `make test` installs it.
# Each lab's tests are test_labNN_checks.py and test_grading_labNN.py; the registry knows the labs
# (it lists modules without importing them, and fa_lab.grading imports nothing from Jupyter).
if importlib.util.find_spec("nbformat") is None:
    from fa_lab.grading.registry import lab_ids

    collect_ignore = ["test_assign.py", "test_grading.py"]
    collect_ignore += [name for lab in lab_ids() for name in (f"test_{lab}_checks.py", f"test_grading_{lab}.py")]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        # Every cached launch of a gpu test is checked against Triton's own argument binding (it picks the same
        # compiled kernel): fa_lab.kernels.launch's guarantee, tested on every shape the gpu tests run.
        from fa_lab.kernels.launch import CachedLaunch

        CachedLaunch.check_against_binder = True
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine: make test-gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def generator(request):
    """A torch.Generator seeded from the test's name: fresh inputs per test, reproducible per test."""
    import zlib

    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def assert_never_waits():
    """assert_never_waits(call, read): call() issues its GPU work without reading anything back to the host. call runs
    once to compile and fill the launchers' caches, then again under PyTorch's sync debug mode set to raise; read()
    (a call that does read back) must raise there, so that the mode is known to see such reads."""
    def check(call, read):
        call()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
            with pytest.raises(RuntimeError, match="synchroniz"):
                read()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return check
