"""The CUDA C++ split-KV decode kernel (csrc/paged_decode.cu), built with nvcc at first use for
the GPU at hand and cached, called through ctypes (as kvzip-lossless builds its coder: plain
CUDA with a C ABI compiles in seconds, where torch's extension loader compiles torch's
headers for about a minute; and it builds with the nvcc of the ``nvidia-cuda-nvcc`` wheel). The
build, its cache and the loading are ``kvzip_formats.nvcc``'s (shared with kvzip-lossless).

It replaces only the split stage of ``paged_decode``: it writes the same partial outputs and
base-2 log-sum-exps as the Triton split kernels, and the Triton merge (plus, for the compact
formats, the output transform and the sink merge) runs after it.

Formats: ``int4``, ``int4-rot`` (the wrapper rotates q and the output), ``4bit``, ``3.5bit`` and
``3bit`` (rows as spec/4bit.md section 5 lays them out, checked against the format's layout
before a call is sent here); head_dim 64 and 128; at most 8 query heads per KV head; page
sizes that are multiples of 16. ``paged_decode(..., backend=)`` or ``KVZIP_KERNELS_BACKEND``
(``auto``, ``cuda``, ``triton``) choose; ``auto`` takes CUDA on sm_90 where it builds, else
Triton. The kernel is design v6 (32-token tiles through a per-warp cp.async ring of 2
shared-memory stages, per-lane copies of the codebook tables read by 3-instruction lookups),
chosen over v5 by measurement (NOTES.md:
``results/kernels/paged_decode/bench_paged_decode_v6.md``, H200, full grid, same run:
geometric-mean speedup over the best fp8 int4 1.61x (v5 1.49x), 4bit 1.37x (1.15x), 3.5bit
1.30x (0.97x), 3bit 1.29x (0.90x)); v5's and v4a's sources are in git history (NOTES.md says
where). ``DecodeConfig(cuda_variant=)`` picks a design (:data:`VARIANTS`): ``v6`` or v7 (NOTES.md
"v7": v6's layout, bytes and values; 64-token softmax tiles and branch-free copies) with 2
(``v7``) or 4 (``v7s4``) ring slots of 32 tokens per warp; ``auto`` (the default) takes each
format's measured best (:data:`SHIPPED`).
``KVZIP_KERNELS_CUDA_SO`` names a prebuilt library (skips the build); ``KVZIP_NVCC`` an nvcc.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from kvzip_formats import FormatError
from kvzip_formats import nvcc as nvcc_build
from kvzip_formats.settings import KERNELS_BACKEND, KERNELS_CUDA_SO

log = logging.getLogger(__name__)

_SRC = Path(__file__).parent / "csrc" / "paged_decode.cu"
#: mma.sync m16n8k16 with bf16 operands and movmatrix: Ampere and newer.
MIN_CAPABILITY = (8, 0)
#: The GPUs ``backend="auto"`` sends to CUDA (the kernel is tuned for Hopper).
AUTO_CAPABILITIES = ((9, 0),)
MAX_GROUP = 8  # query heads per KV head: the N = 8 of the mma
FORMATS = {"int4": 0, "int4-rot": 0, "4bit": 1, "3.5bit": 2, "3bit": 3}
BACKENDS = KERNELS_BACKEND.choices  # ("auto", "cuda", "triton")
#: The split kernel's designs (``DecodeConfig(cuda_variant=)``): name -> (design, ring slots of
#: 32 tokens per warp). ``v6`` is the shipped one; ``v7``/``v7s4`` the research design v7 (same
#: bytes and decoded values, 64-token softmax tiles, branch-free copies; NOTES.md "v7").
VARIANTS = {"v6": (6, 2), "v7": (7, 2), "v7s4": (7, 4)}
#: ``cuda_variant="auto"``: the design each format runs (v6 for the others). v7 for ``3.5bit``
#: and ``3bit``: on an H100 beside v6 in one run (``results/kernels/paged_decode/h100_v7/``,
#: 8B and 70B-TP8, batch 8-64, 32k and 128k) it was as fast or faster in 15 of 16
#: configurations each, by up to 8% where v6 is bound by instruction issue (8B, 128k); for
#: int4 and ``4bit`` (bytes-bound there) the two were within noise, and v6 stays.
SHIPPED = {"3.5bit": "v7", "3bit": "v7"}


def check_variant(variant: str, *, auto: bool = False) -> None:
    """ValueError naming the designs unless ``variant`` is one of :data:`VARIANTS` (or
    ``auto`` where ``auto`` is allowed)."""
    if variant not in VARIANTS and not (auto and variant == "auto"):
        names = (["auto"] if auto else []) + list(VARIANTS)
        raise ValueError(
            f"cuda_variant must be one of {', '.join(map(repr, names))}, got {variant!r}"
        )


def addresses(variant: str, k_blk_stride: int, v_blk_stride: int) -> bool:
    """Whether design ``variant`` (a key of :data:`VARIANTS`) can address a cache of these
    block strides (bytes): v7 and its kin index blocks in 32 bits (below 2**31 bytes)."""
    return VARIANTS[variant][0] != 7 or max(k_blk_stride, v_blk_stride) < 1 << 31


def resolve_variant(
    variant: str, fmt_name: str, k_blk_stride: int = 0, v_blk_stride: int = 0
) -> str:
    """The design a plan runs: ``variant`` itself, or for ``auto`` the format's shipped one
    (:data:`SHIPPED`, v6 otherwise), v6 where v7 cannot address the cache (a block stride of
    2**31 bytes or more)."""
    check_variant(variant, auto=True)
    if variant != "auto":
        return variant
    v = SHIPPED.get(fmt_name, "v6")
    return v if addresses(v, k_blk_stride, v_blk_stride) else "v6"


def expected_groups(fmt_name: str, d: int) -> tuple[tuple, tuple] | None:
    """The (K, V) row groups the kernel has compiled in for a compact format at head_dim ``d``,
    in ``_formats.KernelSpec``'s form (bits, channels, widest-plane offset, 1-bit-plane offset;
    spec/4bit.md section 5); None for the others."""
    none = (0, 0, 0, 0)
    four = ((4, d, 0, 0), none)
    return {
        "4bit": (four, four),
        "3.5bit": (four, ((3, d, 0, d // 4), none)),
        "3bit": (
            ((4, d // 2, 0, 0), (3, d // 2, d // 4, d // 4 + d // 8)),
            ((3, d // 2, 0, d // 4), (2, d // 2, d // 8, 0)),
        ),
    }.get(fmt_name)


def level_table(spec, device) -> torch.Tensor:
    """fp16 ``[4, 16]`` on ``device``: the ascending codebook levels of K's groups 0 and 1 and
    V's groups 0 and 1 (code c -> row[c]), the kernel's input for its level-pair tables; a K
    without a second group carries the 3-bit levels in row 1 where V has them (the kernel's tables
    are per code width, and every group of a width has the same levels)."""
    return _level_table(spec.k_groups, spec.v_groups, str(device))


@functools.lru_cache(maxsize=64)
def _level_table(k_groups, v_groups, device) -> torch.Tensor:
    from kvzip_formats.compact import codebook

    t = torch.zeros(4, 16, dtype=torch.float16)
    widths = [g[0] for g in (*k_groups, *v_groups)]
    for i, bits in enumerate(widths):
        if bits:
            t[i, : 1 << bits] = codebook.levels(bits).to(torch.float16)
    # the kernel keeps one table per code width (row 0: 4-bit, row 1: 3-bit, row 3: 2-bit); K's
    # unused second row carries 3.5bit's 3-bit V levels
    if 3 in widths and widths[1] == 0:
        t[1, :8] = codebook.levels(3).to(torch.float16)
    for i, bits in enumerate(widths):
        want = {4: 0, 3: 1, 2: 3}.get(bits)
        if want is not None and not torch.equal(t[i], t[want]):
            raise AssertionError(f"levels of {bits}-bit groups differ: {t[i]} vs {t[want]}")
    return t.to(device)


def arch_flags(capability: tuple[int, int]) -> list[str]:
    """nvcc flags for a GPU of compute ``capability``: its machine code and PTX; Hopper (9.0)
    gets ``sm_90a``. ValueError below :data:`MIN_CAPABILITY`."""
    major, minor = (int(c) for c in capability)
    if (major, minor) < MIN_CAPABILITY:
        raise ValueError(
            f"compute capability {major}.{minor} is not supported by the CUDA decode kernel "
            f"(mma.sync with bf16 needs >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]})"
        )
    cc = f"{major}{minor}"
    sm = f"{cc}a" if (major, minor) == (9, 0) else cc
    return [
        f"-gencode=arch=compute_{sm},code=sm_{sm}",
        f"-gencode=arch=compute_{sm},code=compute_{sm}",
    ]


def nvcc() -> str:
    """The nvcc that builds the kernel: ``KVZIP_NVCC``, torch's CUDA_HOME, or PATH
    (``kvzip_formats.nvcc.find_nvcc``; FileNotFoundError saying how to get one)."""
    return nvcc_build.find_nvcc()


def _declare(L: ctypes.CDLL) -> None:
    P, I, LL, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float
    L.kvzd_split_launch.argtypes = [
        I, I, P, P, P, P, P, P, P, P, P, F, LL, I, I, I, LL, LL, LL, LL, I, I, I, I, P
    ]  # fmt: skip
    L.kvzd_split_launch.restype = I
    L.kvzd_ctas_per_sm.argtypes = [I, I]
    L.kvzd_ctas_per_sm.restype = I
    L.kvzd_split_launch_v7.argtypes = [*L.kvzd_split_launch.argtypes, I]  # + ring slots
    L.kvzd_split_launch_v7.restype = I
    L.kvzd_ctas_per_sm_v7.argtypes = [I, I, I]
    L.kvzd_ctas_per_sm_v7.restype = I


#: The kernel's library per GPU architecture (built, cached and loaded by kvzip_formats.nvcc).
_LIB = nvcc_build.CudaLibrary(
    _SRC,
    "kvzd",
    arch_flags,
    _declare,
    prebuilt=KERNELS_CUDA_SO.raw,
    what="kvzip-kernels: CUDA decode kernel",
    logger=log,
)


def build(capability: tuple[int, int], out_dir: Path | None = None) -> Path:
    """Compile csrc/paged_decode.cu for ``capability`` (cached by source and flags)."""
    return _LIB.build(tuple(capability), out_dir=out_dir)


def _capability(device) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device))


def lib(device):
    """The kernel library for ``device``'s GPU, or None where it cannot be built or loaded
    (the reason: :func:`failure`)."""
    return _LIB.get(_capability(device))


def failure(device) -> str | None:
    """Why the CUDA kernel cannot run on ``device`` (None when it can)."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return f"the CUDA decode kernel needs a CUDA device, got {device}"
    return _LIB.failure(_capability(device))


