"""Paged cache-write: quantize new tokens and scatter them into kvzip's paged layout.

``cache_write(fmt, x, cache, slot_mapping, kind=..., block_size=...)`` writes what
``kvzip_formats.ops.cache_write`` writes (the format's reference ``encode`` plus the scatter of
``spec/paged_layout.md``): bit-exact for ``fp8``, ``int4`` and ``int4-rot``; for the compact
formats (``4bit``, ``3.5bit``, ``3bit``) the bytes are the reference quantizer's of the
kernel's own float32 transform ``y`` (spec/4bit.md section 3), written by one kernel with the
transform on the tensor cores (``_write_compact.py``). fp8 and int4: one program per token
writes every KV head of that token (a token-head row is only 36-68 bytes, so a program per row
would be launch-bound).

Rejected inputs (spec/4bit.md section 9, spec/baselines.md) are found by the kernels, per row,
as the reference finds them: an element of ``x`` that is NaN, infinite or beyond float16's
range (``not |x| <= 65504``), or (compact formats) a token scale ``s0`` that is not finite (the
RMS of ``y`` overflows float16). Such a row is written with a NaN scale, so that it decodes to
NaN and never to a plausible value, and the kernel records the failure in ``status`` (see
``check_status``): ``status[0]`` ORs ``X_BAD`` / ``RMS_BAD``, ``status[1]`` keeps
``2**31 - 1 - first failing token`` (an atomic max, so that a zero-filled word is a fresh one).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvzip_formats import FormatError, KVFormat
from kvzip_formats.ops.cache_write import check_slot_mapping
from kvzip_kernels._device_consts import on_device
from kvzip_kernels._formats import check_strided_cache, kernel_spec, resolve
from kvzip_kernels._write_compact import compact_write

X_BAD = 1  # an element of x is NaN, inf or |x| > 65504
RMS_BAD = 2  # a transformed row's RMS is not finite in float16 (the compact formats)


@triton.jit
def _rows_out_of_range(x_ptr, tok, stride_xt, stride_xh, h, hm, D: tl.constexpr):
    """[H_P] int1: heads of token ``tok`` whose row of ``x`` holds NaN, inf or |x| > 65504."""
    d = tl.arange(0, D)
    xp = x_ptr + tok.to(tl.int64) * stride_xt + h.to(tl.int64)[:, None] * stride_xh + d[None, :]
    x = tl.load(xp, mask=hm[:, None], other=0.0).to(tl.float32)
    bad = (tl.abs(x) <= 65504.0) == 0  # NaN compares false
    return (tl.max(bad.to(tl.int32), 1) != 0) & hm


@triton.jit
def _report(status_ptr, tok, flags):
    """Record a rejected token: OR its flags into status[0], the lowest token into status[1]
    (as ``2**31 - 1 - tok``, by atomic max: a zero-filled status is a fresh one)."""
    tl.atomic_or(status_ptr, flags, mask=flags != 0)
    tl.atomic_max(status_ptr + 1, 2147483647 - tok, mask=flags != 0)


@triton.jit
def _rne(v):
    # 1.5 * 2**23: adding and subtracting it rounds a float32 |v| < 2**22 to the nearest
    # integer, ties to even (the reference's torch.round); larger |v| clamp to 0 or 15 anyway.
    return (v + 12582912.0) - 12582912.0


@triton.jit
def _int4_write_kernel(
    x_ptr,
    xin_ptr,
    cache_ptr,
    cache16_ptr,
    slot_ptr,
    status_ptr,
    stride_xt,
    stride_xh,
    stride_it,
    stride_ih,
    num_kv_heads,
    page_bytes,
    blk_stride,
    H_P: tl.constexpr,
    D: tl.constexpr,
    PS: tl.constexpr,
    CHANNEL_MAJOR: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    blk = slot // PS
    t = slot % PS
    h = tl.arange(0, H_P)
    j = tl.arange(0, D // 2)
    hm = h < num_kv_heads
    xp = x_ptr + tok * stride_xt + h[:, None] * stride_xh + 2 * j[None, :]
    xe = tl.load(xp, mask=hm[:, None], other=0.0).to(tl.float32)  # elements 2j
    xo = tl.load(xp + 1, mask=hm[:, None], other=0.0).to(tl.float32)  # elements 2j+1
    lo = tl.minimum(tl.min(xe, 1), tl.min(xo, 1))
    hi = tl.maximum(tl.max(xe, 1), tl.max(xo, 1))
    zero16 = lo.to(tl.float16)
    scale16 = tl.math.div_rn(hi - lo, 15.0).to(tl.float16)
    s = scale16.to(tl.float32)
    z = zero16.to(tl.float32)
    safe = tl.where(s > 0, s, 1.0)[:, None]
    ce = tl.minimum(tl.maximum(_rne(tl.math.div_rn(xe - z[:, None], safe)), 0.0), 15.0)
    co = tl.minimum(tl.maximum(_rne(tl.math.div_rn(xo - z[:, None], safe)), 0.0), 15.0)
    ce = tl.where(s[:, None] > 0, ce, 0.0).to(tl.uint8)
    co = tl.where(s[:, None] > 0, co, 0.0).to(tl.uint8)
    # baselines.md: NaN, inf or |x| > 65504 (before the rotation) is rejected; such a row
    # gets NaN scale and zero (it decodes to NaN) and is reported in status
    bad = _rows_out_of_range(xin_ptr, tok, stride_it, stride_ih, h, hm, D)
    scale16 = tl.where(bad, float("nan"), scale16.to(tl.float32)).to(tl.float16)
    zero16 = tl.where(bad, float("nan"), zero16.to(tl.float32)).to(tl.float16)
    _report(status_ptr, tok, tl.max(bad.to(tl.int32), 0))
    base = blk * blk_stride + h * page_bytes  # int64 [H_P]
    if CHANNEL_MAJOR:  # V pages: byte j of token t at j * PS + t
        code = base[:, None] + j[None, :] * PS + t
    else:  # K pages: at t * code_bytes + j
        code = base[:, None] + t * (D // 2) + j[None, :]
    tl.store(cache_ptr + code, ce | (co << 4), mask=hm[:, None])
    m16 = (base + PS * (D // 2) + t * 4) // 2  # metadata, in float16 units
    tl.store(cache16_ptr + m16, scale16, mask=hm)
    tl.store(cache16_ptr + m16 + 1, zero16, mask=hm)


@triton.jit
def _e4m3_bits(y):
    """float32 |y| <= 448 (or NaN) -> e4m3fn bits, round to nearest even, as torch's cast.

    Written with integer ops rather than ``.to(tl.float8e4nv)``: the Triton interpreter's cast
    misrounds values that carry into the next binade (127.75 -> 64), so the CPU tests could not
    be bit-exact; on the GPU this costs a few integer ops per element of a write.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    sub = _rne(tl.abs(y) * 512.0).to(tl.int32)  # subnormals: steps of 2**-9
    mag = tl.where(a >= 0x3C800000, normal, sub)
    mag = tl.where(y != y, 0x7F, mag)
    return (sign | mag).to(tl.uint8)


