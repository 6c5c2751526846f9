"""The research variant ``write_fused.py`` (not shipped: the compact formats' cache-write in one
kernel): given its own transformed rows y, its bytes are the reference quantizer's; its y is
the float32 transform within float32 rounding; rejected rows as the package's write.

    TRITON_INTERPRET=1 PYTHONPATH=packages/kvzip-kernels/tests:packages/kvzip-kernels/benchmarks \
        python3 -m pytest -q packages/kvzip-kernels/benchmarks/test_write_fused.py
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_cache_write import _bad_case, _diff_report  # noqa: E402
from write_fused import codebook_write_fused, split_y  # noqa: E402

from kvzip_formats import FormatError, get_format  # noqa: E402
from kvzip_formats.ops import PagedLayout, gather_rows, new_paged_cache  # noqa: E402
from kvzip_kernels.cache_write import check_status, new_status  # noqa: E402
from kvzip_kernels.testing import synthetic_calibration  # noqa: E402


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


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
    ref = split_y(fmt, x.to(device), kind, 0).cpu()[keep]  # skipped tokens: no y
    err = ((y.cpu()[keep] - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-5, f"fused y differs from the float32 bmm by {err:.1e} (relative)"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 70000.0, "rms"])
def test_fused_write_rejects_as_the_split_path(value, device):
    """A bad row raises the reference's error naming its token; unchecked, it decodes to NaN
    and the token's other head is written."""
    rms = value == "rms"
    fmt, x = _bad_case("4bit", "k", None if rms else value, 128, rms=rms)
    match = "RMS exceeds" if rms else "finite values within the float16 range"
    slots = torch.tensor([3, 17, 20, 8]).to(device)
    got = new_paged_cache(fmt, 2, 2, 16, 128, kind="k", device=device)
    lay = PagedLayout.of(fmt, 128, 16, "k")
    _, status = _fused(fmt, x.to(device), got, slots, "k", lay)
    with pytest.raises(FormatError, match=match + r".*token 2 of this write"):
        check_status(fmt, status, "k")
    rows = gather_rows(got.cpu(), lay, torch.arange(2), 32, "k")[slots.cpu()]
    bad = fmt.decode(rows[2:3], kind="k", layer=0, head_dim=128)
    assert torch.isnan(bad[0, 1]).all() and torch.isfinite(bad[0, 0]).all()
