"""Reference codec of 4bit / 3.5bit / 3bit: golden vectors (bit-exact), error bounds, errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import kvzip_formats as kf
from kvzip_formats.base import FormatError
from kvzip_formats.calibration import Calibration, CalibrationError
from kvzip_formats.compact import SPECS, codebook
from kvzip_formats.compact.transform import apply

GOLDEN = Path(__file__).parent / "golden" / "compact"
FORMATS = ["4bit", "3.5bit", "3bit"]
BUDGET_D128 = {"4bit": 4.198, "3.5bit": 3.64, "3bit": 3.2}


@pytest.fixture(scope="module")
def cals():
    return {d: Calibration.load(GOLDEN / f"calibration-d{d}") for d in (16, 64)}


def golden_vectors():
    return json.loads((GOLDEN / "vectors.json").read_text())["vectors"]


def vec_id(v):
    return f"{v['format']}-d{v['head_dim']}-L{v['layer']}-{v['kind']}"


@pytest.mark.parametrize("v", golden_vectors(), ids=vec_id)
def test_golden_encode_decode_bit_exact(v, cals):
    fmt = kf.get_format(v["format"], calibration=cals[v["head_dim"]])
    x = torch.tensor(v["x_bf16"], dtype=torch.int16).view(torch.bfloat16).reshape(v["shape"])
    packed = fmt.encode(x, kind=v["kind"], layer=v["layer"])
    want = torch.tensor(list(bytes.fromhex(v["packed_hex"])), dtype=torch.uint8).reshape(
        packed.shape
    )
    diff = (packed != want).nonzero()
    assert diff.numel() == 0, (
        f"rows differ at [token, head, byte] {diff[:5].tolist()}: "
        f"got {packed[tuple(diff[0])]:#04x}, want {want[tuple(diff[0])]:#04x}"
    )
    dec = fmt.decode(want, kind=v["kind"], layer=v["layer"], head_dim=v["head_dim"])
    want_dec = (
        torch.tensor(v["decoded_f32"], dtype=torch.int32).view(torch.float32).reshape(dec.shape)
    )
    assert torch.equal(dec, want_dec)


@pytest.mark.parametrize("name", FORMATS)
def test_bits_within_budget(name):
    fmt = kf.get_format(name)  # accounting needs no calibration
    assert fmt.bits_per_element(128, 32, num_kv_heads=8) <= BUDGET_D128[name]
    # head_dim 64 (SmolLM2): the fp16 token scale costs 0.25 instead of 0.125 bits
    b64 = fmt.bits_per_element(64, 30, num_kv_heads=3)
    assert b64 == pytest.approx(fmt.bits_per_element(128, 32, num_kv_heads=8) + 0.125, abs=2e-3)
    for d in (64, 128):
        k, v = fmt.token_head_bytes(d, "k"), fmt.token_head_bytes(d, "v")
        assert fmt.token_head_bytes(d) * 2 == k + v
        for kind in "kv":
            bits = SPECS[name].layout(d, kind).channel_bits()
            assert fmt.code_bytes(d, kind) * 8 == int(bits.sum()) and fmt.meta_bytes(d, kind) == 2


def test_capacity_sessions():
    from kvzip_formats.capacity import DEPLOYMENTS, sessions

    dep = DEPLOYMENTS[0]  # Llama-3.1-8B on one H100
    want = {"4bit": 13, "3.5bit": 15, "3bit": 17}
    for name, n in want.items():
        assert sessions(kf.get_format(name).bits_per_element(128, 32, num_kv_heads=8), dep) >= n


def _sample(cal, kind, layer, t=33, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    mean, var, _ = cal.stats(kind, layer)
    return (
        (torch.randn(t, cal.num_kv_heads, cal.head_dim, generator=g) * var.sqrt() + mean) * scale
    ).to(torch.bfloat16)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("scale", [1.0, 1e-3, 300.0])
def test_error_bounded_by_codebook_cells(name, kind, scale, cals):
    """In the transformed space every element within the codebook's range lies within half a
    cell of its level at the first scale s0, and the least-squares scale s can only shrink
    the vector error (up to the fp16 rounding of s)."""
    cal = cals[64]
    fmt = kf.get_format(name, calibration=cal)
    x = _sample(cal, kind, 1, seed=3, scale=scale)
    y = fmt.transform(x, kind=kind, layer=1)
    packed = fmt.encode(x, kind=kind, layer=1)
    y_hat = fmt.dequantize(packed, kind=kind, head_dim=64)
    s0 = y.square().mean(-1, keepdim=True).sqrt().half().float()
    layout = SPECS[name].layout(64, kind)
    codes = layout.unpack(packed[..., : layout.code_bytes])
    start = 0
    err_s0 = torch.zeros(y.shape[:-1])
    for n, bits in layout.groups:
        lv = codebook.levels(bits)
        u = y[..., start : start + n] / s0
        c = codes[..., start : start + n]
        gap = (lv[1:] - lv[:-1]) / 2  # half the distance to each neighbour
        half = torch.maximum(torch.cat((gap[:1], gap)), torch.cat((gap, gap[-1:])))[c]
        inside = u.abs() <= lv[-1]
        assert ((u - lv[c]).abs() <= half * (1 + 1e-6) + 1e-7)[inside].all()
        err_s0 += ((y[..., start : start + n] - s0 * lv[c]) ** 2).sum(-1)
        start += n
    err = ((y - y_hat) ** 2).sum(-1)
    s = y_hat.norm(dim=-1)  # |s| * |l|
    # fp16 rounding of s adds at most (2^-11 |s| |l|)^2 around the least-squares optimum
    assert (err <= err_s0 * (1 + 1e-5) + (2.0**-11 * s) ** 2 * 1.01 + 1e-12).all()
    # and decode maps back through B exactly as spec section 6 says
    t = fmt.transform_of(kind, 1)
    x_hat = fmt.decode(packed, kind=kind, layer=1, head_dim=64)
    assert torch.allclose(
        x_hat, torch.einsum("the,hde->thd", y_hat, t.decode) + t.mean, atol=1e-5 * scale + 1e-6
    )


@pytest.mark.parametrize("name", FORMATS)
def test_transform_inverse_and_unit_groups(name, cals):
    cal = cals[64]
    fmt = kf.get_format(name, calibration=cal)
    for kind in "kv":
        t = fmt.transform_of(kind, 0)
        eye = torch.eye(64).expand(2, 64, 64)
        assert torch.allclose(t.decode @ t.encode, eye, atol=1e-5)
        # each group has unit mean square per channel under the calibrated covariance
        _, var, _ = cal.stats(kind, 0)
        ms = torch.einsum("hij,hj->hi", t.encode.double() ** 2, var.double())
        start = 0
        for n, _ in SPECS[name].layout(64, kind).groups:
            assert torch.allclose(
                ms[:, start : start + n].mean(-1), torch.ones(2, dtype=torch.float64), rtol=1e-5
            )
            start += n


def test_key_centring_is_exact_for_attention(cals):
    """Softmax over q . k^ equals softmax over q' . y^ (the kernel's scores): mean drops out."""
    cal = cals[64]
    fmt = kf.get_format("4bit", calibration=cal)
    x = _sample(cal, "k", 0, t=20, seed=5)
    packed = fmt.encode(x, kind="k", layer=0)
    k_hat = fmt.decode(packed, kind="k", layer=0, head_dim=64)
    y_hat = fmt.dequantize(packed, kind="k", head_dim=64)
    q = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    t = fmt.transform_of("k", 0)
    q_prime = torch.einsum("hde,hd->he", t.decode, q)
    p_ref = torch.softmax(torch.einsum("thd,hd->ht", k_hat, q), -1)
    p_ker = torch.softmax(torch.einsum("the,he->ht", y_hat, q_prime), -1)
    assert torch.allclose(p_ref, p_ker, atol=1e-5)


@pytest.mark.parametrize("name", FORMATS)
def test_sink_token_kept_exact(name, cals):
    cal = cals[16]
    fmt = kf.get_format(name, calibration=cal)
    x = _sample(cal, "k", 0, t=6, seed=2)
    r0 = fmt.roundtrip(x, kind="k", layer=0, start=0)
    assert torch.equal(r0[0], x[0]) and not torch.equal(r0[1], x[1])
    r1 = fmt.roundtrip(x, kind="k", layer=0, start=1)  # no sink in this chunk
    assert torch.equal(r1[1:], r0[1:]) and not torch.equal(r1[0], x[0])
    assert r0.dtype == x.dtype and r0.shape == x.shape


@pytest.mark.parametrize("name", FORMATS)
def test_zero_and_mean_vectors(name, cals):
    cal = cals[16]
    fmt = kf.get_format(name, calibration=cal)
    mean, _, _ = cal.stats("v", 1)
    x = mean.expand(3, 2, 16).clone()
    x_hat = fmt.decode(fmt.encode(x, kind="v", layer=1), kind="v", layer=1, head_dim=16)
    assert torch.allclose(x_hat, x, atol=1e-6)  # y = 0 -> s = 0 -> exactly the mean


# -- rejected inputs (spec/4bit.md section 9) -------------------------------------------
def test_missing_calibration_is_clear_error():
    fmt = kf.get_format("4bit")
    with pytest.raises(CalibrationError, match="kvzip calibrate"):
        fmt.encode(torch.zeros(2, 2, 16), kind="k", layer=0)


def test_mismatched_calibration(cals):
    fmt = kf.get_format("3bit", calibration=cals[16])
    with pytest.raises(CalibrationError, match="KV heads"):
        fmt.encode(torch.zeros(2, 3, 16), kind="k", layer=0)
    with pytest.raises(CalibrationError, match="head_dim"):
        fmt.encode(torch.zeros(2, 2, 64), kind="k", layer=0)
    with pytest.raises(CalibrationError, match="layer 2"):
        fmt.encode(torch.zeros(2, 2, 16), kind="k", layer=2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e6])
def test_non_finite_or_huge_rejected(bad, cals):
    fmt = kf.get_format("4bit", calibration=cals[16])
    x = torch.zeros(2, 2, 16)
    x[1, 0, 3] = bad
    with pytest.raises(FormatError, match="finite"):
        fmt.encode(x, kind="k", layer=0)


def test_bad_shapes_and_kinds(cals):
    fmt = kf.get_format("3.5bit", calibration=cals[16])
    with pytest.raises(FormatError, match="shape"):
        fmt.encode(torch.zeros(2, 16), kind="k", layer=0)
    with pytest.raises(FormatError, match="dtype"):
        fmt.encode(torch.zeros(2, 2, 16, dtype=torch.int32), kind="k", layer=0)
    with pytest.raises(FormatError, match="kind"):
        fmt.encode(torch.zeros(2, 2, 16), kind="q", layer=0)
    with pytest.raises(FormatError, match="power of two"):
        fmt.token_head_bytes(48, "k")
    row = fmt.token_head_bytes(16, "k")
    with pytest.raises(FormatError, match="uint8"):
        fmt.decode(torch.zeros(2, 2, row), kind="k", layer=0, head_dim=16)
    with pytest.raises(FormatError, match=f"{row}"):
        fmt.decode(torch.zeros(2, 2, row + 1, dtype=torch.uint8), kind="k", layer=0, head_dim=16)


def test_bits_identical_to_spec_table():
    rows = {"4bit": (4.1251, 4.2501), "3.5bit": (3.6251, 3.7501), "3bit": (3.1251, 3.2501)}
    for name, (b128, b64) in rows.items():
        fmt = kf.get_format(name)
        assert math.isclose(round(fmt.bits_per_element(128, 32, num_kv_heads=8), 4), b128)
        assert math.isclose(round(fmt.bits_per_element(64, 30, num_kv_heads=3), 4), b64)


def test_transform_matches_float64_reference(cals):
    cal = cals[64]
    fmt = kf.get_format("4bit", calibration=cal)
    x = _sample(cal, "k", 1, seed=9)
    t = fmt.transform_of("k", 1)
    assert torch.equal(fmt.transform(x, kind="k", layer=1), apply(x, t))
