"""The compact formats' cache-write in one kernel, the transform on the tensor cores.

One program takes ``BT`` tokens of one KV head and does spec/4bit.md sections 3-5 from
registers: ``y = A x - A mean`` as bfloat16 tensor-core products with float32 accumulation,
the quantizer, the bit planes, the scatter into the paged layout. ``y`` never reaches memory.

Transform. ``A`` (float32) is held as three bfloat16 matrices ``A = A0 + A1 + A2`` (each the
leading 8 significand bits of what the previous ones left: a truncation split, exact), and
``x`` (bfloat16: exact; float16: two pieces, float32: three, split the same way) multiplies
them with exact products; the terms ``x_i A_j`` with ``i + j >= 3`` (below ``2**-24`` of the
leading term) are dropped. ``A mean`` is a float32 bias computed once in float64. So ``y``
carries float32 accumulation error only, like the float32 ``bmm`` of the earlier split write
(spec/4bit.md section 3: a kernel's float32 ``y``; the quantizer is exact given ``y``, which
``y_out=`` returns for tests). The earlier writes ran the float32 transform on the FMA pipes:
the split one as a torch ``sub`` + ``bmm`` before a quantize/pack kernel, the fused one
(``benchmarks/write_fused.py``) in its kernel, 2,207 of its 4,968 sm_90 instructions per
thread on FFMA (NOTES.md, "Cache-write on the tensor cores").

This is the package's only write of the compact formats (``cache_write`` calls it on CUDA,
and on the CPU under ``TRITON_INTERPRET=1``).

Quantizer. ``u = y / s0`` correctly rounded without a division per element: ``r = 1 / s0``
once per row (IEEE), then ``q = y r``, ``e = fma(-q, s0, y)``, ``u = fma(e, r, q)`` (one
Newton correction of the quotient, the sequence CUDA's ``div.rn.f32`` runs in its fast path:
exact wherever the quotient is a normal float; below that only its sign decides a code, and an
exact comparison gives that). The code counts the decision edges below ``u`` as spec
section 4 defines it, on ``|u|`` against the positive edges only (the codebooks are
symmetric; for ``u <= 0`` ties go the other way, which comparing with the next float above
``|u|`` gives), the level is selected along the way, and the edges and levels are compile-time
constants (the frozen codebooks, section 7). The interpreter (no exact ``fma``, no bfloat16
``dot``) divides and multiplies in float32 instead: same values.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvzip_formats import FormatError
from kvzip_kernels._device_consts import on_device


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
def _trunc_bf16(v):
    """float32 -> (hi, v - hi): hi keeps the leading 8 significand bits (a bfloat16 value),
    the rest is exact in float32."""
    hi = (v.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
    return hi, v - hi


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    if INTERPRET:  # the interpreter's dot misreads bfloat16 (stored as uint16)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)


@triton.jit
def _load_a(at_ptr, bias_ptr, h, START: tl.constexpr, N: tl.constexpr, D: tl.constexpr):
    """One group's A^T pieces ([D, N] bfloat16 each) and bias ([N] float32) of head h."""
    k = tl.arange(0, D)
    c = START + tl.arange(0, N)
    a = at_ptr + h.to(tl.int64) * (3 * D * D) + k[:, None] * D + c[None, :]
    return tl.load(a), tl.load(a + D * D), tl.load(a + 2 * D * D), tl.load(bias_ptr + h * D + c)


@triton.jit
def _group_y(x0, x1, x2, a0, a1, a2, bias, BT: tl.constexpr, XP: tl.constexpr,
             INTERPRET: tl.constexpr):  # fmt: skip
    """y = x A^T - bias of one group: [BT, N] float32. Terms smallest first."""
    acc = tl.zeros([BT, bias.shape[0]], tl.float32) - bias[None, :]
    if XP >= 3:
        acc = _dot(x2, a0, acc, INTERPRET)
    if XP >= 2:
        acc = _dot(x1, a1, acc, INTERPRET)
    acc = _dot(x0, a2, acc, INTERPRET)
    if XP >= 2:
        acc = _dot(x1, a0, acc, INTERPRET)
    acc = _dot(x0, a1, acc, INTERPRET)
    return _dot(x0, a0, acc, INTERPRET)


