"""cache_write writes what kvzip_formats' reference writes (encode + paged scatter): bit-exact
for fp8, int4 and int4-rot; for the compact formats, the reference quantizer's bytes of the
kernel's own float32 transform y (spec/4bit.md section 3), which ``kernel_y`` returns."""

import pytest
import torch

from kvzip_formats import FormatError, get_format
from kvzip_formats.ops import PagedLayout, gather_rows, new_paged_cache
from kvzip_formats.ops import cache_write as ref_cache_write
from kvzip_kernels import cache_write
from kvzip_kernels.cache_write import new_status
from kvzip_kernels.testing import synthetic_calibration


def _diff_report(got: torch.Tensor, want: torch.Tensor, lay: PagedLayout) -> str:
    """Which block, head, region and bits differ (first few)."""
    bad = torch.nonzero(got != want)
    lines = [f"{len(bad)} bytes differ"]
    for blk, head, off in bad[:8].tolist():
        region = "code" if off < lay.meta_offset else "meta"
        tok = (
            off // lay.code_bytes if region == "code" else (off - lay.meta_offset) // lay.meta_bytes
        )
        g, w = int(got[blk, head, off]), int(want[blk, head, off])
        lines.append(
            f"block {blk} head {head} byte {off} ({region}, token {tok}): got {g:08b} "
            f"want {w:08b} (bits {g ^ w:08b})"
        )
    return "\n".join(lines)


def _write_both(name, x, num_blocks, block_size, slots, device, kind="k"):
    cal = synthetic_calibration(x.shape[1], x.shape[2]) if name[0].isdigit() else None
    fmt = get_format(name, calibration=cal)
    lay = PagedLayout.of(fmt, x.shape[2], block_size, kind)
    want = new_paged_cache(fmt, num_blocks, x.shape[1], block_size, x.shape[2], kind=kind)
    got = torch.full_like(want, 0).to(device)
    ref_cache_write(fmt, x, want, slots, kind=kind, block_size=block_size)
    cache_write(fmt, x.to(device), got, slots.to(device), kind=kind, block_size=block_size)
    got = got.cpu()
    assert torch.equal(got, want), _diff_report(got, want, lay)


