"""The nvcc build-and-load helper (``kvzip_formats.nvcc``) that kvzip-lossless's CUDA C coder
and kvzip-kernels' decode kernel share: where nvcc is found, the command line, the cache key
and file name, the cache (a second build does not run nvcc), a prebuilt library, the errors;
and, where an nvcc is installed, a real build of a tiny library loaded with ctypes (no GPU
needed: the function it exports runs on the host)."""

import ctypes
import os
import stat
from pathlib import Path

import pytest

from kvzip_formats import nvcc

FLAGS = ["-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_90a,code=compute_90a"]


def fake_nvcc(tmp_path: Path, fail: bool = False) -> tuple[Path, Path]:
    """An executable standing in for nvcc: it appends its arguments to a log and writes its
    ``-o`` file (or prints an error and exits 1)."""
    log = tmp_path / "calls.log"
    exe = tmp_path / "bin" / "nvcc"
    exe.parent.mkdir(exist_ok=True)
    body = (
        'echo "src.cu(3): error: expected a ;" >&2; exit 1'
        if fail
        else 'while [ "$1" != "-o" ]; do shift; done; echo built > "$2"'
    )
    exe.write_text(f'#!/bin/sh\necho "$@" >> {log}\n{body}\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe, log


def test_command_line():
    cmd = nvcc.command("/x/nvcc", Path("/s/k.cu"), Path("/o/k.so"), FLAGS)
    assert cmd == ["/x/nvcc", "-O3", *FLAGS, "-shared", "-Xcompiler", "-fPIC", "-o", "/o/k.so",
                   "/s/k.cu"]  # fmt: skip


def test_cache_key_and_path_follow_source_and_flags(tmp_path):
    k = nvcc.cache_key(b"__global__ void f() {}", FLAGS)
    assert len(k) == 16 and int(k, 16) >= 0
    assert k == nvcc.cache_key(b"__global__ void f() {}", list(FLAGS))
    assert k != nvcc.cache_key(b"__global__ void g() {}", FLAGS)
    assert k != nvcc.cache_key(b"__global__ void f() {}", FLAGS[:1])
    p = nvcc.library_path(b"src", FLAGS, "kvzd", (9, 0), tmp_path)
    assert p == tmp_path / f"kvzd-sm90-{nvcc.cache_key(b'src', FLAGS)}.so"


def test_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert nvcc.cache_dir() == tmp_path / "kvzip"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert nvcc.cache_dir() == Path.home() / ".cache" / "kvzip"


def test_find_nvcc_order_and_clear_error(monkeypatch, tmp_path):
    exe, _ = fake_nvcc(tmp_path)
    monkeypatch.setenv("KVZIP_NVCC", "/opt/my/nvcc")
    assert nvcc.find_nvcc(lambda: str(tmp_path)) == "/opt/my/nvcc"  # the setting first
    monkeypatch.delenv("KVZIP_NVCC")
    assert nvcc.find_nvcc(lambda: str(tmp_path)) == str(exe)  # CUDA_HOME/bin/nvcc
    monkeypatch.setenv("PATH", str(exe.parent))
    assert nvcc.find_nvcc(lambda: None) == str(exe)  # PATH
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="KVZIP_NVCC") as e:
        nvcc.find_nvcc(lambda: None)
    assert "nvidia-cuda-nvcc" in str(e.value) and "PATH" in str(e.value)