def refusal(fmt_name: str, spec, group: int, device) -> str | None:
    """Why this call cannot take the CUDA kernel (None if it can): format, shape, GPU."""
    if fmt_name not in FORMATS:
        return f"format {fmt_name!r} has no CUDA decode kernel (CUDA: {', '.join(FORMATS)})"
    want = expected_groups(fmt_name, spec.layout.head_dim)
    if want is not None and (spec.k_groups, spec.v_groups) != want:
        return (
            f"{fmt_name} rows of groups K {spec.k_groups}, V {spec.v_groups} are not the "
            f"layout the CUDA kernel reads (K {want[0]}, V {want[1]})"
        )
    if group > MAX_GROUP:
        return f"{group} query heads per KV head; the CUDA kernel takes at most {MAX_GROUP}"
    if spec.layout.block_size % 16:
        return f"block_size {spec.layout.block_size} is not a multiple of 16"
    return failure(device)


def choose(backend: str | None, fmt_name: str, spec, group: int, device) -> str:
    """``"cuda"`` or ``"triton"`` for this call. ``backend`` (or ``KVZIP_KERNELS_BACKEND``):
    ``auto`` (default) takes CUDA on sm_90 when it can; ``cuda`` raises where it cannot."""
    want = KERNELS_BACKEND.value(backend)
    if want not in BACKENDS:
        raise FormatError(f"backend must be one of {BACKENDS}, got {want!r}")
    if want == "triton":
        return "triton"
    dev = torch.device(device)
    if want == "auto":
        if dev.type != "cuda" or _capability(dev) not in AUTO_CAPABILITIES:
            return "triton"
        return "cuda" if refusal(fmt_name, spec, group, dev) is None else "triton"
    why = refusal(fmt_name, spec, group, dev)
    if why is not None:
        raise FormatError(f"backend='cuda' cannot run this call: {why}")
    return "cuda"


