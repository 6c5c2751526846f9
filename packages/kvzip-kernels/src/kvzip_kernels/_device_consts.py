"""Per-format constants uploaded to the device once, and the compact formats' q/o transforms.

H200 run of 2026-11-29 19:03 (``results/kernels/bench_paged_decode_compact.md`` at commit
7fa2a4a, a run since superseded): the compact formats' decode cost ~1 ms at every size
(70B-TP8, batch 8, 32k: 934 us against int4's 47) and their cache-write ~1 ms at 2k tokens
(``results/kernels/bench_cache_write.md``, same commit). Cause, read from the wrapper: every
call copied the calibrated transforms (``[H, d, d]`` float32, 512 KiB at 8 KV heads), the
means and the codebook table from host memory with ``.to(device)``. A copy from
pageable host memory waits for the stream, so each call waited for all queued GPU work and
its host time (~20 small torch ops around one Triton kernel) became GPU idle time. Here the
constants live on the device (uploaded once per transform and device), and q' = B_k^T q and
o = B_v y + mean_v run as one small Triton kernel each instead of ~10 torch ops each.
"""

from __future__ import annotations

import collections
import functools

import torch
import triton
import triton.language as tl

from kvzip_kernels._decode_kernels import _to_bf16

# (id(tensor), device) -> (tensor, derived device tensors). The entry holds the source tensor,
# so its id cannot be reused while cached. Bounded: 2 kinds x 80 layers of a 70B model fit.
_CACHE: collections.OrderedDict = collections.OrderedDict()
_CACHE_SIZE = 1024


def on_device(src, device, make, tag: str = ""):
    """``make(src)`` moved to ``device``, computed and uploaded once per (src object, device,
    ``tag``: what ``make`` derives, when one source has several derived forms)."""
    key = (id(src), str(device), tag)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is src:
        _CACHE.move_to_end(key)
        return hit[1]
    val = make(src)
    val = tuple(v.to(device) for v in val) if isinstance(val, tuple) else val.to(device)
    _CACHE[key] = (src, val)
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return val


def transform_consts(t, device):
    """(mean [H, d], decode B [H, d, e], decode transposed [H, e, d], encode transposed
    [H, d, e]) float32, contiguous, on ``device``, for one ``Transform``."""
    return on_device(
        t,
        device,
        lambda t: (
            t.mean.float().contiguous(),
            t.decode.float().contiguous(),
            t.decode.float().transpose(1, 2).contiguous(),
            t.encode.float().transpose(1, 2).contiguous(),
        ),
    )


@functools.lru_cache(maxsize=64)
def codebook_lut(k_groups: tuple, v_groups: tuple, device: str) -> torch.Tensor:
    """Positive codebook levels of K's and V's two channel groups, [32] float32 on ``device``
    (the interpreter path of the decode kernel reads them; the PTX path has them inline)."""
    from kvzip_formats.compact import codebook

    lut = torch.zeros(32, dtype=torch.float32)
    for i, groups in enumerate((k_groups, v_groups)):
        for g, (bits, *_rest) in enumerate(groups):
            if bits:
                lv = codebook.POSITIVE_LEVELS[bits]
                lut[16 * i + 8 * g : 16 * i + 8 * g + len(lv)] = torch.tensor(lv)
    return lut.to(device)


