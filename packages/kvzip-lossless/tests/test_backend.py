"""Which GPU coder runs: the CUDA C coder built for the GPU at hand, else Triton (CPU-testable
parts: the nvcc arch flags, the fallback decision, and the build with kvzip_formats.nvcc where
an nvcc is installed)."""

import ctypes
import logging

import pytest
import torch

import kvzip_lossless as kl
from kvzip_lossless import _cuda, gpu


@pytest.mark.parametrize(
    "cap, sm", [((9, 0), "90"), ((8, 0), "80"), ((8, 6), "86"), ((7, 5), "75"), ((12, 0), "120")]
)
def test_arch_flags_follow_the_gpu(cap, sm):
    flags = _cuda.arch_flags(cap)
    assert flags == [
        f"-gencode=arch=compute_{sm},code=sm_{sm}",
        f"-gencode=arch=compute_{sm},code=compute_{sm}",
    ]


@pytest.mark.parametrize("cap", [(6, 1), (5, 0), (8, 10)])
def test_arch_flags_refuse_unsupported_gpus(cap):
    with pytest.raises(ValueError, match="not supported by the CUDA C coder"):
        _cuda.arch_flags(cap)


def test_decide_backend_prefers_cuda_c_and_falls_back_to_triton():
    assert gpu.decide_backend("cuda", None, lambda: None)[0] == "cuda"
    b, why = gpu.decide_backend("cuda", None, lambda: "RuntimeError: nvcc failed")
    assert b == "triton" and "nvcc failed" in why
    assert gpu.decide_backend("cuda", "triton", lambda: 1 / 0)[0] == "triton"  # not even tried
    assert gpu.decide_backend("cpu", None, lambda: 1 / 0)[0] == "triton"
    with pytest.raises(RuntimeError, match="cannot run: no nvcc"):
        gpu.decide_backend("cuda", "cuda", lambda: "no nvcc")
    with pytest.raises(ValueError, match="supported values are cuda, triton"):
        gpu.decide_backend("cuda", "cudnn", lambda: None)


def test_default_backend_logs_the_coder_and_its_reason(monkeypatch, caplog):
    monkeypatch.setattr(_cuda, "failure", lambda dev: "ValueError: compute capability 6.1")
    monkeypatch.setattr(gpu, "_logged", set())
    monkeypatch.delenv("KVZIP_LOSSLESS_BACKEND", raising=False)
    with caplog.at_level(logging.INFO, logger="kvzip_lossless"):
        assert gpu.default_backend("cuda:0") == "triton"
    assert "triton" in caplog.text and "compute capability 6.1" in caplog.text
    monkeypatch.setattr(_cuda, "failure", lambda dev: None)
    assert gpu.default_backend("cuda:0") == "cuda"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU machine: no CUDA C coder")
def test_cuda_c_coder_unavailable_without_cuda():
    assert not _cuda.available() and _cuda.failure() == "CUDA is not available"
    assert kl.coder("cpu") in ("numpy", "numba")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_c_coder_built_for_this_gpu():
    cap = torch.cuda.get_device_capability()
    assert _cuda.available(), _cuda.failure()
    assert kl.coder("cuda") == "cuda"
    # the library of this GPU's arch is the one loaded
    assert cap in _cuda._library().libs


def _have_nvcc() -> bool:
    from kvzip_formats.nvcc import find_nvcc

    try:
        find_nvcc()
    except FileNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _have_nvcc(), reason="no nvcc (KVZIP_NVCC, CUDA_HOME or PATH)")
def test_cuda_c_coder_builds_for_hopper_and_declares_its_entry_points(tmp_path, monkeypatch):
    """csrc/kvzl.cu built through the shared helper (no GPU needed): cached under
    ``$XDG_CACHE_HOME/kvzip`` as ``kvzl-sm90-<key>.so``, loaded, every launcher declared."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("KVZIP_LOSSLESS_CUDA_SO", raising=False)
    so = _cuda._library().build((9, 0))
    assert so.parent == tmp_path / "kvzip" and so.name.startswith("kvzl-sm90-")
    L = ctypes.CDLL(str(so))
    _cuda._declare(L)
    assert len(L.kvzl_decode_launch.argtypes) == 12 and len(L.kvzl_bdec_launch.argtypes) == 14