@triton.jit
def _fp8_write_kernel(
    x_ptr,
    cache_ptr,
    slot_ptr,
    stride_xt,
    stride_xh,
    num_kv_heads,
    page_bytes,
    blk_stride,
    scale,
    H_P: tl.constexpr,
    D: tl.constexpr,
    PS: tl.constexpr,
    CHANNEL_MAJOR: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    blk = slot // PS
    t = slot % PS
    h = tl.arange(0, H_P)
    d = tl.arange(0, D)
    hm = h < num_kv_heads
    x = tl.load(
        x_ptr + tok * stride_xt + h[:, None] * stride_xh + d[None, :], mask=hm[:, None], other=0.0
    ).to(tl.float32)
    y = tl.math.div_rn(x, scale)
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -448.0), 448.0))
    base = blk * blk_stride + h * page_bytes
    if CHANNEL_MAJOR:
        code = base[:, None] + d[None, :] * PS + t
    else:
        code = base[:, None] + t * D + d[None, :]
    tl.store(cache_ptr + code, _e4m3_bits(y), mask=hm[:, None])


def cache_write(
    fmt: KVFormat | str,
    x: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kind: str,
    block_size: int,
    layer: int = 0,
    check_slots: bool = True,
    block_stride: int | None = None,
    check_values: bool = True,
    status: torch.Tensor | None = None,
) -> None:
    """Write ``x`` ``[num_tokens, num_kv_heads, head_dim]`` (bf16/fp16/fp32) into ``cache``
    ``[num_blocks, num_kv_heads, block_size * token_head_bytes]`` (uint8) at ``slot_mapping``
    ``[num_tokens]`` (int32/int64; ``-1`` skips a token).

    ``check_slots=False`` skips the range check of the slots (it reads them on the host, a
    device sync): for callers such as vLLM that guarantee valid slots. ``block_stride``
    (bytes) admits a cache strided in its block dimension (see ``check_strided_cache``).

    Values the format rejects (``int4``, ``int4-rot`` and the compact formats: NaN, inf or
    ``|x| > 65504``; the compact formats also a transformed row whose RMS overflows float16;
    spec/4bit.md section 9, spec/baselines.md) raise ``FormatError`` as the reference does,
    after the kernel ran: the rejected rows hold a NaN scale (they decode to NaN), the other
    tokens are written. ``check_values=False`` skips that check (it reads a flag on the host,
    a device sync); the rejected rows still decode to NaN, never to a plausible value, and
    ``status=`` (an int32 ``[2]`` tensor, filled by the kernel: see ``check_status``) lets
    a caller read the verdict later. Skipped tokens (slot ``-1``) are not inputs: never checked.

    Example::

        cache = kvzip_formats.ops.new_paged_cache(get_format("int4"), 4, 8, 16, 128, device="cuda")
        cache_write("int4", k, cache, slots, kind="k", block_size=16)
    """
    f = resolve(fmt)
    if kind not in ("k", "v"):
        raise FormatError(f"kind must be 'k' or 'v', got {kind!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise FormatError(
            f"x must be [num_tokens, num_kv_heads, head_dim], got {getattr(x, 'shape', x)}"
        )
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise FormatError(f"x has dtype {x.dtype}; supported: bfloat16, float16, float32")
    n, h, d = x.shape
    spec = kernel_spec(f, d, block_size)
    lay = spec.layout if kind == "k" else spec.vlay
    blk_stride = check_strided_cache(cache, lay, h, block_stride, "cache")
    if x.device != cache.device or slot_mapping.device != cache.device:
        raise FormatError(
            f"x ({x.device}), slot_mapping ({slot_mapping.device}) and cache "
            f"({cache.device}) must be on one device"
        )
    if check_slots:
        check_slot_mapping(slot_mapping, n, cache.shape[0] * block_size)
    elif slot_mapping.shape != (n,):
        raise FormatError(f"slot_mapping must have shape [{n}], got {tuple(slot_mapping.shape)}")
    if n == 0:
        return
    if x.stride(2) != 1:
        x = x.contiguous()
    hp = triton.next_power_of_2(h)
    if status is None:  # unchecked without a status: a scratch word nobody reads
        status = new_status(x.device) if check_values else _scratch_status(x.device)
    elif (
        not isinstance(status, torch.Tensor)
        or status.dtype != torch.int32
        or status.shape != (2,)
        or status.device != x.device
    ):
        raise FormatError(f"status must be an int32 [2] tensor on {x.device} (see new_status)")
    if spec.family == "codebook":
        groups = spec.k_groups if kind == "k" else spec.v_groups
        _codebook_write(f, x, cache, slot_mapping, lay, kind, layer, blk_stride, status, groups)
    elif spec.family == "int4":
        xin = x
        if spec.rotation is not None:
            rot = on_device(spec.rotation, x.device, lambda r: r.float().contiguous())
            x = x.float() @ rot  # same op as the reference encode
        _int4_write_kernel[(n,)](
            x,
            xin,
            cache,
            cache.view(torch.float16),
            slot_mapping,
            status,
            x.stride(0),
            x.stride(1),
            xin.stride(0),
            xin.stride(1),
            h,
            lay.page_bytes,
            blk_stride,
            H_P=hp,
            D=d,
            PS=block_size,
            CHANNEL_MAJOR=kind == "v",
            num_warps=2,
        )
    else:
        scale = spec.k_scale if kind == "k" else spec.v_scale
        _fp8_write_kernel[(n,)](
            x,
            cache,
            slot_mapping,
            x.stride(0),
            x.stride(1),
            h,
            lay.page_bytes,
            blk_stride,
            scale,
            H_P=hp,
            D=d,
            PS=block_size,
            CHANNEL_MAJOR=kind == "v",
            num_warps=2,
        )
    if check_values and spec.family != "fp8":  # fp8 clamps inf and keeps NaN (baselines.md)
        check_status(f, status, kind)


