"""Kernel tests run on the GPU when there is one, else under the Triton interpreter.

``TRITON_INTERPRET=1`` must be set before triton is imported, so it is set here for CPU runs.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"
