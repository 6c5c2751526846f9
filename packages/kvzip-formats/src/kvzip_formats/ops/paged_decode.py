"""Reference paged decode attention on kvzip's paged layout (``spec/paged_layout.md``).

One query token per sequence, ``q [batch, num_q_heads, head_dim]``; query head ``i`` attends
with KV head ``i // (num_q_heads // num_kv_heads)`` (GQA) over the sequence's first
``seq_lens[b]`` tokens, read through ``block_table[b]``. K and V are the format's decoded
(float32) values, so the reference is exact attention on what the cache holds.
"""

from __future__ import annotations

import math

import torch

from kvzip_formats.base import FormatError, KVFormat
from kvzip_formats.ops.cache_write import PagedLayout, check_paged_cache, gather_rows


def check_decode_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    lay: PagedLayout,
    v_lay: PagedLayout | None = None,
) -> None:
    """Shapes and dtypes of a paged decode call; raises FormatError naming the argument.
    ``v_lay``: V's page geometry where it differs from K's (``lay``)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise FormatError(f"q must be [batch, num_q_heads, head_dim], got {getattr(q, 'shape', q)}")
    b, hq, d = q.shape
    if d != lay.head_dim:
        raise FormatError(f"q has head_dim {d}, the cache layout has {lay.head_dim}")
    check_paged_cache(k_cache, lay, name="k_cache")
    check_paged_cache(v_cache, v_lay or lay, name="v_cache")
    if v_cache.shape[:2] != k_cache.shape[:2]:
        raise FormatError(
            f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}"
        )
    hkv = k_cache.shape[1]
    if hq % hkv:
        raise FormatError(
            f"num_q_heads {hq} (q shape {tuple(q.shape)}) is not a multiple of "
            f"num_kv_heads {hkv} (k_cache shape {tuple(k_cache.shape)})"
        )
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != b:
        raise FormatError(
            f"block_table must be int32 [batch={b}, max_blocks], got "
            f"{block_table.dtype} {tuple(block_table.shape)}"
        )
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (b,):
        raise FormatError(
            f"seq_lens must be int32 [batch={b}], got {seq_lens.dtype} {tuple(seq_lens.shape)}"
        )


def paged_decode(
    fmt: KVFormat,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    block_size: int,
    layer: int = 0,
    sm_scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    sinks: tuple[torch.Tensor, torch.Tensor] | None = None,
    recent: tuple[torch.Tensor, torch.Tensor] | None = None,
    recent_from: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention, ``[batch, num_q_heads, head_dim]`` in ``compute_dtype``.

    ``compute_dtype=torch.float32``: the reference. ``torch.bfloat16``: the same math as plain
    torch does it in bf16 (K, V, q, scores, probabilities and output rounded to bf16), whose
    error against the reference sets a kernel's earned tolerance. ``sinks``: the bf16 copies
    ``(k, v)``, each ``[batch, n_sink, num_kv_heads, head_dim]``, of each sequence's first
    ``n_sink`` tokens, read instead of their rows (spec/4bit.md section 8). ``recent``: a
    residual window (spec/residual_window.md), the bf16 copies ``(k, v)``, each ``[batch, R,
    num_kv_heads, head_dim]``, of each sequence's last ``R`` tokens, right-aligned (entry ``j``
    is position ``seq_lens[b] - R + j``), read instead of their rows; entries at positions
    before the sinks (or before 0) are ignored, and with ``recent_from`` (int ``[batch]``) those
    before ``recent_from[b]`` too (their rows are read: a window that holds only its later
    positions).
    """
    check_window(recent, "recent", q, k_cache.shape[1])
    lay = PagedLayout.of(fmt, q.shape[-1], block_size, "k")
    v_lay = PagedLayout.of(fmt, q.shape[-1], block_size, "v")
    check_decode_inputs(q, k_cache, v_cache, block_table, seq_lens, lay, v_lay)
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    out = torch.empty(b, hq, d, dtype=compute_dtype)
    for i in range(b):
        n = int(seq_lens[i])
        if n <= 0:
            raise FormatError(f"seq_lens[{i}] = {n}; every sequence needs at least one token")
        k = fmt.decode(
            gather_rows(k_cache, lay, block_table[i], n, "k"), kind="k", layer=layer, head_dim=d
        )
        v = fmt.decode(
            gather_rows(v_cache, v_lay, block_table[i], n, "v"), kind="v", layer=layer, head_dim=d
        )
        if sinks is not None:
            j = min(n, sinks[0].shape[1])
            k[:j], v[:j] = (
                sinks[0][i, :j].float().to(k.device),
                sinks[1][i, :j].float().to(v.device),
            )
        if recent is not None:
            r = recent[0].shape[1]
            lo = max(n - r, 0 if sinks is None else min(n, sinks[0].shape[1]))
            if recent_from is not None:
                lo = min(n, max(lo, int(recent_from[i])))
            k[lo:], v[lo:] = (
                recent[0][i, r - (n - lo) :].float().to(k.device),
                recent[1][i, r - (n - lo) :].float().to(v.device),
            )
        k = k.cpu().to(compute_dtype).repeat_interleave(hq // hkv, dim=1)  # [n, hq, d]
        v = v.cpu().to(compute_dtype).repeat_interleave(hq // hkv, dim=1)
        qi = q[i].cpu().to(compute_dtype)
        s = torch.einsum("hd,nhd->hn", qi, k) * scale
        p = torch.softmax(s, dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", p, v)
    return out


def check_window(t, name: str, q: torch.Tensor, num_kv_heads: int) -> None:
    """``t``: None or bf16 copies ``(k, v)`` ``[batch, n, num_kv_heads, head_dim]`` (sinks, or a
    residual window) on ``q``'s device; raises FormatError naming ``name``."""
    if t is None:
        return
    b, _, d = q.shape
    if not (isinstance(t, tuple) and len(t) == 2):
        raise FormatError(
            f"{name} must be a tuple (k, v) of [batch, n, num_kv_heads, head_dim] tensors"
        )
    for part, x in zip(("k", "v"), t, strict=True):
        if (
            not isinstance(x, torch.Tensor)
            or x.dim() != 4
            or x.shape[0] != b
            or x.shape[2:] != (num_kv_heads, d)
            or x.device != q.device
        ):
            raise FormatError(
                f"{name} {part} must be [batch={b}, n, num_kv_heads={num_kv_heads}, "
                f"head_dim={d}] on {q.device}, got {getattr(x, 'shape', x)}"
            )
    if t[0].shape != t[1].shape or t[0].shape[1] < 1:
        raise FormatError(
            f"{name} k {tuple(t[0].shape)} and v {tuple(t[1].shape)} must match and hold >= 1 token"
        )
