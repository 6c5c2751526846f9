"""The CUDA C coder (csrc/kvzl.cu), built with nvcc on first use for the GPU at hand (its
compute capability: :func:`arch_flags`), called through ctypes. Where it cannot be built or
loaded (no nvcc, an nvcc too old for the GPU, a GPU too old) the Triton coder runs instead
(``gpu.default_backend``), and the reason is logged.

Why not only Triton: the Triton decoder (gpu.py) measured 135 GB/s on the H200
(results/lossless/gpu/lossless_gpu_h200_run1.json): each row costs a 32-lane scan plus a reduction
where CUDA needs one __ballot_sync and two __popc. Why not torch's load_inline: it compiles
torch's headers (about a minute); this file is plain CUDA (10 s) with a C ABI. The build,
its cache and the loading are ``kvzip_formats.nvcc``'s (shared with kvzip-kernels).
Set KVZIP_LOSSLESS_CUDA_SO to a prebuilt library to skip the build; KVZIP_NVCC names an nvcc.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kvzip_lossless import _torch, settings

_SRC = Path(__file__).parent / "csrc" / "kvzl.cu"
#: The oldest GPU the kernels are written for (``__ballot_sync``, 32-bit atomics: Volta on).
MIN_CAPABILITY = (7, 0)


def arch_flags(capability: tuple[int, int]) -> list[str]:
    """nvcc flags that build csrc/kvzl.cu for a GPU of compute ``capability`` (major, minor):
    its machine code (``sm_XY``) and its PTX (``compute_XY``, which the driver can JIT for a
    newer GPU). The kernels use no arch-specific instructions, so no ``sm_XYa`` variant.
    Raises ValueError for a GPU older than :data:`MIN_CAPABILITY`."""
    major, minor = (int(c) for c in capability)
    if (major, minor) < MIN_CAPABILITY or not 0 <= minor <= 9:
        raise ValueError(
            f"compute capability {major}.{minor} is not supported by the CUDA C coder "
            f"(needs >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}); the Triton coder is used"
        )
    cc = f"{major}{minor}"
    return [
        f"-gencode=arch=compute_{cc},code=sm_{cc}",
        f"-gencode=arch=compute_{cc},code=compute_{cc}",
    ]


def _declare(L: ctypes.CDLL) -> None:
    P, I, LL = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    L.kvzl_decode_launch.argtypes = [P, P, I, P, P, P, I, I, P, P, P, P]
    L.kvzl_encode_launch.argtypes = [P, P, I, P, P, P, I, I, I, P, P, P, P]
    L.kvzl_pack_launch.argtypes = [P, LL, LL, P, I, P, P, P, P]
    L.kvzl_compact_launch.argtypes = [P, P, P, I, I, P, P]
    L.kvzl_benc_launch.argtypes = [P, P, I, P, P, P, P, P, P, P, P, P, LL, P]
    L.kvzl_basm_launch.argtypes = [P, P, P, P, P, I, P]
    L.kvzl_bmant_launch.argtypes = [P, P, P, I, LL, P]
    L.kvzl_bhead_launch.argtypes = [P, P, I, P, P]
    L.kvzl_bdec_launch.argtypes = [P, P, P, P, P, P, I, P, P, P, P, P, P, P]
    L.kvzl_bdec_smem_launch.argtypes = [P, P, P, P, P, P, I, I, P, P, P, P, P, P, P]
    L.kvzl_bfold_launch.argtypes = [P, P, P, P, P, I, P, P]
    L.kvzl_benc_smem_launch.argtypes = [P, P, I, P, P, P, I, P, P, P, P, P, P, LL, P]


_LIB = None


def _library():
    """The coder's ``kvzip_formats.nvcc.CudaLibrary`` (made on the first GPU use: the CPU coder
    never imports kvzip_formats)."""
    global _LIB
    if _LIB is None:
        from kvzip_formats.nvcc import CudaLibrary

        _LIB = CudaLibrary(
            _SRC, "kvzl", arch_flags, _declare, prebuilt=settings.CUDA_SO.raw, what="CUDA C coder"
        )
    return _LIB


def capability_of(device=None) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device))


def lib(device=None):
    """The CUDA C coder built for ``device``'s GPU (None: the current one), or None when it
    cannot be built or loaded there (the reason: :func:`failure`). Built and loaded by
    ``kvzip_formats.nvcc`` (nvcc from ``KVZIP_NVCC``, torch's ``CUDA_HOME`` or ``PATH``;
    cached in ``$XDG_CACHE_HOME/kvzip``)."""
    return _library().get(capability_of(device))


def failure(device=None) -> str | None:
    """Why the CUDA C coder is not available on ``device`` (None when it is)."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    return _library().failure(capability_of(device))


