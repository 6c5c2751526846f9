"""Research variant (not shipped): the compact formats' cache-write in one kernel per call.

Kept beside the benchmarks that timed it (``bench_cache_write.py --write-paths fused`` times
it as ``<fmt>-fused``, ``test_write_fused.py`` checks it). The package writes by
``kvzip_kernels._write_compact`` (the transform on the tensor cores). NOTES.md has this
variant's prediction and outcome (``results/kernels/bench_cache_write_fused.md``: 3.6-4.0% of
a prefill of the same tokens at 32k against the split path's 4.4-7.3%, both over the 2%
target) and why it missed (``write_sass.py --old``: the float32 transform on the FMA pipes).

Transform, quantize and pack in one kernel:

The split path (the package's write until 2026-12-02: ``_write_codebook.py`` at commit
b398d2e; ``split_y`` below is its transform) ran ``y = A (x - mean)`` as a torch ``sub`` and a
float32 ``bmm`` and then a quantize/pack kernel: three launches and a float32 ``y`` of
``[T, H, d]`` written and read back. Here one program takes a tile of ``BT`` tokens of one
KV head: it loads x, subtracts the mean (float32, as torch's promotion does), computes each
channel group's ``y`` with a float32 ``tl.dot`` (``input_precision="ieee"``: float32 products
and sums, one rounding per step as spec/4bit.md section 3 allows), and quantizes and packs
from registers: every code is computed once (the split kernel computes each one two or three
times), the bit planes are formed by splitting the code tensor, and ``y`` never reaches
memory. The quantizer is the split kernel's (``_codes``, ``_unit`` and the edge and level
tables below are its), so given the same ``y`` the bytes are equal; ``y`` itself differs from
the ``bmm``'s in the summation order only (``y_out=`` returns it for tests). Rejected rows:
as the package's write.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvzip_formats import FormatError
from kvzip_kernels._decode_codebook import _level
from kvzip_kernels._device_consts import transform_consts


def split_y(f, x: torch.Tensor, kind: str, layer: int) -> torch.Tensor:
    """The split path's transformed rows ``y = A (x - mean)``, float32 ``[T, H, d]``: one
    torch ``sub`` and one batched float32 matmul per head on ``[H, T, d]`` views."""
    mean, _, _, enc_t = transform_consts(f.transform_of(kind, layer), x.device)
    xc = torch.sub(x, mean)  # float32 (type promotion)
    return torch.bmm(xc.transpose(0, 1), enc_t).transpose(0, 1)


@functools.lru_cache(maxsize=64)
def codebook_edges_levels(groups: tuple, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Decision edges [2, 16] (inf-padded) and positive levels [2, 8] of a row's two channel
    groups, float32 on ``device``: the split and fused writes' quantizer tables."""
    from kvzip_formats.compact import codebook

    edges = torch.full((2, 16), float("inf"))
    levels = torch.zeros(2, 8)
    for g, (bits, *_rest) in enumerate(groups):
        if bits:
            e = codebook.edges(bits)
            edges[g, : e.numel()] = e
            pos = codebook.POSITIVE_LEVELS[bits]
            levels[g, : len(pos)] = torch.tensor(pos)
    return edges.to(device), levels.to(device)


@triton.jit
def _codes(u, BITS: tl.constexpr, edge_ptr):
    """Code = #{edges < u} (ties go to the lower level), int32."""
    c = tl.zeros(u.shape, tl.int32)
    for e in tl.static_range((1 << BITS) - 1):
        c += (u > tl.load(edge_ptr + e)).to(tl.int32)
    return c


@triton.jit
def _unit(y, s0):
    """u = y / s0 as the reference computes it (IEEE float32 division; 0 where s0 == 0)."""
    safe = tl.where(s0 > 0, s0, 1.0)[:, None]
    return tl.where(s0[:, None] > 0, tl.math.div_rn(y, safe), 0.0)


@triton.jit
def _group_y_step(acc, xc, enc_ptr, K0: tl.constexpr, KC: tl.constexpr, START: tl.constexpr,
                  N: tl.constexpr, D: tl.constexpr):  # fmt: skip
    """acc += xc [BT, KC] (channels K0..K0+KC of x - mean) @ enc_t[K0:K0+KC, START:START+N],
    float32 products and sums (input_precision="ieee")."""
    r = K0 + tl.arange(0, KC)
    c = START + tl.arange(0, N)
    b = tl.load(enc_ptr + r[:, None] * D + c[None, :])
    return tl.dot(xc, b, acc, input_precision="ieee")


