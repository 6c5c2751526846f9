"""Block views of vLLM's paged KV cache, without vLLM: the chunk's block ids, and the stock bf16
gather / scatter under their old names (the layouts themselves: :mod:`kvzip_vllm.core.pages`).

vLLM (0.32+) hands a connector one 4-D view per layer, ``[num_blocks, num_kv_heads,
block_size, 2 * head_size]`` bf16: the last axis is K then V of one (head, token), and the
physical order of the first three axes is the cache layout's (``LBNHC`` keeps a block's tokens
outermost, ``LBHNC`` its heads), so the view is strided and a block's K or V is not contiguous.
The tier stores a block per layer as token-major ``[block_size, kv_heads, head_size]`` tensors
(the codec's rows are tokens, with the previous token as context).
"""

from __future__ import annotations

import torch

from kvzip_vllm.core.pages import Bf16Pages, check_bf16


def as_ids(block_ids) -> tuple[int, ...]:
    """A chunk's paged-cache block ids as a tuple (an int: a chunk of one block)."""
    return (int(block_ids),) if isinstance(block_ids, int) else tuple(int(b) for b in block_ids)


def check_paged_cache(name: str, cache: torch.Tensor) -> None:
    """Raise ValueError unless ``cache`` is a bf16 ``[num_blocks, kv_heads, block_size,
    2 * head_size]`` view (what the stock attention backends give a connector)."""
    check_bf16(cache, name)


def gather_token_major(
    cache: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V of the blocks ``index``, contiguous token-major ``[n, block_size,
    kv_heads, head_size]`` each (:meth:`Bf16Pages.gather`)."""
    return Bf16Pages.of(cache).gather(cache, index)


def scatter_token_major(
    cache: torch.Tensor, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write token-major ``k``, ``v`` into the blocks ``index`` (:meth:`Bf16Pages.scatter`)."""
    Bf16Pages.of(cache).scatter(cache, index, k, v)
