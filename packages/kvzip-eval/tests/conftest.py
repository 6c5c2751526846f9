"""Shared fixtures: the embedded model is loaded once per test session (~1 s from the cache,
~40 s the first time, when the GGUF is converted to a cached HF folder)."""

import pytest


@pytest.fixture(scope="session")
def loaded():
    from kvzip_eval.model import load_model

    return load_model()
