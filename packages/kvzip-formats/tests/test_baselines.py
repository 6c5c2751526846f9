"""Reference codecs of the baseline formats: exactness, error bounds from step sizes, errors."""

from __future__ import annotations

import pytest
import torch

import kvzip_formats as kf
from kvzip_formats.baselines.int4 import quantize_minmax
from kvzip_formats.rotation import hadamard

BASELINES = ["bf16", "fp8", "int4", "int4-rot", "turbo4"]
SHAPES = [(1, 1, 64), (5, 3, 64), (123, 8, 128), (17, 1, 128)]


def kv(shape, seed=0, dtype=torch.bfloat16, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 1.5 + offset).to(dtype)


def test_registry_lists_baselines_first():
    assert kf.list_formats()[:5] == BASELINES


@pytest.mark.parametrize("name", BASELINES)
@pytest.mark.parametrize("shape", SHAPES)
def test_encode_shape_and_bytes(name, shape):
    fmt = kf.get_format(name)
    packed = fmt.encode(kv(shape), kind="k", layer=0)
    assert packed.dtype == torch.uint8
    assert packed.shape == (*shape[:2], fmt.token_head_bytes(shape[2]))
    assert fmt.token_head_bytes(shape[2]) == fmt.code_bytes(shape[2]) + fmt.meta_bytes(shape[2])


@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_roundtrip_bit_exact(shape):
    fmt = kf.get_format("bf16")
    x = kv(shape, seed=1)
    x[0, 0, :4] = torch.tensor([float("inf"), float("-inf"), 0.0, -0.0])
    y = fmt.decode(fmt.encode(x, kind="v", layer=3), kind="v", layer=3, head_dim=shape[2])
    assert torch.equal(y.to(torch.bfloat16).view(torch.int16), x.view(torch.int16))
    assert torch.equal(fmt.roundtrip(x, kind="k", layer=0).view(torch.int16), x.view(torch.int16))


@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_error_within_half_ulp(shape):
    fmt = kf.get_format("fp8")
    x = kv(shape, seed=2).float()
    y = fmt.roundtrip(x, kind="k", layer=0)
    # e4m3: 3 mantissa bits, so round-to-nearest is within 2^-4 relative for normals;
    # subnormals (|x| < 2^-6) have a fixed step of 2^-9.
    bound = torch.maximum(x.abs() * 2**-4, torch.full_like(x, 2**-10))
    assert ((y - x).abs() <= bound).all()


def test_fp8_saturates_instead_of_nan():
    fmt = kf.get_format("fp8")
    x = torch.tensor([1e4, -1e4, 448.0]).reshape(1, 1, 3)
    x = torch.cat((x, torch.zeros(1, 1, 1)), -1)
    y = fmt.roundtrip(x, kind="v", layer=0)
    assert y.flatten().tolist() == [448.0, -448.0, 448.0, 0.0]


def _int4_bound(x: torch.Tensor) -> torch.Tensor:
    """Per-vector bound on |x - decode(encode(x))| from int4's step: half a step, plus the
    fp16 rounding of scale (amplified by up to 15 codes) and of the zero point."""
    _, scale, zero = quantize_minmax(x, 16)
    s = scale.float().unsqueeze(-1)
    lo = x.float().amin(-1, keepdim=True)
    return s / 2 + 15 * s * 2**-10 + lo.abs() * 2**-10 + 1e-6


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("offset", [0.0, 7.0, -300.0])
def test_int4_error_within_half_step(shape, offset):
    fmt = kf.get_format("int4")
    x = kv(shape, seed=3, dtype=torch.float32, offset=offset)
    y = fmt.roundtrip(x, kind="k", layer=0)
    assert ((y - x).abs() <= _int4_bound(x)).all()


