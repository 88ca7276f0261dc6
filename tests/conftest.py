"""Shared pytest fixtures and the `gpu` marker's skip rule."""
import pytest
import torch

import fa_lab  # noqa: F401  (first: switches Triton's interpreter on before any test imports triton)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
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