@triton.jit
def _fold_q_kernel(
    q_ptr,
    b_ptr,
    q16_ptr,
    qs_ptr,
    stride_qb,
    stride_qh,
    num_kv_heads,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    D: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """q' = B_k^T q for the G query heads of one (sequence, KV head), scaled per row by
    2**(13 - e) with e the exponent of max |q'| (so max |q'| lies in [2**13, 2**14), far from
    fp16's limits; exact), stored fp16; qs = 2**(e - 13) undoes it in the scores."""
    pid = tl.program_id(0)
    b = pid // num_kv_heads
    h = pid % num_kv_heads
    m = tl.arange(0, BLOCK_M)
    e = tl.arange(0, D)
    k = tl.arange(0, BLOCK_K)
    mm = m < G
    qrow = q_ptr + b.to(tl.int64) * stride_qb + (h * G + m)[:, None] * stride_qh
    bmat = b_ptr + h.to(tl.int64) * D * D
    qp = tl.zeros([BLOCK_M, D], tl.float32)
    for k0 in tl.static_range(0, D, BLOCK_K):  # depth chunks keep the FMA dot's operands small
        qc = tl.load(qrow + k0 + k[None, :], mask=mm[:, None], other=0.0).to(tl.float32)
        bc = tl.load(bmat + (k0 + k)[:, None] * D + e[None, :])
        qp = tl.dot(qc, bc, qp, input_precision="ieee")
    amax = tl.maximum(tl.max(tl.abs(qp), 1), 1e-30)  # a normal float: exponent from its bits
    ex = ((amax.to(tl.int32, bitcast=True) >> 23) & 255) - 127
    pow2 = ((140 - ex) << 23).to(tl.float32, bitcast=True)  # 2**(13 - ex)
    inv = ((ex + 114) << 23).to(tl.float32, bitcast=True)  # 2**(ex - 13)
    rows = pid * G + m
    tl.store(
        q16_ptr + rows[:, None] * D + e[None, :],
        (qp * pow2[:, None]).to(tl.float16),
        mask=mm[:, None],
    )
    tl.store(qs_ptr + rows, inv, mask=mm)


@triton.jit
def _unfold_o_kernel(
    y_ptr,
    bt_ptr,
    mean_ptr,
    out_ptr,
    num_kv_heads,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """out = B_v y + mean_v (bf16) for the G query heads of one (sequence, KV head); y float32
    ``[rows, D]`` from the split merge; ``bt`` = B_v transposed ``[H, e, d]``."""
    pid = tl.program_id(0)
    h = pid % num_kv_heads
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    k = tl.arange(0, BLOCK_K)
    mm = (m < G)[:, None]
    rows = (pid * G + m).to(tl.int64)
    bmat = bt_ptr + h.to(tl.int64) * D * D
    o = tl.zeros([BLOCK_M, D], tl.float32)
    for k0 in tl.static_range(0, D, BLOCK_K):
        yc = tl.load(y_ptr + rows[:, None] * D + k0 + k[None, :], mask=mm, other=0.0)
        bc = tl.load(bmat + (k0 + k)[:, None] * D + d[None, :])
        o = tl.dot(yc, bc, o, input_precision="ieee")
    o += tl.load(mean_ptr + h * D + d)[None, :]
    tl.store(out_ptr + rows[:, None] * D + d[None, :], _to_bf16(o, INTERPRET), mask=mm)


def fold_q(q: torch.Tensor, bk: torch.Tensor, num_kv_heads: int, out=None):
    """q bf16 ``[b, hq, d]`` (unit stride in d) and B_k ``[H, d, e]`` -> (q' fp16 ``[b, hq, d]``,
    per-row scale ``[b * hq]`` float32), into ``out`` (that pair, contiguous) where given."""
    b, hq, d = q.shape
    g = hq // num_kv_heads
    if out is None:
        q16 = torch.empty(b, hq, d, dtype=torch.float16, device=q.device)
        qs = torch.empty(b * hq, dtype=torch.float32, device=q.device)
    else:
        q16, qs = out
    _fold_q_kernel[(b * num_kv_heads,)](
        q,
        bk,
        q16,
        qs,
        q.stride(0),
        q.stride(1),
        num_kv_heads,
        G=g,
        BLOCK_M=max(16, triton.next_power_of_2(g)),
        D=d,
        BLOCK_K=32,
        num_warps=4,
    )
    return q16, qs


def unfold_o(
    y: torch.Tensor,
    bvt: torch.Tensor,
    mean: torch.Tensor,
    out: torch.Tensor,
    num_kv_heads: int,
    interpret: bool,
) -> None:
    """``out`` bf16 ``[b, hq, d]`` = B_v y + mean_v for y float32 ``[b, hq, d]``."""
    b, hq, d = out.shape
    g = hq // num_kv_heads
    _unfold_o_kernel[(b * num_kv_heads,)](
        y,
        bvt,
        mean,
        out,
        num_kv_heads,
        G=g,
        BLOCK_M=max(16, triton.next_power_of_2(g)),
        D=d,
        BLOCK_K=32,
        INTERPRET=interpret,
        num_warps=4,
    )
