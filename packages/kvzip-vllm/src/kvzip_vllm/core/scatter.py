"""One launch that writes a load step's decoded blocks into every layer's paged cache, each
chunk only if its damage flag (on the device) is clear.

The CUDA pipeline decodes a step's chunks into one buffer ``out`` ``[2 * layers, rows,
block_size, kv_heads, head_size]`` (token-major, K and V of each layer: the decoder's slots).
Scattering it with torch takes about four launches per layer (two strided ``index_copy_`` and
their permuted sources) and needs the damage flags on the host first, so the host waited for
the whole decode before the forward could be queued. This kernel takes the flags where they
are: a row is written only if its chunk's flag is clear, so a damaged chunk's output never
reaches the cache and no host synchronisation stands before the forward; the host reads the
flags later (before the step's stores) to report the failures.

The caches are vLLM's per-layer ``[num_blocks, kv_heads, block_size, 2 * head_size]`` views
(K then V on the last axis: the CUDA backends' order), any strides, equal across layers: the
kernel gets one base address per layer and the shared strides. No vLLM here.
"""

from __future__ import annotations

import torch

try:  # (kvzip-kernels brings Triton; a CPU machine runs it under TRITON_INTERPRET=1)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the pipeline then scatters with torch
    triton = None


def supported(caches: list[torch.Tensor]) -> str | None:
    """None when :func:`masked_scatter` can write ``caches``, else why not."""
    if triton is None:
        return "Triton is not installed"
    first = caches[0]
    for c in caches:
        if c.dtype != torch.bfloat16 or c.dim() != 4 or c.shape[-1] % 2:
            return f"a cache of dtype {c.dtype} and shape {tuple(c.shape)}"
        if c.shape != first.shape or c.stride() != first.stride() or c.device != first.device:
            return "the layers' caches differ in shape, strides or device"
        if c.stride(-1) != 1:
            return "a cache whose last axis is not contiguous"
    return None


def layer_pointers(caches: list[torch.Tensor]) -> torch.Tensor:
    """The caches' base addresses (int64, on their device): the kernel's per-layer bases."""
    return torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64).to(caches[0].device)


if triton is not None:
    # (not specialised on the row counts: a restore's R and the group buffer's rows vary from
    # step to step, and each new specialisation would compile mid-serving, a pause that
    # vLLM's JIT monitor reports; :func:`warm_up` compiles the one kernel at start-up)
    @triton.jit(do_not_specialize=["R", "rows_out"])
    def _masked_scatter_kernel(
        out_ptr,  # bf16 [S, rows_out, T, H, D], contiguous
        bases_ptr,  # int64 [L]: each layer's cache base address
        plan_ptr,  # int64 [3, R]: source row in out, destination block, chunk
        flags_ptr,  # int32 [chunks]: nonzero = damaged (not written)
        R,
        rows_out,
        H,
        s_blk,
        s_h,
        s_t,
        T: tl.constexpr,
        D: tl.constexpr,
        BT: tl.constexpr,
        BD: tl.constexpr,
    ):
        r = tl.program_id(0)
        slot = tl.program_id(1).to(tl.int64)  # 2 * layer + kind (0: K, 1: V)
        h = tl.program_id(2).to(tl.int64)
        chunk = tl.load(plan_ptr + 2 * R + r)
        if tl.load(flags_ptr + chunk) == 0:
            src_row = tl.load(plan_ptr + r)
            dst_blk = tl.load(plan_ptr + R + r)
            base = tl.load(bases_ptr + slot // 2).to(tl.pointer_type(tl.bfloat16))
            t = tl.arange(0, BT)[:, None]
            d = tl.arange(0, BD)[None, :]
            mask = (t < T) & (d < D)
            src = out_ptr + (((slot * rows_out + src_row) * T + t) * H + h) * D + d
            x = tl.load(src, mask=mask)
            dst = base + dst_blk * s_blk + h * s_h + t * s_t + (slot % 2) * D + d
            tl.store(dst, x, mask=mask)


def masked_scatter(
    out: torch.Tensor,
    caches: list[torch.Tensor],
    bases: torch.Tensor,
    plan: torch.Tensor,
    flags: torch.Tensor,
) -> None:
    """Write rows of ``out`` ``[2 * len(caches), rows, block_size, kv_heads, head_size]`` into
    the caches: for each column ``r`` of ``plan`` (int64 ``[3, R]`` on the device: source row,
    destination block, chunk), K and V of every layer, unless ``flags[chunk]`` is nonzero.
    ``bases``: :func:`layer_pointers` of ``caches``. Asynchronous on the current stream."""
    S, rows_out, T, H, D = out.shape
    if S != 2 * len(caches) or not out.is_contiguous() or out.dtype != torch.bfloat16:
        raise ValueError(
            f"out {tuple(out.shape)} {out.dtype}: expected contiguous bf16 "
            f"[{2 * len(caches)}, rows, block_size, kv_heads, head_size]"
        )
    c = caches[0]
    if tuple(c.shape[1:]) != (H, T, 2 * D):
        raise ValueError(f"cache {tuple(c.shape)} does not hold blocks of {(T, H, D)}")
    R = plan.shape[1]
    if R == 0:
        return
    if plan.dtype != torch.int64 or plan.shape[0] != 3 or not plan.is_contiguous():
        raise ValueError(f"plan {tuple(plan.shape)} {plan.dtype}: expected int64 [3, R]")
    _masked_scatter_kernel[(R, S, H)](
        out, bases, plan, flags.to(torch.int32), R, rows_out, H,
        c.stride(0), c.stride(1), c.stride(2),
        T=T, D=D, BT=triton.next_power_of_2(T), BD=triton.next_power_of_2(D),
    )  # fmt: skip


def warm_up(caches: list[torch.Tensor], bases: torch.Tensor) -> None:
    """Compile :func:`masked_scatter`'s kernel for ``caches`` now (a tier's start-up), not at
    its first restore: one launch over a one-row buffer whose chunk is flagged, so nothing is
    written. Asynchronous on the current stream."""
    c = caches[0]
    _, h, t, d2 = c.shape
    out = torch.zeros((2 * len(caches), 1, t, h, d2 // 2), dtype=torch.bfloat16, device=c.device)
    plan = torch.zeros((3, 1), dtype=torch.int64, device=c.device)
    masked_scatter(out, caches, bases, plan, torch.ones(1, dtype=torch.int32, device=c.device))