@triton.jit
def _quantize(y, s0, r, BITS: tl.constexpr, E: tl.constexpr, LB: tl.constexpr,
              INTERPRET: tl.constexpr):  # fmt: skip
    """Codes ([BT, N] int32) of y and the least-squares sums (sum y l, sum l l) per row.
    E: the positive decision edges, LB: the positive levels' float32 bits + their index
    (ascending, constexpr). ``r`` is
    1 / s0 per row, 0 where s0 == 0 (then u = 0, as the reference)."""
    rr = r[:, None]
    if INTERPRET:
        sp = s0[:, None]
        u = tl.where(sp > 0, tl.math.div_rn(y, tl.where(sp > 0, sp, 1.0)), 0.0)
    else:
        q = y * rr
        u = tl.fma(tl.fma(-q, s0[:, None], y), rr, q)
    # u > 0 of the IEEE quotient, exactly: y / s0 > 2**-150 (the quotient rounds to a
    # nonzero float), i.e. y * 2**64 > s0 * 2**-86 (both products exact; the corrected
    # quotient is exact wherever it is a normal float, which is all the edges need). Kept as
    # the sign bit of t = s0 * 2**-86 - y * 2**64 (exact in sign; +0 or +inf: not > 0), an
    # integer: a predicate kept across the row would be parked in register bits
    tpos = tl.where(s0 > 0, s0 * 1.2924697071141057e-26, float("inf"))  # s0 * 2**-86
    tb = (tpos[:, None] - y * 1.8446744073709552e19).to(tl.int32, bitcast=True)  # y * 2**64
    pm = tb >> 31  # -1 where u > 0, else 0
    # u <= 0: the code counts edges e < u, i.e. positive edges E > |u|: ties go to the lower
    # level, so |u| == E counts as above E, which |u|'s next float does (|u| >= 0 here)
    a = ((u.to(tl.int32, bitcast=True) & 0x7FFFFFFF) + 1 + pm).to(tl.float32, bitcast=True)
    # one select per edge: LB[i] = the float32 bits of level i, whose 13 low bits are zero
    # (float16 values), with i in the lowest bits: the magnitude index and the level come
    # out of one chain (a compare and a select per edge, no count kept beside it)
    HALF: tl.constexpr = 1 << (BITS - 1)
    lb = tl.zeros(y.shape, tl.int32) + LB[0]
    for i in tl.static_range(len(E)):
        lb = tl.where(a > E[i], LB[i + 1], lb)
    lv = lb & -HALF  # the level's float32 bits
    c = (lb & (HALF - 1)) ^ (HALF - 1) ^ (pm & (2 * HALF - 1))  # HALF + m or HALF - 1 - m
    slv = (lv | (~tb & -2147483648)).to(tl.float32, bitcast=True)  # the level, u's sign
    lvf = lv.to(tl.float32, bitcast=True)
    return c, tl.sum(y * slv, 1), tl.sum(lvf * lvf, 1)


