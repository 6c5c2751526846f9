"""cache_write kernels are bit-exact with kvzip_formats' reference encode + paged scatter."""

import pytest
import torch

from kvzip_formats import FormatError, get_format
from kvzip_formats.ops import PagedLayout, gather_rows, new_paged_cache
from kvzip_formats.ops import cache_write as ref_cache_write
from kvzip_kernels import cache_write
from kvzip_kernels.cache_write import codebook_y
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
def test_compact_write(name, kind, device):
    """Compact formats: given the transformed rows y (float32, spec/4bit.md section 3), the
    kernel's quantizer and bit-plane packing equal the reference quantizer byte for byte, in
    K (token-major) and V (channel-major) pages of their own row sizes. On the GPU the token
    scale may differ in the last fp16 place (reduction order, allowed by the spec)."""
    g = torch.Generator().manual_seed(5)
    fmt = get_format(name, calibration=synthetic_calibration(3, 128))
    x = (torch.randn(12, 3, 128, generator=g) * 3).to(device)  # the interpreter runs per token
    slots = torch.randperm(64, generator=g)[:12]
    slots[7] = -1
    lay = PagedLayout.of(fmt, 128, 16, kind)
    cache = new_paged_cache(fmt, 4, 3, 16, 128, kind=kind, device=device)
    cache_write(fmt, x, cache, slots.to(device), kind=kind, block_size=16)
    keep = slots >= 0
    want = fmt.quantize(codebook_y(fmt, x, kind, 0).cpu(), kind=kind)[keep]
    got = gather_rows(cache.cpu(), lay, torch.arange(4), 64, kind)[slots[keep]]
    cb = lay.code_bytes
    assert torch.equal(got[..., :cb], want[..., :cb]), _diff_report(got, want, lay)
    scale_diff = (
        got[..., cb:].contiguous().view(torch.int16).int()
        - want[..., cb:].contiguous().view(torch.int16).int()
    ).abs()
    assert scale_diff.max() <= (1 if device == "cuda" else 0)


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