def kernel_y(fmt, x: torch.Tensor, kind: str, layer: int = 0) -> torch.Tensor:
    """The compact write kernel's own transformed rows y (float32 ``[T, H, d]``) of ``x``: the
    kernel as ``cache_write`` runs it (its default configuration), with ``y_out=``, writing
    into a scratch cache."""
    from kvzip_kernels._write_compact import compact_write

    n, h, d = x.shape
    lay = PagedLayout.of(fmt, d, 16, kind)
    blocks = max(1, -(-n // 16))
    scratch = new_paged_cache(fmt, blocks, h, 16, d, kind=kind, device=x.device)
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    slots = torch.arange(n, device=x.device)
    compact_write(
        fmt, x, scratch, slots, lay, kind, layer, h * lay.page_bytes, new_status(x.device),
        y_out=y,
    )  # fmt: skip
    return y


def assert_quantized_from(got: torch.Tensor, y: torch.Tensor, fmt, kind: str, lay) -> None:
    """Rows ``got`` (``[..., row_bytes]``) are the reference quantizer's of ``y`` (``[..., d]``,
    float32): codes byte for byte, the token scale within 1 fp16 ulp (the kernel sums in
    another order than torch: spec/4bit.md section 4 allows the last fp16 place).

    s0 = f16(RMS of y) sums y*y in the kernel's order, the reference in torch's: where the RMS
    lies within float32 summation error (taken as 1e-6 relative) of a float16 rounding
    boundary, the two s0 may be neighbours and every code of the row may move; such rows
    (~0.2-0.4% of random rows, bounded here by 1%) are left out, all others must match."""
    got = got.reshape(-1, got.shape[-1]).cpu()
    y = y.reshape(-1, y.shape[-1]).cpu().float()
    want = fmt.quantize(y, kind=kind)
    rms = y.double().square().mean(-1).sqrt()
    sure = (rms * (1 - 1e-6)).half() == (rms * (1 + 1e-6)).half()
    assert (~sure).sum() <= max(3, 0.01 * sure.numel()), f"{int((~sure).sum())} rows unsure"
    got, want = got[sure], want[sure]
    cb = lay.code_bytes
    assert torch.equal(got[..., :cb], want[..., :cb]), _diff_report(
        got[:, None], want[:, None], lay
    )
    d16 = got[..., cb:].contiguous().view(torch.int16).int()
    assert (d16 - want[..., cb:].contiguous().view(torch.int16).int()).abs().max() <= 1


@pytest.mark.parametrize("name", ["int4", "fp8", "int4-rot"])
@pytest.mark.parametrize(
    ("heads", "head_dim", "block_size"), [(3, 64, 16), (8, 128, 64), (1, 128, 16)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bit_exact_random(name, heads, head_dim, block_size, dtype, device):
    if name == "int4-rot" and device == "cuda":
        pytest.skip("int4-rot rotates with a torch matmul; bit-exact only against itself on CPU")
    g = torch.Generator().manual_seed(heads * head_dim + block_size)
    n, blocks = 23, 4  # 23 tokens into 64+ slots: partial pages, scattered order
    x = (torch.randn(n, heads, head_dim, generator=g) * 3).to(dtype)
    slots = torch.randperm(blocks * block_size, generator=g)[:n]
    slots[[2, 11]] = -1  # vLLM's padding tokens are skipped
    _write_both(name, x, blocks, block_size, slots, device)


@pytest.mark.parametrize("name", ["4bit", "3.5bit", "3bit"])
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("head_dim", [128, 64])
def test_compact_write(name, kind, head_dim, device):
    """Compact formats: the kernel's bytes are the reference quantizer's of its own transformed
    rows y (float32, spec/4bit.md section 3), codes byte for byte, in K (token-major) and V
    (channel-major) pages of their own row sizes; the token scale within its last fp16 place
    (reduction order, allowed by the spec). Head_dim 64 with 3 KV heads is SmolLM2's shape
    (3bit: groups of 32 channels). Skipped tokens (slot -1) write nothing."""
    from kvzip_kernels._formats import _kernel_groups

    g = torch.Generator().manual_seed(5)
    fmt = get_format(name, calibration=synthetic_calibration(3, head_dim))
    assert _kernel_groups(fmt.spec.layout(head_dim, kind)) is not None  # the kernel, no fallback
    x = (torch.randn(12, 3, head_dim, generator=g) * 3).to(device)
    slots = torch.randperm(64, generator=g)[:12]
    slots[7] = -1
    lay = PagedLayout.of(fmt, head_dim, 16, kind)
    cache = new_paged_cache(fmt, 4, 3, 16, head_dim, kind=kind, device=device)
    cache_write(fmt, x, cache, slots.to(device), kind=kind, block_size=16)
    keep = slots >= 0
    rows = gather_rows(cache.cpu(), lay, torch.arange(4), 64, kind)
    assert_quantized_from(
        rows[slots[keep]], kernel_y(fmt, x, kind)[keep.to(device)], fmt, kind, lay
    )
    written = torch.zeros(64, dtype=torch.bool)
    written[slots[keep]] = True
    assert not rows[~written].any()


@pytest.mark.parametrize("name", ["int4", "fp8"])
def test_bit_exact_edge_values(name, device):
    """Constant rows (scale 0), zeros, huge values, fp16-range extremes, fp8 rounding ties."""
    rows = [
        torch.zeros(64),
        torch.full((64,), 3.25),
        torch.linspace(-1, 1, 64) * 6e4,
        torch.linspace(-1e-6, 1e-6, 64),
        torch.tensor(
            [
                127.75,
                -124.3,
                448.0,
                500.0,
                -1e4,
                2**-7,
                2**-10,
                3 * 2**-10,
                0.0156,
                1.0625,
                1.1875,
                -0.0,
            ],
            dtype=torch.float32,
        ).repeat(6)[:64],
    ]
    x = torch.stack(rows).view(len(rows), 1, 64)
    _write_both(name, x, 1, 16, torch.arange(len(rows)), device)
    if name == "fp8":  # also +-inf: the reference clamps to +-448
        x = torch.tensor([float("inf"), float("-inf")] * 32).view(1, 1, 64)
        _write_both(name, x, 1, 16, torch.tensor([3]), device)


def test_bad_inputs(device):
    fmt = get_format("int4")
    cache = new_paged_cache(fmt, 2, 2, 16, 64, device=device)
    x = torch.randn(3, 2, 64, device=device)
    slots = torch.arange(3, device=device)
    with pytest.raises(FormatError, match="slot_mapping holds slot 40"):
        cache_write(fmt, x, cache, torch.tensor([0, 1, 40], device=device), kind="k", block_size=16)
    with pytest.raises(FormatError, match="KV heads, expected 3"):
        cache_write(
            fmt, torch.randn(3, 3, 64, device=device), cache, slots, kind="k", block_size=16
        )
    with pytest.raises(FormatError, match="uint8"):
        cache_write(fmt, x, cache.float(), slots, kind="k", block_size=16)
    with pytest.raises(FormatError, match="dtype"):
        cache_write(fmt, x.to(torch.int32), cache, slots, kind="k", block_size=16)
    with pytest.raises(FormatError, match="kind"):
        cache_write(fmt, x, cache, slots, kind="q", block_size=16)
    with pytest.raises(FormatError, match="no kvzip_kernels implementation"):
        cache_write("turbo4", x, cache, slots, kind="k", block_size=16)
    with pytest.raises(FormatError, match="head_dim"):
        cache_write(
            fmt, torch.randn(3, 2, 96, device=device), cache, slots, kind="k", block_size=16
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bit_exact_many_tokens():
    """The GPU build on a realistic slice: 4,099 tokens of the 8B shape, both formats."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4099, 8, 128, generator=g).to(torch.bfloat16) * 4
    slots = torch.randperm(300 * 16, generator=g)[:4099]
    for name in ("int4", "fp8"):
        _write_both(name, x, 300, 16, slots, "cuda", kind="v")


def test_block_strided_cache(device):
    fmt = get_format("int4")
    x = torch.randn(9, 2, 64).to(device)
    slots = torch.randperm(48)[:9].to(device)
    want = new_paged_cache(fmt, 3, 2, 16, 64, device=device)
    cache_write(fmt, x, want, slots, kind="v", block_size=16)
    kv = torch.zeros(3, 2, 2, want.shape[2], dtype=torch.uint8, device=device)
    cache_write(fmt, x, kv[:, 1], slots, kind="v", block_size=16, block_stride=kv.stride(0))
    assert torch.equal(kv[:, 1], want) and not kv[:, 0].any()


# spec/4bit.md section 9 and spec/baselines.md: NaN, inf or |x| > 65504 is rejected.
BAD_VALUES = [float("nan"), float("inf"), float("-inf"), 7e4]


def _bad_case(name, kind, value, head_dim=128, rms=False):
    """4 tokens of 2 KV heads in float32; token 2, head 1 holds ``value`` at channel 5 (or,
    ``rms``, is +-65504 everywhere: finite and in range, but its transformed RMS overflows)."""
    g = torch.Generator().manual_seed(11)
    cal = synthetic_calibration(2, head_dim) if name[0].isdigit() else None
    fmt = get_format(name, calibration=cal)
    x = torch.randn(4, 2, head_dim, generator=g) * 2
    if rms:
        x[2, 1] = torch.sign(torch.randn(head_dim, generator=g)) * 65504
    else:
        x[2, 1, 5] = value
    return fmt, x


@pytest.mark.parametrize(
    ("name", "head_dim"),
    [("4bit", 128), ("3.5bit", 128), ("3bit", 128), ("3bit", 64), ("int4", 128), ("int4-rot", 64)],
)
@pytest.mark.parametrize("value", [*BAD_VALUES, "rms"])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_rejected_values(name, head_dim, value, kind, device):
    """Every path rejects what the reference rejects, with its message and the token: the ops
    reference, the kernel (checked), and the kernel unchecked (no raise, but the rejected row
    decodes to NaN while every other row is written as the reference writes it)."""
    from kvzip_kernels.cache_write import check_status, new_status

    if value == "rms" and not name[0].isdigit():
        pytest.skip("the RMS rule is the compact formats' (int4 has no transform)")
    rms = value == "rms"
    fmt, x = _bad_case(name, "k", None if rms else value, head_dim, rms=rms)
    match = "RMS exceeds" if rms else "finite values within the float16 range"
    slots = torch.tensor([3, 17, 20, 8])
    lay = PagedLayout.of(fmt, head_dim, 16, kind)
    want = new_paged_cache(fmt, 2, 2, 16, head_dim, kind=kind)
    with pytest.raises(FormatError, match=match):
        ref_cache_write(fmt, x, want, slots, kind=kind, block_size=16)
    assert not want.any()  # the reference writes nothing
    got = new_paged_cache(fmt, 2, 2, 16, head_dim, kind=kind, device=device)
    xd, sd = x.to(device), slots.to(device)
    with pytest.raises(FormatError, match=match + r".*token 2 of this write"):
        cache_write(fmt, xd, got, sd, kind=kind, block_size=16)
    # unchecked: the same kernel, its verdict in a status word read afterwards
    got.zero_()
    status = new_status(device)
    cache_write(fmt, xd, got, sd, kind=kind, block_size=16, check_values=False, status=status)
    with pytest.raises(FormatError, match=match):
        check_status(fmt, status, kind)
    rows = gather_rows(got.cpu(), lay, torch.arange(2), 32, kind)[slots]
    fixed = x.clone()
    fixed[2, 1] = 0.0  # what every other row must hold: the rows encoded without the bad one
    ok = torch.ones(4, 2, dtype=torch.bool)
    ok[2, 1] = False
    if name[0].isdigit():  # given the kernel's y (as test_compact_write)
        y = kernel_y(fmt, fixed.to(device), kind).cpu()
        assert_quantized_from(rows[ok], y[ok], fmt, kind, lay)
    else:
        assert torch.equal(rows[ok], fmt.encode(fixed, kind=kind, layer=0)[ok])
    bad = fmt.decode(rows[2:3], kind=kind, layer=0, head_dim=head_dim)
    assert torch.isnan(bad[0, 1]).all()  # the rejected row decodes to NaN
    assert torch.isfinite(bad[0, 0]).all()  # its token's other head is a valid row


@pytest.mark.parametrize("name", ["4bit", "int4"])
def test_rejected_value_in_skipped_token_is_not_an_input(name, device):
    """A padding token (slot -1) is never encoded: its NaN raises on no path."""
    fmt, x = _bad_case(name, "k", float("nan"))
    slots = torch.tensor([3, 17, -1, 8])
    want = new_paged_cache(fmt, 2, 2, 16, 128, kind="v")
    ref_cache_write(fmt, x, want, slots, kind="v", block_size=16)
    got = new_paged_cache(fmt, 2, 2, 16, 128, kind="v", device=device)
    cache_write(fmt, x.to(device), got, slots.to(device), kind="v", block_size=16)
    assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["k", "v"])
def test_gpu_compact_write_head_dim_64(kind):
    """3bit at SmolLM2's shape on the GPU: 2,051 tokens at random slots, the bytes the
    quantizer's of the kernel's y (codes exact, scales <= 1 ulp)."""
    g = torch.Generator().manual_seed(8)
    fmt = get_format("3bit", calibration=synthetic_calibration(3, 64))
    x = (torch.randn(2051, 3, 64, generator=g) * 3).bfloat16().cuda()
    slots = torch.randperm(200 * 16, generator=g)[:2051]
    lay = PagedLayout.of(fmt, 64, 16, kind)
    cache = new_paged_cache(fmt, 200, 3, 16, 64, kind=kind, device="cuda")
    cache_write(fmt, x, cache, slots.cuda(), kind=kind, block_size=16)
    got = gather_rows(cache.cpu(), lay, torch.arange(200), 200 * 16, kind)[slots]
    assert_quantized_from(got, kernel_y(fmt, x, kind), fmt, kind, lay)


def _y64(fmt, x: torch.Tensor, kind: str) -> torch.Tensor:
    """The float64 transform y = A (x - mean) of spec/4bit.md section 3, [T, H, d]."""
    t = fmt.transform_of(kind, 0)
    xc = x.double() - t.mean.double()
    return torch.einsum("hij,thj->thi", t.encode.double(), xc)


CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ],
)


@pytest.mark.parametrize("dev", ["cpu", CUDA])
@pytest.mark.parametrize(
    ("name", "dtype"),
    [("4bit", torch.bfloat16), ("3.5bit", torch.bfloat16), ("3bit", torch.bfloat16),
     ("3.5bit", torch.float16), ("4bit", torch.float32), ("3bit", torch.float32)],
    ids=["4bit-bf16", "3.5bit-bf16", "3bit-bf16", "3.5bit-fp16", "4bit-fp32", "3bit-fp32"],
)  # fmt: skip
def test_compact_write_as_vllm_calls_it(name, dtype, dev):
    """The shipped write at the 8B shape as kvzip-vllm's backend calls it (K and V pages side by
    side in each block of one byte tensor, through ``block_stride``; no host reads): on the
    GPU 4,099 bf16 tokens (1,031 for float16 / float32 x, whose kernel runs 64-token tiles),
    on the CPU (the interpreter) 150 / 70, written as vLLM writes a prompt (consecutive slots
    filling a block, the blocks in random order, padding slots -1). K and V: the quantizer's
    bytes of the kernel's y; that y within float32 accumulation error of the float64
    transform (1e-5 of max |y|, as test_write_compact.py); no other slot written; the status
    word clean."""
    if dev == "cpu" and torch.cuda.is_available():
        pytest.skip("the interpreter twin of the cuda case")
    g = torch.Generator().manual_seed(9)
    heads, d, ps = 8, 128, 16
    n = (
        (4099 if dtype == torch.bfloat16 else 1031)
        if dev == "cuda"
        else (150 if dtype == torch.bfloat16 else 70)
    )
    fmt = get_format(name, calibration=synthetic_calibration(heads, d))
    x = {kd: (torch.randn(n, heads, d, generator=g) * 3).to(dtype).to(dev) for kd in "kv"}
    nb = n // ps + 9
    blocks = torch.randperm(nb, generator=g)[: -(-n // ps)]
    slots = (blocks[:, None] * ps + torch.arange(ps)).flatten()[:n]
    slots[[3, n // 2, n - 1]] = -1
    lays = {kd: PagedLayout.of(fmt, d, ps, kd) for kd in "kv"}
    hk = heads * lays["k"].page_bytes
    buf = torch.zeros(nb, hk + heads * lays["v"].page_bytes, dtype=torch.uint8, device=dev)
    pages = {"k": buf[:, :hk].unflatten(1, (heads, -1)), "v": buf[:, hk:].unflatten(1, (heads, -1))}
    status = new_status(dev)
    for kd in "kv":
        cache_write(
            fmt, x[kd], pages[kd], slots.to(dev), kind=kd, block_size=ps, check_slots=False,
            check_values=False, status=status, block_stride=buf.stride(0),
        )  # fmt: skip
    assert not status.any()
    keep = slots >= 0
    for kd in "kv":
        rows = gather_rows(pages[kd].contiguous().cpu(), lays[kd], torch.arange(nb), nb * ps, kd)
        y = kernel_y(fmt, x[kd], kd).cpu()[keep]
        assert_quantized_from(rows[slots[keep]], y, fmt, kd, lays[kd])
        written = torch.zeros(nb * ps, dtype=torch.bool)
        written[slots[keep]] = True
        assert not rows[~written].any()
        exact = _y64(fmt, x[kd].cpu(), kd)[keep]
        err = ((y - exact).abs().max() / exact.abs().max()).item()
        assert err < 1e-5, f"{kd}: y off by {err:.1e} of max |y|"
