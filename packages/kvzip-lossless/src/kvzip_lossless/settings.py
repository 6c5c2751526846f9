"""kvzip-lossless's environment settings: its section of kvzip's one table of settings.

kvzip's settings table lives in ``kvzip_formats.settings`` (the lowest package of the
formats/kernels/vllm/eval chain). kvzip-lossless depends on kvzip-formats only for its nvcc
build helper (``kvzip_formats.nvcc``, imported at the CUDA C coder's first use); its CPU coder
imports nothing of it. Its five rows are declared here, in the same shape (the same field
names as ``kvzip_formats.settings.Setting``, checked by a test), and
``kvzip_formats.settings.all_settings()`` adds them to the table when kvzip-lossless is
installed. The modules of this package read their settings through these rows only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

PACKAGE = "kvzip-lossless"


@dataclass(frozen=True)
class Setting:
    """One environment variable (see ``kvzip_formats.settings.Setting`` for the fields)."""

    name: str
    type: type
    default: object
    readers: tuple[str, ...]
    doc: str
    package: str = PACKAGE
    scope: str = "user"
    choices: tuple[str, ...] = ()
    default_doc: str | None = None
    key: str | None = None

    def raw(self, environ=None) -> str | None:
        """The variable's value, stripped; None when unset or empty."""
        value = (os.environ if environ is None else environ).get(self.name, "").strip()
        return value or None

    def value(self, given: str | None = None, environ=None):
        """``given`` (a call's own argument) if set, else the variable, else the default;
        the reader checks it against :attr:`choices` with its own message."""
        return given or self.raw(environ) or self.default


BACKEND = Setting(
    "KVZIP_LOSSLESS_BACKEND",
    str,
    None,
    ("kvzip_lossless.gpu",),
    "the GPU coder: `cuda` (the CUDA C coder; refuses with the reason where it cannot run) "
    "or `triton`",
    choices=("cuda", "triton"),
    default_doc="the CUDA C coder where it builds for the GPU, else Triton",
)
CPU_CODER = Setting(
    "KVZIP_LOSSLESS_CPU_CODER",
    str,
    None,
    ("kvzip_lossless.codec",),
    "the CPU coder: `numba` (compiled) or `numpy` (the reference)",
    choices=("numba", "numpy"),
    default_doc="numba where it imports, else numpy",
)
ENCODER = Setting(
    "KVZIP_LOSSLESS_ENCODER",
    str,
    "l1",
    ("kvzip_lossless.gpu_batch",),
    "the CUDA batched encoder's design (both write the same bytes; `smem` is the measured "
    "alternative, for comparing the two)",
    scope="bench",
    choices=("l1", "smem"),
)
DECODER = Setting(
    "KVZIP_LOSSLESS_DECODER",
    str,
    "l1",
    ("kvzip_lossless.gpu_batch",),
    "the CUDA batched decoder's design (both read the same bytes; `smem` is the measured "
    "alternative, for comparing the two)",
    scope="bench",
    choices=("l1", "smem"),
)
CUDA_SO = Setting(
    "KVZIP_LOSSLESS_CUDA_SO",
    str,
    None,
    ("kvzip_lossless._cuda",),
    "a prebuilt CUDA C coder library (skips the nvcc build)",
    default_doc="built with nvcc on first use, cached in `$XDG_CACHE_HOME/kvzip`",
)

#: kvzip-lossless's rows of the settings table.
SETTINGS = (BACKEND, CPU_CODER, ENCODER, DECODER, CUDA_SO)