def new_status(device) -> torch.Tensor:
    """A fresh (zero) status word for ``cache_write(..., status=)``; the kernels OR their
    flags into it, so one word can collect several writes before ``check_status`` reads it."""
    return torch.zeros(2, dtype=torch.int32, device=device)


@functools.cache
def _scratch_status(device) -> torch.Tensor:
    return new_status(device)


def check_status(fmt: KVFormat | str, status: torch.Tensor, kind: str = "k") -> None:
    """Raise the reference's ``FormatError`` if a write reported rejected values in ``status``
    (reads it on the host: a device sync)."""
    f = resolve(fmt)
    flags, tok = status.tolist()
    tok = 2**31 - 1 - tok
    if flags & X_BAD:
        raise FormatError(
            f"{f.name} encodes finite values within the float16 range (|x| <= 65504); "
            f"got NaN, inf or a larger value ({kind.upper()} of token {tok} of this write)"
        )
    if flags & RMS_BAD:
        raise FormatError(
            f"{f.name}: a transformed vector's RMS exceeds float16's range "
            f"({kind.upper()} of token {tok} of this write)"
        )


def _codebook_write(f, x, cache, slot_mapping, lay, kind, layer, blk_stride, status, groups):
    """The compact formats' write: one kernel (``_write_compact.compact_write``: the transform
    on the tensor cores, the quantizer, the bit planes and the scatter). ``groups``: the
    kernel's description of the row layout (``KernelSpec.k_groups`` / ``v_groups``)."""
    if groups is None:  # a layout the kernel cannot pack: the reference encode on the host
        keep = (slot_mapping >= 0).cpu()
        rows = f.encode(x.detach().cpu()[keep], kind=kind, layer=layer).to(cache.device)
        slots = slot_mapping.cpu()[keep].to(device=cache.device, dtype=torch.int64)
        blk, off = slots // lay.block_size, slots % lay.block_size
        lay.codes_view(cache, kind)[blk, :, off] = rows[..., : lay.code_bytes]
        lay.meta_view(cache)[blk, :, off] = rows[..., lay.code_bytes :]
        return
    compact_write(f, x, cache, slot_mapping, lay, kind, layer, blk_stride, status, groups=groups)
