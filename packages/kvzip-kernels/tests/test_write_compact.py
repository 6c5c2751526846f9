"""The compact formats' one-kernel cache-write (``_write_compact.py``: the transform on the
tensor cores as exact bfloat16 pieces, the quantizer and the bit planes from registers).

The package's write of the compact formats (``cache_write`` calls it; ``test_cache_write.py``
checks it through ``cache_write``). Here, called directly in several tile configurations:
given its own transformed rows y (returned by ``y_out=``), its bytes are the reference
quantizer's (spec/4bit.md section 4: conformance given y), and its y is the float64 transform
within float32 accumulation error (as a float32 torch matmul's)."""

import pytest
import torch
from test_cache_write import _bad_case, _y64, assert_quantized_from

from kvzip_formats import FormatError, get_format
from kvzip_formats.ops import PagedLayout, gather_rows, new_paged_cache
from kvzip_kernels.cache_write import check_status, new_status
from kvzip_kernels.testing import synthetic_calibration


def _write(fmt, x, cache, slots, kind, lay, block_t, status=None, num_warps=4, programs=-1):
    from kvzip_kernels._write_compact import compact_write

    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    status = new_status(x.device) if status is None else status
    stride = cache.shape[1] * lay.page_bytes
    compact_write(
        fmt, x, cache, slots, lay, kind, 0, stride, status, y_out=y, block_t=block_t,
        num_warps=num_warps, programs=programs,
    )  # fmt: skip
    return y, status


def _check(
    fmt, x, slots, kind, heads, head_dim, device, block_t, pages=8, num_warps=4, programs=-1
):
    lay = PagedLayout.of(fmt, head_dim, 16, kind)
    cache = new_paged_cache(fmt, pages, heads, 16, head_dim, kind=kind, device=device)
    y, status = _write(
        fmt, x.to(device), cache, slots.to(device), kind, lay, block_t, num_warps=num_warps,
        programs=programs,
    )  # fmt: skip
    assert not status.any()
    keep = slots >= 0
    y = y.cpu()[keep]
    rows = gather_rows(cache.cpu(), lay, torch.arange(pages), pages * 16, kind)
    assert_quantized_from(rows[slots[keep]], y, fmt, kind, lay)
    written = torch.zeros(pages * 16, dtype=torch.bool)
    written[slots[keep]] = True
    assert not rows[~written].any()  # no other slot written
    exact = _y64(fmt, x.cpu(), kind)[keep]
    t = fmt.transform_of(kind, 0)  # the yardstick: a float32 torch matmul
    f32 = torch.einsum("hij,thj->thi", t.encode.float(), x.cpu().float() - t.mean.float())[keep]
    scale = exact.abs().max()
    err, err_f32 = ((y - exact).abs().max() / scale).item(), ((f32 - exact).abs().max() / scale)
    # float32 accumulation (the tensor cores' included): a float32 matmul is ~2e-7 of the
    # largest |y| off here; the bound is the earlier fused write's (1e-5)
    assert err < 1e-5, f"y off by {err:.1e} of max |y| (a float32 matmul: {err_f32:.1e})"


@pytest.mark.parametrize("name", ["4bit", "3.5bit", "3bit"])
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize(("heads", "head_dim", "tokens"), [(3, 128, 45), (2, 64, 37)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_compact_write_is_the_quantizer_of_its_y(
    name, kind, heads, head_dim, tokens, dtype, device
):
    """Codes byte for byte, scales within 1 fp16 ulp (reduction order); skipped tokens (-1)
    untouched; a tile's tail masked (45 and 37 tokens in tiles of 32); bf16 x is one bfloat16
    piece, fp16 two, fp32 three; one program per head loops over the tiles."""
    g = torch.Generator().manual_seed(11 + tokens)
    fmt = get_format(name, calibration=synthetic_calibration(heads, head_dim))
    x = (torch.randn(tokens, heads, head_dim, generator=g) * 3).to(dtype)
    slots = torch.randperm(8 * 16, generator=g)[:tokens]
    slots[5] = slots[40 % tokens] = -1
    _check(fmt, x, slots, kind, heads, head_dim, device, block_t=32, programs=1)


@pytest.mark.parametrize("kind", ["k", "v"])
def test_compact_write_ties_zero_rows_and_offsets(kind, device):
    """Values on the decision edges (u exactly an edge: y = s0 * edge with s0 a power of two;
    ties go to the lower level on both sides of 0), an all-zero row (s0 = 0: every u is 0,
    code 2**(b-1) - 1), a row whose mean is far from zero (the folded bias A mean), and
    contiguous slots of whole pages as vLLM writes a prompt."""
    from kvzip_formats.compact import codebook

    heads, d = 2, 128
    cal = synthetic_calibration(heads, d)
    fmt = get_format("4bit", calibration=cal)
    t = fmt.transform_of(kind, 0)
    e = codebook.edges(4)
    # y rows with u on the edges: y = s0 * (+-edges), s0 = RMS rounded to fp16; pick y then
    # x = B y + mean (float64), rounded to bf16 moves y off the edges, so build the rows in
    # float32 x and check the quantizer of the kernel's own y (the tie rule then applies
    # wherever y / s0 lands on an edge exactly)
    yrow = torch.cat((e, -e, e[:8], torch.zeros(128 - 38)))[:d] * 0.5
    x = torch.zeros(34, heads, d, dtype=torch.float64)
    for hh in range(heads):
        x[0, hh] = t.decode[hh].double() @ yrow.double() + t.mean[hh].double()
    x[1] = t.mean.double()  # y = 0 up to rounding
    x[2:] = torch.randn(32, heads, d, generator=torch.Generator().manual_seed(3)) + 40.0
    slots = torch.cat((torch.tensor([70, 71]), torch.arange(32)))  # two whole pages 0, 1
    _check(fmt, x.float(), slots, kind, heads, d, device, block_t=32, pages=8)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 70000.0, "rms"])