# ``n`` (the step's tokens: 1 to a prefill chunk's) is not specialised on: one compiled kernel
# per format, kind and input dtype, not one more for each of n == 1 and n % 16 == 0 reached
# mid-serving (the split merges, _decode_kernels._merge_kernel, likewise)
@triton.jit(do_not_specialize=["n"])
def _compact_write_kernel(
    x_ptr, at_ptr, bias_ptr, cache_ptr, cache16_ptr, slot_ptr, status_ptr, y_out_ptr,
    n, stride_xt, stride_xh, num_kv_heads, page_bytes, blk_stride,
    BT: tl.constexpr, D: tl.constexpr, PS: tl.constexpr, CB: tl.constexpr, CM: tl.constexpr,
    B0: tl.constexpr, N0: tl.constexpr, O0: tl.constexpr, P0: tl.constexpr,
    E0: tl.constexpr, L0: tl.constexpr,
    B1: tl.constexpr, N1: tl.constexpr, O1: tl.constexpr, P1: tl.constexpr,
    E1: tl.constexpr, L1: tl.constexpr,
    XP: tl.constexpr, Y_OUT: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Program (i, h): tiles i, i + P, ... (P programs per head) of KV head h; the head's A
    is loaded once per program."""
    h = tl.program_id(1)
    a00, a01, a02, bias0 = _load_a(at_ptr, bias_ptr, h, 0, N0, D)
    if N1 > 0:
        a10, a11, a12, bias1 = _load_a(at_ptr, bias_ptr, h, N0, N1, D)
    else:
        a10, a11, a12, bias1 = a00, a01, a02, bias0
    for tile in range(tl.program_id(0), tl.cdiv(n, BT), tl.num_programs(0)):
        tok = tile * BT + tl.arange(0, BT)
        slot = tl.load(slot_ptr + tok, mask=tok < n, other=-1).to(tl.int64)
        ok = slot >= 0  # skipped tokens (slot -1) and the tile's tail are not inputs
        blk = tl.where(ok, slot, 0) // PS
        t = tl.where(ok, slot, 0) % PS
        d = tl.arange(0, D)
        xp = x_ptr + tok.to(tl.int64)[:, None] * stride_xt + h.to(tl.int64) * stride_xh
        x = tl.load(xp + d[None, :], mask=ok[:, None], other=0.0)
        xf = x.to(tl.float32)
        x_bad = (tl.max(((tl.abs(xf) <= 65504.0) == 0).to(tl.int32), 1) != 0) & ok  # NaN too
        if XP == 1:  # bfloat16: exact as it is
            x0 = x
            x1 = x
            x2 = x
        else:
            x0, rest = _trunc_bf16(xf)
            x1, x2 = _trunc_bf16(rest)
        y0 = _group_y(x0, x1, x2, a00, a01, a02, bias0, BT, XP, INTERPRET)
        ss = tl.sum(y0 * y0, 1)
        if N1 > 0:
            y1 = _group_y(x0, x1, x2, a10, a11, a12, bias1, BT, XP, INTERPRET)
            ss += tl.sum(y1 * y1, 1)
        s0 = tl.math.sqrt_rn(ss / D).to(tl.float16).to(tl.float32)
        r = tl.where(s0 > 0, tl.math.div_rn(1.0, tl.where(s0 > 0, s0, 1.0)), 0.0)
        c0, num, den = _quantize(y0, s0, r, B0, E0, L0, INTERPRET)
        if N1 > 0:
            c1, n1, d1 = _quantize(y1, s0, r, B1, E1, L1, INTERPRET)
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
            ym = (tok < n)[:, None]
            tl.store(yrow[:, None] + tl.arange(0, N0)[None, :], y0, mask=ym)
            if N1 > 0:
                tl.store(yrow[:, None] + N0 + tl.arange(0, N1)[None, :], y1, mask=ym)


def _trunc_split(a: torch.Tensor) -> list[torch.Tensor]:
    """float32 -> three bfloat16 tensors summing exactly to it (truncation split)."""
    parts, rest = [], a.float()
    for _ in range(3):
        hi = (rest.view(torch.int32) & -65536).view(torch.float32)
        parts.append(hi.bfloat16())
        rest = rest - hi
    assert not rest.any(), "a float32 is three bfloat16 truncations"
    return parts


def tc_consts(t, device):
    """(A^T as three bfloat16 pieces [H, 3, d, d], A mean [H, d] float32) of one Transform,
    computed and uploaded once per (transform, device)."""

    def make(t):
        at = t.encode.float().transpose(1, 2).contiguous()
        bias = torch.einsum("hij,hj->hi", t.encode.double(), t.mean.double()).float()
        return torch.stack(_trunc_split(at), 1).contiguous(), bias.contiguous()

    return on_device(t, device, make, tag="tc_write")


@functools.cache
def _codebook_consts(bits: int):
    from kvzip_formats.compact import codebook

    if bits == 0:
        return (0.0,), (0, 0)
    lv = codebook.levels(bits)
    e = codebook.edges(bits)
    half = 1 << (bits - 1)
    lb = lv[half:].view(torch.int32)
    assert not (lb & 0x1FFF).any(), "levels are float16 values: 13 low float32 bits zero"
    return tuple(float(v) for v in e[half:]), tuple(int(b) + i for i, b in enumerate(lb))


@functools.cache
def _sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


XPIECES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


@functools.cache
def _group_consts(groups: tuple) -> dict:
    """The kernel's constexpr arguments of a row layout's (up to two) channel groups."""
    consts = {}
    for g, (bits, ch, off, off1) in enumerate(groups):
        e, lv = _codebook_consts(bits)
        consts.update({f"B{g}": bits, f"N{g}": ch, f"O{g}": off, f"P{g}": off1})
        consts.update({f"E{g}": e, f"L{g}": lv})
    return consts


def compact_write(
    f, x, cache, slot_mapping, lay, kind, layer, blk_stride, status, y_out=None, block_t=128,
    num_warps=8, num_stages=2, programs=-1, groups=None,
) -> None:  # fmt: skip
    """The compact formats' write as one kernel (``cache_write``'s, which validates the
    inputs). ``y_out``: a float32 ``[T, H, d]`` tensor that receives the kernel's transformed
    rows (tests: the bytes are the reference quantizer's of exactly these). ``programs``:
    programs per KV head, each looping over tiles (0: one per tile of ``block_t`` tokens; -1:
    the GPU's SMs divided by the KV heads, at least 1: one wave, the head's A loaded once per
    program). ``groups``: the layout's channel groups as ``_formats._kernel_groups`` gives
    them (``cache_write`` passes its ``KernelSpec``'s; None: derived here). The defaults
    (128 tokens, 8 warps, 2 stages, one wave) are the configuration timed as the shipped one
    (``results/kernels/cache_write/bench_cache_write_cwrite.md``)."""
    from kvzip_kernels._formats import _kernel_groups

    n, h, d = x.shape
    if groups is None:
        groups = _kernel_groups(f.spec.layout(d, kind))
    if groups is None:
        raise FormatError(f"{f.name}: no kernel packs rows of this layout at head_dim {d}")
    consts = _group_consts(groups)
    at, bias = tc_consts(f.transform_of(kind, layer), x.device)
    if y_out is not None and (
        y_out.shape != x.shape or y_out.dtype != torch.float32 or not y_out.is_contiguous()
    ):
        raise FormatError(f"y_out must be a contiguous float32 tensor of shape {tuple(x.shape)}")
    interpret = x.device.type != "cuda"
    if x.dtype != torch.bfloat16 and block_t > 64:
        # float16 / float32 x: its 2 / 3 bfloat16 pieces are dot operands in shared memory
        # too, beside A's 96 KiB: a smaller tile, no prefetch
        block_t, num_warps, num_stages = 64, 4, 1
    tiles = triton.cdiv(n, block_t)
    if tiles == 0:
        return
    if programs < 0:
        programs = max(1, _sm_count(x.device) // h) if x.device.type == "cuda" else 2
    _compact_write_kernel[(min(tiles, programs) if programs else tiles, h)](
        x, at, bias, cache, cache.view(torch.float16), slot_mapping, status,
        y_out if y_out is not None else status, n, x.stride(0), x.stride(1), h, lay.page_bytes,
        blk_stride, BT=block_t, D=d, PS=lay.block_size, CB=lay.code_bytes, CM=kind == "v",
        XP=XPIECES[x.dtype], Y_OUT=y_out is not None, INTERPRET=interpret,
        num_warps=num_warps, num_stages=num_stages, **consts,
    )  # fmt: skip