@pytest.mark.parametrize("shape", SHAPES)
def test_int4_rot_error_within_half_step_in_rotated_space(shape):
    fmt = kf.get_format("int4-rot")
    x = kv(shape, seed=4, dtype=torch.float32, offset=2.0)
    y = fmt.roundtrip(x, kind="v", layer=0)
    h = hadamard(shape[2])
    xr, yr = x @ h, y @ h
    assert ((yr - xr).abs() <= _int4_bound(xr) + 1e-5).all()
    # The rotation is orthonormal: the error's norm is the same in both spaces.
    torch.testing.assert_close((y - x).norm(dim=-1), (yr - xr).norm(dim=-1), atol=1e-4, rtol=1e-4)


def test_int4_constant_and_zero_vectors_are_exact():
    fmt = kf.get_format("int4")
    x = torch.zeros(3, 2, 64)
    x[1] = 0.375  # exactly representable in fp16: zero point carries it, scale is 0
    assert torch.equal(fmt.roundtrip(x, kind="k", layer=0), x)


@pytest.mark.parametrize("name", ["int4", "int4-rot", "turbo4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_integer_formats_refuse_non_finite(name, bad):
    x = kv((4, 2, 64), dtype=torch.float32)
    x[2, 1, 5] = bad
    with pytest.raises(kf.FormatError, match="finite"):
        kf.get_format(name).encode(x, kind="k", layer=0)


def test_turbo4_mse_matches_lloyd_max_distortion():
    """Random Gaussian vectors: the normalised MSE of a 4-bit Lloyd-Max quantiser of a
    Gaussian is 0.00950; after a random rotation the coordinates are close to Gaussian."""
    fmt = kf.get_format("turbo4")
    x = kv((512, 4, 128), seed=5, dtype=torch.float32)
    y = fmt.roundtrip(x, kind="k", layer=0)
    nmse = ((y - x).pow(2).sum(-1) / x.pow(2).sum(-1)).mean().item()
    assert 0.0080 < nmse < 0.0115
    # The row's metadata is the vector's norm rounded to fp16.
    packed = fmt.encode(x, kind="k", layer=0)
    stored = packed[..., 64:66].contiguous().view(torch.float16).squeeze(-1)
    assert torch.equal(stored, x.norm(dim=-1).to(torch.float16))


def test_bits_per_element():
    assert kf.get_format("bf16").bits_per_element() == 16
    assert kf.get_format("fp8").bits_per_element() == 8
    assert kf.get_format("int4").bits_per_element(head_dim=128) == 4.25
    assert kf.get_format("int4").bits_per_element(head_dim=64) == 4.5
    assert kf.get_format("turbo4").bits_per_element(head_dim=128) == 4.125


@pytest.mark.parametrize(
    "x, match",
    [
        (torch.zeros(4, 64), "shape"),
        (torch.zeros(4, 2, 63), "head_dim"),
        (torch.zeros(4, 2, 64, dtype=torch.int32), "dtype"),
        (torch.zeros(2, 2, 2, 2), "shape"),
    ],
)
@pytest.mark.parametrize("name", BASELINES)
def test_bad_input_is_refused(name, x, match):
    with pytest.raises(kf.FormatError, match=match):
        kf.get_format(name).encode(x, kind="k", layer=0)


@pytest.mark.parametrize("name", BASELINES)
def test_bad_kind_and_packed_are_refused(name):
    fmt = kf.get_format(name)
    with pytest.raises(kf.FormatError, match="kind"):
        fmt.encode(torch.zeros(1, 1, 64), kind="q", layer=0)
    good = fmt.encode(torch.ones(2, 1, 64), kind="k", layer=0)
    with pytest.raises(kf.FormatError, match="uint8"):
        fmt.decode(good.float(), kind="k", layer=0, head_dim=64)
    with pytest.raises(kf.FormatError, match="shape"):
        fmt.decode(good[..., :-1], kind="k", layer=0, head_dim=64)


def test_unknown_format_names_the_registered_ones():
    with pytest.raises(kf.FormatError, match="registered formats: bf16, fp8"):
        kf.get_format("int3")
