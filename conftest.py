"""Workspace-wide pytest set-up: tests marked `gpu` need CUDA (the H200); CPU runs deselect
them with `-m "not gpu"` (see noxfile.py), and a stray run without CUDA reports them as
skipped with the reason rather than failing on import."""

import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run `nox -s gpu` on the H200")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
