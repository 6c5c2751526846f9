"""The compact formats' one-kernel cache-write (``_write_fused.py``, KVZIP_KERNELS_CACHE_WRITE=
fused): given its own transformed rows y, its bytes are the reference quantizer's; its y is
the float32 transform within float32 rounding; rejected rows as the split path."""

import pytest
import torch
from test_cache_write import _bad_case, _diff_report

from kvzip_formats import FormatError, get_format
from kvzip_formats.ops import PagedLayout, gather_rows, new_paged_cache
from kvzip_kernels import cache_write
from kvzip_kernels.cache_write import codebook_write_fused, codebook_y, new_status, write_path
from kvzip_kernels.testing import synthetic_calibration


def _fused(fmt, x, cache, slots, kind, lay, status=None):
    """The fused kernel with its y returned (float32 [T, H, d])."""
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    status = new_status(x.device) if status is None else status
    stride = cache.shape[1] * lay.page_bytes
    codebook_write_fused(fmt, x, cache, slots, lay, kind, 0, stride, status, y_out=y)
    return y, status


@pytest.mark.parametrize("name", ["4bit", "3.5bit", "3bit"])
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize(("heads", "head_dim", "tokens"), [(3, 128, 45), (3, 64, 37)])
def test_fused_write_is_the_quantizer_of_its_y(name, kind, heads, head_dim, tokens, device):
    """Codes byte for byte, scales within 1 fp16 ulp on the GPU (reduction order, as the split
    kernel) and equal here; skipped tokens (-1) untouched; the tile's tail masked (45 and 37
    tokens are not multiples of the 32-token tile); y within float32 rounding of the bmm."""
    g = torch.Generator().manual_seed(11)
    fmt = get_format(name, calibration=synthetic_calibration(heads, head_dim))
    x = (torch.randn(tokens, heads, head_dim, generator=g) * 3).bfloat16()
    slots = torch.randperm(8 * 16, generator=g)[:tokens]
    slots[5] = slots[40 % tokens] = -1
    lay = PagedLayout.of(fmt, head_dim, 16, kind)
    cache = new_paged_cache(fmt, 8, heads, 16, head_dim, kind=kind, device=device)
    y, status = _fused(fmt, x.to(device), cache, slots.to(device), kind, lay)
    assert not status.any()
    keep = slots >= 0
    want = fmt.quantize(y.cpu(), kind=kind)[keep]
    got = gather_rows(cache.cpu(), lay, torch.arange(8), 8 * 16, kind)[slots[keep]]
    cb = lay.code_bytes
    assert torch.equal(got[..., :cb], want[..., :cb]), _diff_report(got, want, lay)
    d16 = got[..., cb:].contiguous().view(torch.int16).int()
    assert (d16 - want[..., cb:].contiguous().view(torch.int16).int()).abs().max() <= (
        1 if device == "cuda" else 0
    )
    written = torch.zeros(8 * 16, dtype=torch.bool)
    written[slots[keep]] = True
    rows = gather_rows(cache.cpu(), lay, torch.arange(8), 8 * 16, kind)
    assert not rows[~written].any()  # no other slot written
    ref = codebook_y(fmt, x.to(device), kind, 0).cpu()[keep]  # skipped tokens: no y
    err = ((y.cpu()[keep] - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-5, f"fused y differs from the float32 bmm by {err:.1e} (relative)"


@pytest.mark.parametrize("name", ["4bit", "3bit"])
def test_fused_write_path_in_cache_write(name, device, monkeypatch):
    """KVZIP_KERNELS_CACHE_WRITE=fused routes cache_write through the fused kernel (the same
    bytes as a direct call); an unknown value is an error naming the known ones."""
    fmt = get_format(name, calibration=synthetic_calibration(2, 128))
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(20, 2, 128, generator=g) * 2).to(device)
    slots = torch.arange(20).to(device)
    lay = PagedLayout.of(fmt, 128, 16, "v")
    a = new_paged_cache(fmt, 2, 2, 16, 128, kind="v", device=device)
    b = torch.zeros_like(a)
    monkeypatch.setenv("KVZIP_KERNELS_CACHE_WRITE", "fused")
    assert write_path() == "fused"
    cache_write(fmt, x, a, slots, kind="v", block_size=16)
    _fused(fmt, x, b, slots, "v", lay)
    assert torch.equal(a, b)
    monkeypatch.setenv("KVZIP_KERNELS_CACHE_WRITE", "unfused")
    with pytest.raises(FormatError, match="must be one of"):
        cache_write(fmt, x, a, slots, kind="v", block_size=16)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 70000.0, "rms"])
def test_fused_write_rejects_as_the_split_path(value, device, monkeypatch):
    """A bad row raises the reference's error naming its token; unchecked, it decodes to NaN
    and the token's other head is written."""
    rms = value == "rms"
    fmt, x = _bad_case("4bit", "k", None if rms else value, 128, rms=rms)
    match = "RMS exceeds" if rms else "finite values within the float16 range"
    slots = torch.tensor([3, 17, 20, 8]).to(device)
    monkeypatch.setenv("KVZIP_KERNELS_CACHE_WRITE", "fused")
    got = new_paged_cache(fmt, 2, 2, 16, 128, kind="k", device=device)
    with pytest.raises(FormatError, match=match + r".*token 2 of this write"):
        cache_write(fmt, x.to(device), got, slots, kind="k", block_size=16)
    lay = PagedLayout.of(fmt, 128, 16, "k")
    rows = gather_rows(got.cpu(), lay, torch.arange(2), 32, "k")[slots.cpu()]
    bad = fmt.decode(rows[2:3], kind="k", layer=0, head_dim=128)
    assert torch.isnan(bad[0, 1]).all() and torch.isfinite(bad[0, 0]).all()