def available(device=None) -> bool:
    """True when the CUDA C coder is built for (and loaded on) ``device``'s GPU."""
    return failure(device) is None


def _ptr(t: torch.Tensor):
    return ctypes.c_void_p(t.data_ptr())


def _stream():
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def _check(rc: int, what: str) -> None:
    if rc:
        raise RuntimeError(f"kvzip-lossless CUDA {what} launch failed: cudaError {rc}")


def decode(blob_dev, desc, n_chunks, cum16, bmap, base, C, NB, out16, sums, err) -> None:
    """One-blob decode (``gpu.launch_decode``); ``cum16``: the table's cumulative frequencies
    (``_torch.cum_tensor``)."""
    _check(
        lib(blob_dev.device).kvzl_decode_launch(
            _ptr(blob_dev),
            _ptr(desc),
            n_chunks,
            _ptr(cum16),
            _ptr(bmap),
            _ptr(base),
            C,
            NB,
            _ptr(out16),
            _ptr(sums),
            _ptr(err),
            _stream(),
        ),
        "decode",
    )


def encode_parts(x: torch.Tensor, table, cols: int, rpt: int, tabs) -> dict:
    """The outputs of ``gpu.encode_parts`` (its contract), from the CUDA kernels."""
    dev = x.device
    tab, bmap, base = tabs
    flat16 = x.contiguous().view(-1).view(torch.int16)
    n_all = flat16.numel()
    rows = n_all // cols
    desc, n_tiles, nch = _torch.encode_desc(rows, cols, rpt, dev)
    n_prog = n_tiles * nch
    scratch = torch.empty(n_prog * rpt * 32, dtype=torch.int16, device=dev)
    counts = torch.empty(n_prog, dtype=torch.int32, device=dev)
    states = torch.empty(n_tiles * cols, dtype=torch.int32, device=dev)
    L = lib(dev)
    _check(
        L.kvzl_encode_launch(
            _ptr(flat16),
            _ptr(desc),
            n_prog,
            _ptr(tab),
            _ptr(bmap),
            _ptr(base),
            cols,
            table.n_buckets,
            rpt,
            _ptr(scratch),
            _ptr(counts),
            _ptr(states),
            _stream(),
        ),
        "encode",
    )
    c64 = counts.to(torch.int64)
    starts = torch.cumsum(c64, 0) - c64
    total = int(c64.sum())
    words = torch.empty(total, dtype=torch.int16, device=dev)
    _check(
        L.kvzl_compact_launch(
            _ptr(scratch), _ptr(counts), _ptr(starts), n_prog, rpt, _ptr(words), _stream()
        ),
        "compact",
    )
    esc = torch.empty(n_all, dtype=torch.uint8, device=dev)
    sums = torch.zeros(n_tiles, dtype=torch.int32, device=dev)
    mants = []
    full, last = divmod(rows, rpt)
    groups = [(0, full, rpt)] if full else []
    if last:
        groups.append((full, 1, last))
    for t0, nt, r in groups:
        n = r * cols
        seg = flat16[t0 * rpt * cols :]
        if n % 8 == 0:
            mant = torch.empty(nt * n // 8 * 7, dtype=torch.uint8, device=dev)
            _check(
                L.kvzl_pack_launch(
                    _ptr(seg),
                    nt * n // 8,
                    n,
                    _ptr(base),
                    cols,
                    _ptr(mant),
                    _ptr(sums[t0:]),
                    _ptr(esc[t0 * rpt * cols :]),
                    _stream(),
                ),
                "pack",
            )
            mants += list(mant.view(nt, -1).unbind(0))
        else:  # odd-sized tiles: the torch path
            v = seg[: nt * n].to(torch.int32) & 0xFFFF
            for i in range(nt):
                vi = v[i * n : (i + 1) * n]
                mants += _torch.pack_mantissas(vi, r, cols, r)
                sums[t0 + i] = _torch.checksum(vi.to(torch.int16)).to(torch.int32)
                colidx = torch.arange(n, device=dev) % cols
                es = ((vi >> 7) & 255) - base[colidx] + 12
                esc[(t0 + i) * rpt * cols :][:n] = ((es < 1) | (es > 15)).to(torch.uint8)
    return dict(
        counts=counts,
        states=states,
        words=words,
        esc=esc.bool(),
        mant=mants,
        sums=sums.to(torch.int64) & 0xFFFFFFFF,
        n_tiles=n_tiles,
        nch=nch,
        rows=rows,
    )


# Batched kernels (gpu_batch.py builds their descriptors; spec/blob.md section 9).
def batch_encode(flat, desc, n_items, tab, bmap, base, scratch, counts, states, sums, ecnt,
                 ebuf, ecap, encoder="l1", max_nb=1) -> None:  # fmt: skip
    """``encoder``: ``"l1"`` (table entries read per lane through L1, integer division) or
    ``"smem"`` (each lane's entries staged in shared memory, division by a float reciprocal
    with one correction; ``max_nb``: the batch's largest bucket count, sizing it)."""
    L = lib(flat.device)
    ptrs = [_ptr(t) for t in (flat, desc)]
    out = [_ptr(t) for t in (scratch, counts, states, sums, ecnt, ebuf)]
    tabs = [_ptr(t) for t in (tab, bmap, base)]
    if encoder == "smem":
        rc = L.kvzl_benc_smem_launch(*ptrs, n_items, *tabs, int(max_nb), *out, int(ecap), _stream())
    elif encoder == "l1":
        rc = L.kvzl_benc_launch(*ptrs, n_items, *tabs, *out, int(ecap), _stream())
    else:
        raise ValueError(f"unknown CUDA encoder {encoder!r}: 'l1' or 'smem'")
    _check(rc, "batch encode")


def batch_assemble(flat, data, scratch, states, asm, n_items) -> None:
    L = lib(flat.device)
    args = [_ptr(t) for t in (flat, data, scratch, states, asm)]
    _check(L.kvzl_basm_launch(*args, n_items, _stream()), "batch assemble")


def batch_mant(flat, data, tdesc, n_tiles, max_nv) -> None:
    L = lib(flat.device)
    args = [_ptr(t) for t in (flat, data, tdesc)]
    _check(L.kvzl_bmant_launch(*args, n_tiles, int(max_nv), _stream()), "batch mantissa")


def batch_check(data, bdesc, n, bad) -> None:
    L = lib(data.device)
    _check(L.kvzl_bhead_launch(_ptr(data), _ptr(bdesc), n, _ptr(bad), _stream()), "batch check")


def batch_decode(data, cum16, bmap, base, bdesc, items, n_items, out16, sums, expect, ecount,
                 nexp, bad, decoder="l1", max_nb=1) -> None:  # fmt: skip
    """``decoder``: ``"l1"`` (each lane reads its column's table row from global memory through
    L1) or ``"smem"`` (the item's 32 columns' rows staged once in shared memory,
    lane-interleaved; ``max_nb``: the batch's largest bucket count, sizing it)."""
    L = lib(data.device)
    a = [_ptr(t) for t in (data, cum16, bmap, base, bdesc, items)]
    b = [_ptr(t) for t in (out16, sums, expect, ecount, nexp, bad)]
    if decoder == "smem":
        rc = L.kvzl_bdec_smem_launch(*a, n_items, int(max_nb), *b, _stream())
    elif decoder == "l1":
        rc = L.kvzl_bdec_launch(*a, n_items, *b, _stream())
    else:
        raise ValueError(f"unknown CUDA decoder {decoder!r}: 'l1' or 'smem'")
    _check(rc, "batch decode")


def batch_fold(sums, expect, ecount, nexp, tblob, n_tiles, bad) -> None:
    """Tile checks into blob flags (``tblob``: each tile's blob, int32, on the device or in
    page-locked host memory)."""
    L = lib(bad.device)
    a = [_ptr(t) for t in (sums, expect, ecount, nexp, tblob)]
    _check(L.kvzl_bfold_launch(*a, n_tiles, _ptr(bad), _stream()), "batch fold")
