"""Build a CUDA source into a shared library with nvcc, cache it, load it with ctypes: the one
helper kvzip-lossless's coder (``kvzip_lossless._cuda``, csrc/kvzl.cu) and kvzip-kernels'
decode kernel (``kvzip_kernels._cuda``, csrc/paged_decode.cu) both use.

Plain CUDA with a C ABI, called through ctypes, compiles in seconds, where torch's extension
loader compiles torch's headers for about a minute; and it builds with the nvcc of the
``nvidia-cuda-nvcc`` wheel as well as a CUDA toolkit's.

Why here: kvzip-formats is the lowest package (it needs the standard library, numpy and
torch), and the two users are separately installable. kvzip-kernels already depends on it;
kvzip-lossless depends on it for this module (it adds no library kvzip-lossless did not
already install but safetensors). The other homes: kvzip-lossless, which kvzip-kernels would
then import (and importing ``kvzip_lossless`` imports numba, which vLLM's CPU worker must not
meet before it has set up its kernels, and numba would become a dependency of the kernels);
or a sixth package, which every installation path (the GPU sessions' ``PYTHONPATH``
included) would have to learn. The module itself imports the standard library and
``kvzip_formats.settings`` (torch's ``CUDA_HOME`` is read when nvcc is looked for);
kvzip-lossless imports it at its CUDA C coder's first use only.

Behaviour (as each package had it): ``KVZIP_NVCC`` names the nvcc, else torch's
``CUDA_HOME/bin/nvcc``, else ``nvcc`` on ``PATH``; a library is cached as
``$XDG_CACHE_HOME/kvzip/<prefix>-sm<XY>-<key>.so`` (``~/.cache/kvzip`` without
``XDG_CACHE_HOME``), ``key`` the first 16 hex digits of the SHA-256 of the source and the
flags; a prebuilt library (each package's ``*_CUDA_SO`` setting) skips the build. Where the
library cannot be built or loaded, :class:`CudaLibrary` records why and the caller falls back
or refuses with that reason.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from kvzip_formats.settings import NVCC

#: How to get an nvcc, for the error where none is found.
NVCC_HINT = (
    "set KVZIP_NVCC to an nvcc, install a CUDA toolkit (torch's CUDA_HOME/bin/nvcc), or put "
    "one on PATH (`pip install nvidia-cuda-nvcc` gives one; nvidia-cuda-runtime and "
    "nvidia-cuda-crt give its headers)"
)
#: Characters of nvcc's error output kept in the message of a failed build.
ERROR_TAIL = 800


def _cuda_home() -> str | None:
    from torch.utils.cpp_extension import CUDA_HOME  # the toolkit torch's extensions use

    return CUDA_HOME


def find_nvcc(cuda_home: Callable[[], str | None] = _cuda_home) -> str:
    """The nvcc that builds the kernels: ``KVZIP_NVCC``, torch's ``CUDA_HOME/bin/nvcc``, or
    ``nvcc`` on ``PATH``. FileNotFoundError (saying where it looked and how to get one) when
    there is none."""
    env = NVCC.raw()
    if env:
        return env
    home = cuda_home()
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found is None:
        raise FileNotFoundError(
            f"nvcc not found (looked at KVZIP_NVCC, CUDA_HOME/bin/nvcc with CUDA_HOME={home}, "
            f"PATH): {NVCC_HINT}"
        )
    return found


def cache_dir() -> Path:
    """Where built libraries are kept: ``$XDG_CACHE_HOME/kvzip``, else ``~/.cache/kvzip``."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvzip"


def cache_key(source: bytes, flags: Sequence[str]) -> str:
    """16 hex digits naming a build: the SHA-256 of the source and the space-joined flags."""
    return hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:16]


def library_path(
    source: bytes, flags: Sequence[str], prefix: str, capability: tuple[int, int], directory: Path
) -> Path:
    """The cached library of ``source`` built with ``flags`` for a GPU of ``capability``."""
    major, minor = capability
    return directory / f"{prefix}-sm{major}{minor}-{cache_key(source, flags)}.so"


