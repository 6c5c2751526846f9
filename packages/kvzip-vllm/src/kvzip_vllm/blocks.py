"""Block views of vLLM's paged KV cache, without vLLM (the CUDA tier and its tests share them).

vLLM (0.32+) hands a connector one 4-D view per layer, ``[num_blocks, num_kv_heads,
block_size, 2 * head_size]`` bf16: the last axis is K then V of one (head, token), and the
physical order of the first three axes is the cache layout's (``LBNHC`` keeps a block's tokens
outermost, ``LBHNC`` its heads), so the view is strided and a block's K or V is not contiguous.
The tier stores a block per layer as token-major ``[block_size, kv_heads, head_size]`` tensors
(the codec's rows are tokens, with the previous token as context).
"""

from __future__ import annotations

import torch


def as_ids(block_ids) -> tuple[int, ...]:
    """A chunk's paged-cache block ids as a tuple (an int: a chunk of one block)."""
    return (int(block_ids),) if isinstance(block_ids, int) else tuple(int(b) for b in block_ids)


def check_paged_cache(name: str, cache: torch.Tensor) -> None:
    """Raise ValueError unless ``cache`` is a bf16 ``[num_blocks, kv_heads, block_size,
    2 * head_size]`` view (what the stock attention backends give a connector)."""
    if cache.dtype != torch.bfloat16 or cache.dim() != 4 or cache.shape[-1] % 2:
        raise ValueError(
            f"layer {name}: KV cache of dtype {cache.dtype} and shape {tuple(cache.shape)}; "
            "supported: a bfloat16 paged cache viewed as [num_blocks, num_kv_heads, block_size, "
            "2 * head_size] (the stock attention backends; not KVZIP_KV_FORMAT's packed cache)"
        )


def gather_token_major(
    cache: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V of the blocks ``index`` (int64, on the cache's device), contiguous
    token-major ``[n, block_size, kv_heads, head_size]`` each (two copies, any layout)."""
    d = cache.shape[-1] // 2
    blk = cache.index_select(0, index)  # [n, H, N, 2D], contiguous
    return (
        blk[..., :d].permute(0, 2, 1, 3).contiguous(),
        blk[..., d:].permute(0, 2, 1, 3).contiguous(),
    )


def scatter_token_major(
    cache: torch.Tensor, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write token-major ``k``, ``v`` ``[n, block_size, kv_heads, head_size]`` into the blocks
    ``index`` of one layer's cache view (its halves are strided views: written in place)."""
    d = cache.shape[-1] // 2
    cache[..., :d].index_copy_(0, index, k.permute(0, 2, 1, 3))
    cache[..., d:].index_copy_(0, index, v.permute(0, 2, 1, 3))
