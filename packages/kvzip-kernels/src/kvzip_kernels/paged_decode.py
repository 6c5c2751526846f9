"""Paged decode attention on kvzip's paged cache (``kvzip_formats/spec/paged_layout.md``).

``paged_decode(fmt, q, k_cache, v_cache, block_table, seq_lens, block_size=...)`` matches
``kvzip_formats.ops.paged_decode`` (float32 attention on the dequantised cache) within the
earned tolerance. It is one :func:`kvzip_kernels.decode_plan.plan` (the validation, the kernel and
split choice) and one :meth:`~kvzip_kernels.decode_plan.DecodePlan.run` (the launches); the kernels
trust their inputs.
"""

from __future__ import annotations

import torch

from kvzip_formats import FormatError, KVFormat
from kvzip_formats.ops.paged_decode import check_window
from kvzip_kernels._formats import resolve
from kvzip_kernels._merge_extra import Ring, SinkSlots
from kvzip_kernels.decode_plan import CALLS, LOG2E, DecodeConfig, plan

__all__ = ["CALLS", "LOG2E", "DecodeConfig", "paged_decode"]


def paged_decode(
    fmt: KVFormat | str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    block_size: int,
    layer: int = 0,
    sm_scale: float | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    block_stride: int | None = None,
    sinks: tuple[torch.Tensor, torch.Tensor] | SinkSlots | None = None,
    recent: tuple[torch.Tensor, torch.Tensor] | Ring | None = None,
    recent_from: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Decode attention for one new token per sequence.

    q ``[batch, num_q_heads, head_dim]`` bf16; k_cache/v_cache uint8 ``[num_blocks,
    num_kv_heads, block_size * token_head_bytes]``; block_table int32 ``[batch, max_blocks]``;
    seq_lens int32 ``[batch]`` (each >= 1). Returns ``out`` ``[batch, num_q_heads, head_dim]``
    bf16. ``max_seq_len`` (an upper bound of seq_lens) avoids reading seq_lens on the host.
    Rotated formats (``int4-rot``) get the query rotated before and the output after.
    ``block_stride`` (bytes) admits caches strided in their block dimension, such as vLLM's
    ``kv[:, 0]`` / ``kv[:, 1]`` (see ``check_strided_cache``). ``sinks``: for the compact
    formats, the bf16 copies ``(k, v)`` ``[batch, n_sink, num_kv_heads, head_dim]`` of each
    sequence's first tokens, attended instead of their rows (spec/4bit.md sections 6 and 8).
    ``recent``: for the compact formats, a residual window (spec/residual_window.md): the bf16
    copies ``(k, v)`` ``[batch, R, num_kv_heads, head_dim]`` of each sequence's last ``R``
    tokens, right-aligned (entry ``j`` is position ``seq_lens[b] - R + j``; entries before the
    sinks are ignored), attended instead of their rows: the kernels read the rows up to
    ``max(seq_lens - R, n_sink)`` and the window is merged with the sinks by log-sum-exp.
    ``recent_from`` (int ``[batch]``, on the device): the window holds only positions from
    there on; the rows before it are read (the row end moves there, never past the sequence).
    ``backend``: ``"auto"`` (default; or the ``KVZIP_KERNELS_BACKEND`` environment variable)
    runs the CUDA C++ split kernel (``_cuda.py``: int4, int4-rot, 4bit, 3.5bit, 3bit; at most 8
    query heads per KV head) on sm_90 where it builds, and Triton elsewhere; ``"cuda"`` forces
    it (a ``FormatError`` saying why where it cannot run), ``"triton"`` forces Triton.

    One call is :func:`kvzip_kernels.decode_plan.plan` and one :meth:`DecodePlan.run`: a server that
    decodes many layers per step plans once and runs per layer.

    Example::

        out = paged_decode("int4", q, k_cache, v_cache, block_table, seq_lens, block_size=16)
    """
    f = resolve(fmt)
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise FormatError(f"q must be [batch, num_q_heads, head_dim], got {getattr(q, 'shape', q)}")
    if q.dtype != torch.bfloat16:
        raise FormatError(f"q must be bfloat16 [batch, num_q_heads, head_dim], got {q.dtype}")
    hkv = k_cache.shape[1] if isinstance(k_cache, torch.Tensor) and k_cache.dim() == 3 else 0
    n_sink = window = 0
    row_end = None
    if isinstance(sinks, SinkSlots):
        n_sink = sinks.n
    elif sinks is not None:
        check_window(sinks, "sinks", q, hkv)
        n_sink = sinks[0].shape[1]
    if isinstance(recent, Ring):
        window, row_end = recent.recent + 1, recent.row_end
    elif recent is not None:
        check_window(recent, "recent", q, hkv)
        window = recent[0].shape[1]
    p = plan(
        f,
        num_q_heads=q.shape[1],
        head_dim=q.shape[2],
        block_table=block_table,
        seq_lens=seq_lens,
        k_cache=k_cache,
        v_cache=v_cache,
        block_size=block_size,
        max_seq_len=max_seq_len,
        sm_scale=sm_scale,
        block_stride=block_stride,
        n_sink=n_sink,
        window=window,
        recent_from=recent_from,
        row_end=row_end,
        config=config,
        backend=backend,
    )
    if q.device != p.device:
        raise FormatError(
            f"q, caches, block_table and seq_lens must share one device, got {q.device} and "
            f"{p.device}"
        )
    return p.run(q, k_cache, v_cache, layer=layer, out=out, sinks=sinks, recent=recent)
