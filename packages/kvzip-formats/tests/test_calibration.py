"""The calibration artifact: statistics, save/load round trip, versioning, rejected files."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import kvzip_formats as kf
from kvzip_formats.calibration import (
    CALIBRATION_VERSION,
    JSON_NAME,
    STATS_START,
    TENSORS_NAME,
    Calibration,
    CalibrationError,
    StatsAccumulator,
    as_calibration,
)

L, HQ, H, D = 3, 6, 2, 16
MODEL = dict(
    name="toy", identity="abc123", num_layers=L, num_kv_heads=H, num_q_heads=HQ, head_dim=D
)


def accumulate(seed=0, windows=3, t=10):
    g = torch.Generator().manual_seed(seed)
    acc = StatsAccumulator(L, HQ, H, D)
    seqs = []
    for _ in range(windows):
        per_layer = []
        for layer in range(L):
            q = torch.randn(t, HQ, D, generator=g)
            k = torch.randn(t, H, D, generator=g) * 3 + 1
            v = torch.randn(t, H, D, generator=g) - 2
            acc.update(layer, q.bfloat16(), k.bfloat16(), v.bfloat16())
            per_layer.append((q.bfloat16(), k.bfloat16(), v.bfloat16()))
        seqs.append(per_layer)
    wo = [torch.randn(32, HQ * D, generator=g) for _ in range(L)]
    return acc.finalize(wo, MODEL, {"note": "test"}), seqs, wo


def test_statistics_match_direct_computation():
    cal, seqs, wo = accumulate()
    layer = 1
    q = torch.cat([s[layer][0][STATS_START:] for s in seqs]).double()
    k = torch.cat([s[layer][1][STATS_START:] for s in seqs]).double()
    v = torch.cat([s[layer][2][STATS_START:] for s in seqs]).double()
    mean, var, w = cal.stats("k", layer)
    assert torch.allclose(mean.double(), k.mean(0), atol=1e-6)
    assert torch.allclose(var.double(), k.var(0, unbiased=False), rtol=1e-5)
    want_w = (q**2).mean(0).reshape(H, HQ // H, D).sum(1)
    assert torch.allclose(w.double(), want_w, rtol=1e-5)
    vm, vv, vw = cal.stats("v", layer)
    assert torch.allclose(vm.double(), v.mean(0), atol=1e-6)
    cols = (wo[layer].double() ** 2).sum(0).reshape(H, HQ // H, D).sum(1)
    assert torch.allclose(vw.double(), cols, rtol=1e-5)
    assert cal.fit["tokens_per_layer"] == 3 * (10 - STATS_START)


def test_save_load_roundtrip(tmp_path):
    cal, _, _ = accumulate()
    cal.save(tmp_path)
    doc = json.loads((tmp_path / JSON_NAME).read_text())
    assert doc["kvzip_calibration_version"] == CALIBRATION_VERSION and doc["model"] == MODEL
    back = Calibration.load(tmp_path)
    for name, t in cal.tensors.items():
        assert torch.equal(back.tensors[name], t)
    assert as_calibration(str(tmp_path)).model == MODEL
    # a format takes the directory directly
    fmt = kf.get_format("4bit", calibration=tmp_path)
    x = torch.randn(4, H, D).bfloat16()
    assert fmt.roundtrip(x, kind="v", layer=2).shape == x.shape


def test_check_model():
    cal, _, _ = accumulate()
    ok = SimpleNamespace(name="toy", identity="abc123", num_layers=L, num_kv_heads=H, head_dim=D)
    cal.check_model(ok)
    other = SimpleNamespace(name="other", identity="zzz", num_layers=L, num_kv_heads=H, head_dim=D)
    with pytest.raises(CalibrationError, match="kvzip calibrate"):
        cal.check_model(other)


def test_missing_directory(tmp_path):
    with pytest.raises(CalibrationError, match="no calibration"):
        Calibration.load(tmp_path / "nope")
    with pytest.raises(CalibrationError, match="no calibration"):
        kf.get_format("3bit", calibration=tmp_path)


def test_version_mismatch(tmp_path):
    cal, _, _ = accumulate()
    cal.save(tmp_path)
    doc = json.loads((tmp_path / JSON_NAME).read_text())
    doc["kvzip_calibration_version"] = CALIBRATION_VERSION + 1
    (tmp_path / JSON_NAME).write_text(json.dumps(doc))
    with pytest.raises(CalibrationError, match="version"):
        Calibration.load(tmp_path)


def test_damaged_files(tmp_path):
    cal, _, _ = accumulate()
    cal.save(tmp_path)
    (tmp_path / JSON_NAME).write_text("{not json")
    with pytest.raises(CalibrationError, match="JSON"):
        Calibration.load(tmp_path)
    cal.save(tmp_path)
    raw = (tmp_path / TENSORS_NAME).read_bytes()
    (tmp_path / TENSORS_NAME).write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CalibrationError, match="cannot be read"):
        Calibration.load(tmp_path)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda t: t.pop("k_var"), "lacks tensor"),
        (lambda t: t.__setitem__("v_mean", torch.zeros(L, H, D + 1)), "float32"),
        (lambda t: t.__setitem__("k_mean", torch.zeros(L, H, D, dtype=torch.float64)), "float32"),
        (lambda t: t["k_weight"].__setitem__((0, 0, 0), float("nan")), "NaN"),
        (lambda t: t["v_var"].__setitem__((0, 0, 0), -1.0), "negative"),
    ],
)
def test_invalid_tensors(mutate, match):
    cal, _, _ = accumulate()
    tensors = {k: v.clone() for k, v in cal.tensors.items()}
    mutate(tensors)
    with pytest.raises(CalibrationError, match=match):
        Calibration(model=MODEL, tensors=tensors)


def test_invalid_model_record_and_updates():
    cal, _, _ = accumulate()
    with pytest.raises(CalibrationError, match="identity"):
        Calibration(model={k: v for k, v in MODEL.items() if k != "identity"}, tensors=cal.tensors)
    acc = StatsAccumulator(L, HQ, H, D)
    with pytest.raises(CalibrationError, match="update expects"):
        acc.update(0, torch.zeros(4, HQ, D), torch.zeros(4, H + 1, D), torch.zeros(4, H + 1, D))
    with pytest.raises(CalibrationError, match="multiple"):
        StatsAccumulator(L, 5, 2, D)
    with pytest.raises(CalibrationError, match="no tokens"):
        acc.finalize([torch.zeros(8, HQ * D)] * L, MODEL, {})
    with pytest.raises(CalibrationError, match="Calibration, a directory"):
        as_calibration(42)


def test_rotary_adjust_drops_turning_means_and_pairs_stats():
    from kvzip_formats.calibration import rotary_adjust

    cal, _, _ = accumulate()
    # D = 16, theta 1e4, context 512: pair j turns by 1e4^(-j/8) * 512 rad; only j = 7
    # (0.162 rad) stays under 0.25 rad
    inv_freq = 1e4 ** (-torch.arange(8, dtype=torch.float64) / 8)
    adj = rotary_adjust(cal, inv_freq, 512)
    assert adj.fit["rotary_adjust"]["turning_channels"] == 14
    keep = torch.zeros(D, dtype=torch.bool)
    keep[[7, 15]] = True
    m0, v0, w0 = cal.stats("k", 1)
    m1, v1, w1 = adj.stats("k", 1)
    assert torch.equal(m1[:, keep], m0[:, keep]) and torch.equal(v1[:, keep], v0[:, keep])
    assert (m1[:, ~keep] == 0).all()
    second = (v0 + m0**2).double()
    pair = (second[:, :8] + second[:, 8:]) / 2
    assert torch.allclose(v1[:, :7].double(), pair[:, :7], rtol=1e-6)
    assert torch.equal(v1[:, :8][:, :7], v1[:, 8:][:, :7])
    assert torch.allclose(w1[:, :7].double(), ((w0[:, :8] + w0[:, 8:]) / 2)[:, :7].double())
    # V statistics are untouched (V is not rotated)
    assert all(torch.equal(a, b) for a, b in zip(adj.stats("v", 0), cal.stats("v", 0), strict=True))
    with pytest.raises(CalibrationError, match="inv_freq"):
        rotary_adjust(cal, inv_freq[:4], 512)


def test_fixed_sum_adds_in_an_order_fixed_by_the_length():
    """Pairwise halves: for 5 entries ((x0 + x2) + (x1 + x3)) + x4, whatever the layout, the
    dim or the thread count (torch.sum's order, and so its rounding, depends on them)."""
    from kvzip_formats.calibration import fixed_sum

    x = torch.tensor([1e16, 1.0, -1e16, 1.0, 3.0], dtype=torch.float64)
    assert fixed_sum(x).item() == 5.0  # left to right would give 4.0
    # flipped: ((3 + -1e16) + (1 + 1)) + 1e16 = 6 (3 - 1e16 rounds to -1e16 + 4)
    rows = torch.stack((x, x.flip(0)))
    assert fixed_sum(rows, 1).tolist() == [5.0, 6.0]
    assert fixed_sum(rows.t().contiguous(), 0).tolist() == [5.0, 6.0]
    assert fixed_sum(x[:0]).item() == 0.0
    g = torch.Generator().manual_seed(0)
    big = torch.randn(4097, 3, 65, generator=g, dtype=torch.float64) * 1e3
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fixed_sum(big)
        torch.set_num_threads(2)
        assert torch.equal(one, fixed_sum(big))
    finally:
        torch.set_num_threads(threads)
    assert torch.allclose(one, big.sum(0), rtol=1e-12, atol=1e-9)
