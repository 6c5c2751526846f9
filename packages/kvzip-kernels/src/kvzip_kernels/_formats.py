"""What a kernel needs to know about a format: how its codes turn into numbers.

Each supported format maps to a ``KernelSpec``: the code family the Triton kernels implement,
the byte geometry (``kvzip_formats.ops.PagedLayout``) and the extra per-format constants
(fp8's per-tensor scales, the rotation a rotated format applies to K and V).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvzip_formats import FormatError, KVFormat, get_format
from kvzip_formats.ops import PagedLayout
from kvzip_formats.rotation import hadamard


@dataclass(frozen=True)
class KernelSpec:
    # "int4" (affine 4-bit codes, fp16 scale + zero), "fp8" (e4m3, tensor scale) or
    # "codebook" (the compact formats: Lloyd-Max codes, fp16 token scale, calibrated transform)
    family: str
    layout: PagedLayout  # K's pages
    k_scale: float = 1.0
    v_scale: float = 1.0
    rotation: torch.Tensor | None = None  # [D, D] float32; stored = x @ R, R symmetric orthonormal
    v_layout: PagedLayout | None = None  # V's pages where they differ from K's
    # codebook family: per kind, up to two channel groups as (bits, channels, offset of the
    # widest bit plane, offset of the 1-bit plane); None where the kernel cannot read the rows
    k_groups: tuple | None = None
    v_groups: tuple | None = None

    @property
    def vlay(self) -> PagedLayout:
        return self.v_layout or self.layout


def resolve(fmt: KVFormat | str) -> KVFormat:
    if isinstance(fmt, str):
        return get_format(fmt)
    if not isinstance(fmt, KVFormat):
        raise FormatError(f"fmt must be a format name or a KVFormat, got {type(fmt).__name__}")
    return fmt


SUPPORTED = ("fp8", "int4", "int4-rot", "4bit", "3.5bit", "3bit")


@functools.lru_cache(maxsize=256)
def kernel_spec(fmt: KVFormat, head_dim: int, block_size: int) -> KernelSpec:
    """The kernel-facing description of ``fmt``; FormatError for formats without kernels.
    Cached per (format object, head_dim, block_size): a call builds layouts and, for
    ``int4-rot``, a new rotation matrix whose device copy is cached by identity."""
    if head_dim not in (64, 128):
        raise FormatError(f"kvzip_kernels supports head_dim 64 and 128, got {head_dim}")
    if fmt.name in ("fp8", "int4", "int4-rot"):
        lay = PagedLayout.of(fmt, head_dim, block_size)
    if fmt.name == "fp8":
        return KernelSpec("fp8", lay, fmt.scales["k"], fmt.scales["v"])
    if fmt.name in ("int4", "int4-rot"):
        rot = hadamard(head_dim) if fmt.name == "int4-rot" else None
        return KernelSpec("int4", lay, rotation=rot)
    spec = getattr(fmt, "spec", None)
    if spec is not None and hasattr(spec, "k_groups"):
        layouts = {kind: spec.layout(head_dim, kind) for kind in ("k", "v")}
        return KernelSpec(
            "codebook",
            PagedLayout.of(fmt, head_dim, block_size, "k"),
            v_layout=PagedLayout.of(fmt, head_dim, block_size, "v"),
            k_groups=_kernel_groups(layouts["k"]),
            v_groups=_kernel_groups(layouts["v"]),
        )
    raise FormatError(
        f"format {fmt.name!r} has no kvzip_kernels implementation; "
        f"supported: {', '.join(SUPPORTED)}"
    )


def _kernel_groups(layout) -> tuple | None:
    """A compact row layout as the kernels' constants, or None if they cannot read it: at most
    two groups of 2, 3 or 4 bits whose channel classes reach tl.dot's smallest depth 16: 4-bit
    groups of >= 32 channels (2 classes), 2- and 3-bit groups of 32 (4 classes of 8, paired
    into 2 of 16 by the decode kernel: ``3bit`` at head_dim 64) or of >= 64 channels."""
    groups = []
    for g, (n, bits) in enumerate(layout.groups):
        per_class = n // 2 if bits == 4 else (n // 2 if n == 32 else n // 4)
        if bits not in (2, 3, 4) or per_class < 16 or per_class & (per_class - 1):
            return None
        planes = {p.width: p.offset for p in layout.planes if p.group == g}
        groups.append((bits, n, planes[4 if bits == 4 else 2], planes.get(1, 0)))
    if len(groups) > 2:
        return None
    return tuple(groups + [(0, 0, 0, 0)] * (2 - len(groups)))


def check_strided_cache(
    cache: torch.Tensor, lay, num_kv_heads: int | None, block_stride: int | None, name: str
) -> int:
    """Validate a paged cache; returns its block stride in bytes.

    ``block_stride=None``: the cache must be contiguous ``[num_blocks, num_kv_heads,
    page_bytes]``. Otherwise dimension 0 may be strided (vLLM keeps K and V of a block side by
    side: ``kv[:, 0]`` and ``kv[:, 1]`` of a ``[num_blocks, 2, heads, page_bytes]`` tensor),
    with ``cache.stride() == (block_stride, page_bytes, 1)``.
    """
    from kvzip_formats.ops import check_paged_cache

    if block_stride is None:
        check_paged_cache(cache, lay, num_kv_heads=num_kv_heads, name=name)
        return cache.shape[1] * lay.page_bytes
    check_paged_cache(
        cache[:1].contiguous() if cache.shape[0] else cache,
        lay,
        num_kv_heads=num_kv_heads,
        name=name,
    )
    want = (block_stride, lay.page_bytes, 1)
    if (
        cache.stride() != want
        or block_stride < cache.shape[1] * lay.page_bytes
        or block_stride % 16
    ):
        raise FormatError(
            f"{name} with block_stride={block_stride} must have strides {want} (block_stride a "
            f"multiple of 16, >= num_kv_heads * page_bytes), got {cache.stride()}"
        )
    return block_stride