def test_compact_write_rejects_bad_rows(value, device):
    """A bad row raises the reference's error naming its token; unchecked, it decodes to NaN
    and the token's other head is written."""
    rms = value == "rms"
    fmt, x = _bad_case("4bit", "k", None if rms else value, 128, rms=rms)
    match = "RMS exceeds" if rms else "finite values within the float16 range"
    slots = torch.tensor([3, 17, 20, 8]).to(device)
    got = new_paged_cache(fmt, 2, 2, 16, 128, kind="k", device=device)
    lay = PagedLayout.of(fmt, 128, 16, "k")
    _, status = _write(fmt, x.to(device), got, slots, "k", lay, block_t=32)
    with pytest.raises(FormatError, match=match + r".*token 2 of this write"):
        check_status(fmt, status, "k")
    rows = gather_rows(got.cpu(), lay, torch.arange(2), 32, "k")[slots.cpu()]
    bad = fmt.decode(rows[2:3], kind="k", layer=0, head_dim=128)
    assert torch.isnan(bad[0, 1]).all() and torch.isfinite(bad[0, 0]).all()


def _gpu_codes(y: torch.Tensor, s0: torch.Tensor, bits: int) -> torch.Tensor:
    """The GPU path's codes, emulated: r = RN(1/s0), q = RN(y r), e = RN(y - q s0), u =
    RN(q + e r) (float64 holds the products of two float32 exactly; the last sum is rounded
    to float64 and then to float32, which can differ from one fma only within 2**-53 of a
    float32 midpoint), the sign of u by y * 2**64 > s0 * 2**-86, then the edge count on |u|
    (or its next float for u <= 0) as the kernel does it."""
    from kvzip_formats.compact import codebook

    r = (1.0 / s0.double()).float()
    q = (y.double() * r.double()).float()
    e = (y.double() - q.double() * s0.double()).float()
    u = (q.double() + e.double() * r.double()).float()
    pos = y * 2.0**64 > s0 * 2.0**-86
    a = u.abs()
    a = torch.where(pos, a, (a.view(torch.int32) + 1).view(torch.float32))
    half = 1 << (bits - 1)
    m = (a[:, None] > codebook.edges(bits)[half:][None, :]).sum(1)
    return torch.where(pos, half + m, half - 1 - m)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_gpu_quotient_and_codes_are_the_references(bits):
    """Codes from u = y / s0 by one Newton correction and the exact sign test equal the
    reference's codes (IEEE division, then the count of edges below u) for s0 an fp16 value:
    random y over the float32 range a row holds, y on and next to s0 * edge (ties), and the
    subnormal quotients where the correction alone is not exact (y = +-2**-149)."""
    from kvzip_formats.compact import codebook

    g = torch.Generator().manual_seed(bits)
    n = 1_000_000
    s0 = torch.randn(n, generator=g).abs().mul(30).add(2**-14).half().float()
    y = torch.randn(n, generator=g) * s0 * 2
    edges = codebook.edges(bits)
    e = edges[torch.randint(0, len(edges), (n // 4,), generator=g)]
    s = s0[: n // 4]
    near = [torch.nextafter(e * s, e * s + d) for d in (-1e9, 0, 1e9)]
    tiny = torch.tensor([2**-149, -(2**-149), 3 * 2**-149, 0.0, -0.0]).repeat(n // 20)
    y = torch.cat((y, *near, tiny, y * 1e-20, y * 1e20))
    s0 = torch.cat((s0, s, s, s, s0[: len(tiny)], s0, s0))
    want = torch.bucketize(y / s0, edges, right=False)
    got = _gpu_codes(y, s0, bits)
    assert torch.equal(got, want), f"{int((got != want).sum())} codes differ"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles for a CUDA device")
def test_compact_write_compiles_once_for_every_token_count():
    """A step's token count (1 for a decode of one sequence, 16, a prefill chunk's) does not
    compile the write again (vLLM's JIT monitor counts that as a latency spike mid-serving);
    each write is still the quantizer of its y."""
    from kvzip_kernels._write_compact import _compact_write_kernel

    def compiled():
        return sum(len(c[0]) for c in _compact_write_kernel.device_caches.values())

    fmt = get_format("4bit", calibration=synthetic_calibration(2, 128))
    g = torch.Generator().manual_seed(5)

    def write(tokens):
        x = (torch.randn(tokens, 2, 128, generator=g) * 3).to(torch.bfloat16)
        slots = torch.randperm(8 * 16, generator=g)[:tokens]
        _check(fmt, x, slots, "k", 2, 128, "cuda", block_t=32)

    write(5)
    before = compiled()
    for tokens in (1, 16, 17, 32, 100):
        write(tokens)
    assert compiled() == before