def command(nvcc: str, src: Path, out: Path, flags: Sequence[str]) -> list[str]:
    """The nvcc command line: optimised, the architecture ``flags``, a shared library of
    position-independent code."""
    return [nvcc, "-O3", *flags, "-shared", "-Xcompiler", "-fPIC", "-o", str(out), str(src)]


def build(
    src: Path,
    flags: Sequence[str],
    *,
    prefix: str,
    capability: tuple[int, int],
    prebuilt: str | None = None,
    out_dir: Path | None = None,
    nvcc: str | None = None,
) -> Path:
    """The library of ``src`` for ``capability``: ``prebuilt`` when it names a file, else the
    cached build (built now, with nvcc, when missing: written under a temporary name and
    renamed, so concurrent builders do not read a half-written file). RuntimeError with
    nvcc's command and error output when the build fails; FileNotFoundError when there is no
    nvcc (:func:`find_nvcc`)."""
    if prebuilt and Path(prebuilt).exists():
        return Path(prebuilt)
    source = Path(src).read_bytes()
    directory = out_dir or cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    so = library_path(source, flags, prefix, capability, directory)
    if not so.exists():
        tmp = so.with_suffix(f".{os.getpid()}.so")
        cmd = command(nvcc or find_nvcc(), Path(src), tmp, flags)
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"nvcc failed ({' '.join(cmd)}): {r.stderr.strip()[-ERROR_TAIL:]}")
        tmp.replace(so)
    return so


class CudaLibrary:
    """One CUDA source's library per GPU architecture, built (:func:`build`) and loaded on
    first use; where that fails, the reason is kept and :meth:`get` returns None.

    ``arch_flags(capability)``: the nvcc flags for a GPU (ValueError for one the source does
    not support, with what it supports); ``declare(lib)``: sets the entry points' argtypes;
    ``prebuilt()``: a prebuilt library's path or None (read at each build, from the package's
    setting); ``logger``: where a failure is logged as a warning (None: not logged, the caller
    reports it)."""

    def __init__(
        self,
        src: Path,
        prefix: str,
        arch_flags: Callable[[tuple[int, int]], list[str]],
        declare: Callable[[ctypes.CDLL], None],
        prebuilt: Callable[[], str | None] = lambda: None,
        what: str = "CUDA library",
        logger: logging.Logger | None = None,
    ):
        self.src, self.prefix, self.what = Path(src), prefix, what
        self.arch_flags, self.declare, self.prebuilt = arch_flags, declare, prebuilt
        self.logger = logger
        self.libs: dict[tuple[int, int], ctypes.CDLL] = {}
        self.failed: dict[tuple[int, int], str] = {}

    def build(self, capability: tuple[int, int], out_dir: Path | None = None) -> Path:
        """The library file for ``capability`` (built when not cached)."""
        return build(
            self.src,
            self.arch_flags(capability),
            prefix=self.prefix,
            capability=capability,
            prebuilt=self.prebuilt(),
            out_dir=out_dir,
        )

    def get(self, capability: tuple[int, int]) -> ctypes.CDLL | None:
        """The loaded library for ``capability``, or None where it cannot be built or loaded
        (the reason: :meth:`failure`)."""
        cap = tuple(int(c) for c in capability)
        if cap not in self.libs and cap not in self.failed:
            try:
                lib = ctypes.CDLL(str(self.build(cap)))
                self.declare(lib)
                self.libs[cap] = lib
            except (OSError, RuntimeError, ValueError, FileNotFoundError) as e:
                self.failed[cap] = f"{type(e).__name__}: {e}"
                if self.logger is not None:
                    self.logger.warning(
                        "%s unavailable on sm_%d%d: %s", self.what, cap[0], cap[1], e
                    )
        return self.libs.get(cap)

    def failure(self, capability: tuple[int, int]) -> str | None:
        """Why the library is not available for ``capability`` (None when it is)."""
        cap = tuple(int(c) for c in capability)
        return None if self.get(cap) is not None else self.failed.get(cap)
