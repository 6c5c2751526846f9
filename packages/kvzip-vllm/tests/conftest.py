"""CPU runs interpret the Triton kernels: TRITON_INTERPRET=1 must be set before anything
(vLLM included) imports triton, so it is set here, before the test modules are imported."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(params=["async", "sync"])
def load_mode(request, monkeypatch):
    """Runs a test under both of the tier's load designs: the workers it makes through
    ``kvzip_vllm.settings.connector_settings`` take this ``load_mode`` unless they name one.
    With ``"async"`` the test's step helpers wait for the loads (``finish_loads``), as vLLM
    waits for ``get_finished`` to report them before it schedules the request."""
    from kvzip_vllm import settings

    real = settings.connector_settings

    def with_mode(extra=None, environ=None):
        extra = dict(extra or {})
        extra.setdefault("load_mode", request.param)
        return real(extra, environ)

    monkeypatch.setattr(settings, "connector_settings", with_mode)
    return request.param