def test_build_caches_and_prebuilt_skips(tmp_path):
    exe, log = fake_nvcc(tmp_path)
    src = tmp_path / "k.cu"
    src.write_text("__global__ void k() {}\n")
    kw = dict(prefix="kvzt", capability=(9, 0), out_dir=tmp_path / "cache", nvcc=str(exe))
    so = nvcc.build(src, FLAGS, **kw)
    assert so == nvcc.library_path(src.read_bytes(), FLAGS, "kvzt", (9, 0), tmp_path / "cache")
    assert so.read_text() == "built\n"
    assert len(log.read_text().splitlines()) == 1
    assert nvcc.build(src, FLAGS, **kw) == so  # cached: nvcc not run again
    assert len(log.read_text().splitlines()) == 1
    assert not list(so.parent.glob(f"*.{os.getpid()}.so"))  # the temporary name is gone
    src.write_text("__global__ void k2() {}\n")  # a changed source builds anew
    assert nvcc.build(src, FLAGS, **kw) != so
    assert len(log.read_text().splitlines()) == 2
    pre = tmp_path / "pre.so"
    pre.write_text("x")
    assert nvcc.build(src, FLAGS, prebuilt=str(pre), **kw) == pre
    assert len(log.read_text().splitlines()) == 2


def test_build_failure_and_missing_nvcc(tmp_path, monkeypatch):
    exe, _ = fake_nvcc(tmp_path, fail=True)
    src = tmp_path / "k.cu"
    src.write_text("oops\n")
    with pytest.raises(RuntimeError, match=r"nvcc failed .*-O3.*expected a ;"):
        nvcc.build(src, FLAGS, prefix="kvzt", capability=(9, 0), out_dir=tmp_path, nvcc=str(exe))
    monkeypatch.delenv("KVZIP_NVCC", raising=False)
    monkeypatch.setattr(nvcc, "_cuda_home", lambda: None)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="nvcc not found"):
        nvcc.build(src, FLAGS, prefix="kvzt", capability=(9, 0), out_dir=tmp_path)


def test_cuda_library_records_why_it_is_unavailable(tmp_path, monkeypatch):
    """An unsupported GPU, then a missing nvcc: None and the reason, kept per capability."""
    src = tmp_path / "k.cu"
    src.write_text("x\n")

    def flags(cap):
        if cap < (8, 0):
            raise ValueError(f"compute capability {cap} is not supported (needs >= 8.0)")
        return FLAGS[:1]

    calls = []
    lib = nvcc.CudaLibrary(src, "kvzt", flags, calls.append, what="test library")
    assert lib.get((7, 5)) is None
    assert lib.failure((7, 5)).startswith("ValueError: compute capability (7, 5)")
    monkeypatch.delenv("KVZIP_NVCC", raising=False)
    monkeypatch.setattr(nvcc, "_cuda_home", lambda: None)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert lib.get((9, 0)) is None and "nvcc not found" in lib.failure((9, 0))
    assert calls == [] and set(lib.failed) == {(7, 5), (9, 0)}


def _real_nvcc() -> str | None:
    try:
        return nvcc.find_nvcc()
    except FileNotFoundError:
        return None


@pytest.mark.skipif(_real_nvcc() is None, reason="no nvcc (KVZIP_NVCC, CUDA_HOME or PATH)")
def test_real_build_loads_and_runs_a_host_function(tmp_path, monkeypatch):
    """nvcc builds a tiny kernel library for sm_90a; ctypes loads it (cudart is linked
    statically) and its host function runs; a second CudaLibrary reuses the cached file."""
    src = tmp_path / "tiny.cu"
    src.write_text(
        "__global__ void twice(int* x) { x[threadIdx.x] *= 2; }\n"
        'extern "C" int tiny_answer(int a) { return a + 41; }\n'
    )
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def declare(L):
        L.tiny_answer.argtypes = [ctypes.c_int]
        L.tiny_answer.restype = ctypes.c_int

    lib = nvcc.CudaLibrary(src, "kvzt", lambda cap: FLAGS[:1], declare)
    L = lib.get((9, 0))
    assert L is not None, lib.failure((9, 0))
    assert L.tiny_answer(1) == 42
    so = nvcc.library_path(
        src.read_bytes(), FLAGS[:1], "kvzt", (9, 0), tmp_path / "cache" / "kvzip"
    )
    assert so.exists()
    mtime = so.stat().st_mtime_ns
    assert nvcc.CudaLibrary(src, "kvzt", lambda cap: FLAGS[:1], declare).get((9, 0)) is not None
    assert so.stat().st_mtime_ns == mtime
