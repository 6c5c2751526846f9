"""A calibration sliced to a tensor-parallel rank's KV heads (``Calibration.for_heads``)."""

from __future__ import annotations

import pytest
import torch

import kvzip_formats as kf
from kvzip_formats.calibration import TENSOR_NAMES, Calibration, CalibrationError

L, H, GROUP, D = 2, 4, 2, 64


def calibration(seed=0) -> Calibration:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in TENSOR_NAMES:
        t = torch.randn(L, H, D, generator=g)
        tensors[name] = (t.abs() + 0.1 if name.endswith(("_var", "_weight")) else t).float()
    model = dict(
        name="toy", identity="abc", num_layers=L, num_kv_heads=H, num_q_heads=H * GROUP, head_dim=D
    )
    return Calibration(model=model, tensors=tensors)


def test_for_heads_slices_every_statistic_and_records_the_heads():
    cal = calibration()
    part = cal.for_heads(1, 3)
    assert part.num_kv_heads == 2 and part.model["num_q_heads"] == 2 * GROUP
    assert part.model["kv_heads"] == [1, 3] and part.model["total_kv_heads"] == H
    for name in TENSOR_NAMES:
        assert torch.equal(part.tensors[name], cal.tensors[name][:, 1:3])
    # a slice of a slice names heads of the whole
    assert part.for_heads(1, 2).model["kv_heads"] == [2, 3]


@pytest.mark.parametrize(("start", "stop"), [(0, 0), (2, 1), (-1, 2), (0, 5), (4, 5)])
def test_for_heads_refuses_ranges_outside_the_heads(start, stop):
    with pytest.raises(CalibrationError, match=f"KV heads \\[{start}, {stop}\\) are not within"):
        calibration().for_heads(start, stop)


@pytest.mark.parametrize("name", ["4bit", "3.5bit", "3bit"])
@pytest.mark.parametrize(("start", "stop"), [(0, 2), (2, 4), (3, 4)])
def test_sliced_format_codes_those_heads_bit_for_bit(name, start, stop):
    cal = calibration()
    full = kf.get_format(name, calibration=cal)
    part = kf.get_format(name, calibration=cal.for_heads(start, stop))
    g = torch.Generator().manual_seed(1)
    for layer in range(L):
        for kind in ("k", "v"):
            x = (torch.randn(24, H, D, generator=g) * 2 + 0.5).to(torch.bfloat16)
            packed = full.encode(x, kind=kind, layer=layer)
            mine = part.encode(x[:, start:stop].contiguous(), kind=kind, layer=layer)
            assert torch.equal(mine, packed[:, start:stop])
            dec = full.decode(packed, kind=kind, layer=layer, head_dim=D)
            dec_part = part.decode(mine, kind=kind, layer=layer, head_dim=D)
            assert torch.equal(dec_part, dec[:, start:stop])


def test_sliced_format_refuses_the_whole_models_heads():
    fmt = kf.get_format("4bit", calibration=calibration().for_heads(0, 2))
    x = torch.randn(4, H, D).to(torch.bfloat16)
    with pytest.raises(CalibrationError, match="input has 4 KV heads .* has 2 of 64"):
        fmt.encode(x, kind="k", layer=0)