@triton.jit
def _fit(y, s0, BITS: tl.constexpr, edge_ptr, lev_ptr):
    """Codes of ``y`` ([BT, N] int32) and the least-squares sums (sum y l, sum l l) per row."""
    c = _codes(_unit(y, s0), BITS, edge_ptr)
    m0, m1, m2, m3 = (
        tl.load(lev_ptr),
        tl.load(lev_ptr + 1),
        tl.load(lev_ptr + 2),
        tl.load(lev_ptr + 3),
    )
    m4, m5, m6, m7 = (
        tl.load(lev_ptr + 4),
        tl.load(lev_ptr + 5),
        tl.load(lev_ptr + 6),
        tl.load(lev_ptr + 7),
    )
    lv = _level(c, BITS, m0, m1, m2, m3, m4, m5, m6, m7).to(tl.float32)
    return c, tl.sum(y * lv, 1), tl.sum(lv * lv, 1)


@triton.jit
def _store_bytes(
    cache_ptr, base, t, j, val, ok, CB: tl.constexpr, PS: tl.constexpr, CM: tl.constexpr
):
    """Bytes ``j`` ([W]) of the rows of tokens at (base, t) ([BT]); CM: channel-major (V)."""
    if CM:  # byte j of token t at j * PS + t
        off = base[:, None] + j[None, :] * PS + t[:, None]
    else:
        off = base[:, None] + t[:, None] * CB + j[None, :]
    tl.store(cache_ptr + off, val.to(tl.uint8), mask=ok[:, None])