def ctas_per_sm(fmt_name: str, head_dim: int, device, variant: str = "v6") -> int:
    """CTAs of the split kernel (design ``variant``) for this format and head_dim resident per
    SM on ``device`` (CUDA's occupancy calculator with the kernel's registers and shared
    memory; 0 where it cannot say)."""
    check_variant(variant)
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return _ctas_per_sm(FORMATS[fmt_name], head_dim, index, variant)


@functools.lru_cache(maxsize=64)
def _ctas_per_sm(fmt: int, head_dim: int, index: int, variant: str = "v6") -> int:
    design, slots = VARIANTS[variant]
    with torch.cuda.device(index):
        L = lib(torch.device("cuda", index))
        if design == 6:
            return int(L.kvzd_ctas_per_sm(fmt, head_dim))
        return int(L.kvzd_ctas_per_sm_v7(fmt, head_dim, slots))


def _ptr(t: torch.Tensor | None):
    return ctypes.c_void_p(0 if t is None else t.data_ptr())


def split(
    fmt_name: str,
    q: torch.Tensor,
    qs: torch.Tensor | None,
    lut16: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    o_part: torch.Tensor,
    lse: torch.Tensor,
    qk_scale: float,
    *,
    num_kv_heads: int,
    k_page_bytes: int,
    v_page_bytes: int,
    k_blk_stride: int,
    v_blk_stride: int,
    block_size: int,
    tokens_per_split: int,
    num_splits: int,
    skip: int = 0,
    variant: str = "v6",
) -> None:
    """Launch the split stage on the current stream (inputs validated by ``paged_decode``;
    ``q`` contiguous: bf16 for int4, the fp16 q' of the compact formats with ``qs`` and the
    level table ``lut16`` (:func:`level_table`)); ``variant``: a key of :data:`VARIANTS`."""
    check_variant(variant)
    design, slots = VARIANTS[variant]
    if not addresses(variant, k_blk_stride, v_blk_stride):
        raise FormatError(
            f"cuda_variant {variant!r} takes block strides below 2**31 bytes, got "
            f"{k_blk_stride} and {v_blk_stride}; use cuda_variant='v6'"
        )
    b, hq, d = q.shape
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.data_ptr() % 16:  # cp.async and the vector loads read 16-byte aligned pages
            raise FormatError(
                f"{name} must start 16-byte aligned for the CUDA kernel (data_ptr % 16 = "
                f"{t.data_ptr() % 16}); use backend='triton' for this cache"
            )
    L = lib(q.device)
    fn, extra = (L.kvzd_split_launch, ()) if design == 6 else (L.kvzd_split_launch_v7, (slots,))
    rc = fn(
        FORMATS[fmt_name],
        d,
        _ptr(q),
        _ptr(qs),
        _ptr(lut16),
        _ptr(k_cache),
        _ptr(v_cache),
        _ptr(block_table),
        _ptr(seq_lens),
        _ptr(o_part),
        _ptr(lse),
        ctypes.c_float(qk_scale),
        block_table.stride(0),
        b,
        num_kv_heads,
        hq // num_kv_heads,
        k_page_bytes,
        v_page_bytes,
        k_blk_stride,
        v_blk_stride,
        block_size,
        tokens_per_split,
        num_splits,
        skip,
        ctypes.c_void_p(torch.cuda.current_stream(q.device).cuda_stream),
        *extra,
    )
    if rc:
        raise RuntimeError(f"kvzip-kernels CUDA decode launch failed: error {rc}")
