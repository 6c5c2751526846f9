"""Shared fixtures: the embedded model is loaded once per test session (~1 s from the cache,
~40 s the first time, when the GGUF is converted to a cached HF folder)."""

import os

# See cmd_eval.py: tiny ops stall on spinning OpenMP barriers when the cores are shared.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def loaded():
    from kvzip_eval.model import load_model

    return load_model()