@triton.jit
def _planes(
    cache_ptr, base, t, c, ok,
    BT: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr, OFF: tl.constexpr, OFF1: tl.constexpr,
    CB: tl.constexpr, PS: tl.constexpr, CM: tl.constexpr,
):  # fmt: skip
    """One group's bit planes from its codes ``c`` [BT, N] (spec/4bit.md section 5): channel i
    of a plane of width w at byte i*w/8, bits (i*w) % 8; the widest plane holds the low bits."""
    if BITS == 4:
        lo, hi = tl.split(tl.reshape(c, (BT, N // 2, 2)))  # channels 2i, 2i+1
        _store_bytes(cache_ptr, base, t, OFF + tl.arange(0, N // 2), lo | (hi << 4), ok, CB, PS, CM)
    else:
        # channel 4i + k, k = 2a + b: split b, then a
        e, o = tl.split(tl.reshape(c & 3, (BT, N // 4, 2, 2)))
        k0, k2 = tl.split(e)
        k1, k3 = tl.split(o)
        v = k0 | (k1 << 2) | (k2 << 4) | (k3 << 6)
        _store_bytes(cache_ptr, base, t, OFF + tl.arange(0, N // 4), v, ok, CB, PS, CM)
        if BITS == 3:
            # channel 8j + k, k = 4a + 2b + e: split e, then b, then a
            h0, h1 = tl.split(tl.reshape((c >> 2) & 1, (BT, N // 8, 2, 2, 2)))
            h00, h01 = tl.split(h0)  # k = 4a + {0, 2}
            h10, h11 = tl.split(h1)  # k = 4a + {1, 3}
            b0, b4 = tl.split(h00)
            b2, b6 = tl.split(h01)
            b1, b5 = tl.split(h10)
            b3, b7 = tl.split(h11)
            w = (
                b0
                | (b1 << 1)
                | (b2 << 2)
                | (b3 << 3)
                | (b4 << 4)
                | (b5 << 5)
                | (b6 << 6)
                | (b7 << 7)
            )
            _store_bytes(cache_ptr, base, t, OFF1 + tl.arange(0, N // 8), w, ok, CB, PS, CM)


@triton.jit
def _codebook_fused_write_kernel(
    x_ptr, mean_ptr, enc_ptr, cache_ptr, cache16_ptr, slot_ptr, edge_ptr, lev_ptr, status_ptr,
    y_out_ptr, n, stride_xt, stride_xh, num_kv_heads, page_bytes, blk_stride,
    BT: tl.constexpr, D: tl.constexpr, PS: tl.constexpr, CB: tl.constexpr, CM: tl.constexpr,
    B0: tl.constexpr, N0: tl.constexpr, O0: tl.constexpr, P0: tl.constexpr,
    B1: tl.constexpr, N1: tl.constexpr, O1: tl.constexpr, P1: tl.constexpr,
    KC: tl.constexpr, Y_OUT: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0) * BT + tl.arange(0, BT)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + tok, mask=tok < n, other=-1).to(tl.int64)
    ok = slot >= 0  # skipped tokens (slot -1) and the tile's tail are not inputs
    blk = tl.where(ok, slot, 0) // PS
    t = tl.where(ok, slot, 0) % PS
    # y = (x - mean) @ enc_t in depth chunks of KC channels: operands of [BT, KC] and
    # [KC, N] stay in registers (the whole [D, D] transform at once spilled ~13 KB of sm_90
    # stack; KC 16 with 8 warps: <= 191 registers, <= 32 bytes of stack, compiled on the CPU)
    enc = enc_ptr + h.to(tl.int64) * D * D
    xrow = x_ptr + tok.to(tl.int64)[:, None] * stride_xt + h.to(tl.int64) * stride_xh
    y0 = tl.zeros([BT, N0], tl.float32)
    y1 = tl.zeros([BT, N1 if N1 > 0 else 16], tl.float32)
    bad = tl.zeros([BT], tl.int32)
    for k0 in tl.static_range(0, D, KC):
        dk = k0 + tl.arange(0, KC)
        x = tl.load(xrow + dk[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        bad = tl.maximum(bad, tl.max(((tl.abs(x) <= 65504.0) == 0).to(tl.int32), 1))  # NaN
        xc = x - tl.load(mean_ptr + h * D + dk)[None, :]
        y0 = _group_y_step(y0, xc, enc, k0, KC, 0, N0, D)
        if N1 > 0:
            y1 = _group_y_step(y1, xc, enc, k0, KC, N0, N1, D)
    x_bad = (bad != 0) & ok
    ss = tl.sum(y0 * y0, 1)
    if N1 > 0:
        ss += tl.sum(y1 * y1, 1)
    s0 = tl.math.sqrt_rn(ss / D).to(tl.float16).to(tl.float32)
    c0, num, den = _fit(y0, s0, B0, edge_ptr, lev_ptr)
    if N1 > 0:
        c1, n1, d1 = _fit(y1, s0, B1, edge_ptr + 16, lev_ptr + 8)
        num += n1
        den += d1
    s = tl.math.div_rn(num, den).to(tl.float16).to(tl.float32)
    s = tl.where((s > 0) & (s < float("inf")), s, s0)
    rms_bad = ((s0 < float("inf")) == 0) & ok & (x_bad == 0)
    s = tl.where(x_bad | rms_bad, float("nan"), s)  # a rejected row decodes to NaN
    flags = x_bad.to(tl.int32) | rms_bad.to(tl.int32) * 2  # X_BAD, RMS_BAD
    zero = tl.zeros([BT], tl.int32)
    tl.atomic_or(status_ptr + zero, flags, mask=flags != 0)
    tl.atomic_max(status_ptr + 1 + zero, 2147483647 - tok, mask=flags != 0)
    base = blk * blk_stride + h * page_bytes
    _planes(cache_ptr, base, t, c0, ok, BT, N0, B0, O0, P0, CB, PS, CM)
    if N1 > 0:
        _planes(cache_ptr, base, t, c1, ok, BT, N1, B1, O1, P1, CB, PS, CM)
    tl.store(cache16_ptr + (base + PS * CB + 2 * t) // 2, s.to(tl.float16), mask=ok)
    if Y_OUT:  # the kernel's y, [n, H, D] float32 (tests)
        yrow = y_out_ptr + (tok.to(tl.int64) * num_kv_heads + h) * D
        tl.store(yrow[:, None] + tl.arange(0, N0)[None, :], y0, mask=(tok < n)[:, None])
        if N1 > 0:
            tl.store(yrow[:, None] + N0 + tl.arange(0, N1)[None, :], y1, mask=(tok < n)[:, None])


def codebook_write_fused(
    f, x, cache, slot_mapping, lay, kind, layer, blk_stride, status, y_out=None, block_t=32
) -> None:
    """The compact formats' write as one kernel (transform, quantize, pack); inputs validated
    by ``cache_write``. ``y_out``: a float32 ``[T, H, d]`` tensor that receives the kernel's
    transformed rows (tests: the bytes are the reference quantizer's of exactly these)."""
    from kvzip_kernels._formats import _kernel_groups

    n, h, d = x.shape
    groups = _kernel_groups(f.spec.layout(d, kind))
    if groups is None:
        raise FormatError(f"{f.name}: no kernel packs rows of this layout at head_dim {d}")
    edges, levels = codebook_edges_levels(groups, str(x.device))
    consts = {}
    for g, (bits, ch, off, off1) in enumerate(groups):
        consts.update({f"B{g}": bits, f"N{g}": ch, f"O{g}": off, f"P{g}": off1})
    mean, _, _, enc_t = transform_consts(f.transform_of(kind, layer), x.device)
    if y_out is not None and (
        y_out.shape != x.shape or y_out.dtype != torch.float32 or not y_out.is_contiguous()
    ):
        raise FormatError(f"y_out must be a contiguous float32 tensor of shape {tuple(x.shape)}")
    _codebook_fused_write_kernel[(triton.cdiv(n, block_t), h)](
        x, mean, enc_t, cache, cache.view(torch.float16), slot_mapping, edges, levels, status,
        y_out if y_out is not None else status, n, x.stride(0), x.stride(1), h, lay.page_bytes,
        blk_stride, BT=block_t, D=d, PS=lay.block_size, CB=lay.code_bytes,
        CM=kind == "v", KC=16, Y_OUT=y_out is not None, num_warps=8, **consts,
    )  # fmt: skip
