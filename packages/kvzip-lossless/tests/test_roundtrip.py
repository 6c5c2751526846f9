"""Bit-exact round trips on awkward shapes and special values (CPU coder)."""

import numpy as np
import pytest
import torch

import kvzip_lossless as kl
from kvzip_lossless import blob as B


def bits(x):
    return x.contiguous().view(torch.int16)


def assert_exact(x, y):
    assert y.dtype == torch.bfloat16 and tuple(y.shape) == tuple(x.shape)
    diff = (bits(x) != bits(y)).view(-1).nonzero()
    assert diff.numel() == 0, (
        f"{diff.numel()} values differ, first at flat index {int(diff[0])}: "
        f"{int(bits(x).view(-1)[diff[0]]):#06x} != {int(bits(y).view(-1)[diff[0]]):#06x}"
    )


def kv_like(t, h, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(1, h, d, generator=g) * 3 + 0.05
    off = torch.randn(1, h, d, generator=g) * 2
    return (torch.randn(t, h, d, generator=g) * scale + off).bfloat16()


@pytest.mark.parametrize(
    "shape", [(0,), (1,), (5,), (123, 3, 64), (37, 5, 7), (2, 3, 4, 5), (4097,), (3, 5000)]
)
def test_roundtrip_shapes(shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).bfloat16()
    assert_exact(x, kl.decompress(kl.compress(x)))


@pytest.mark.parametrize("rows_per_tile", [1, 7, 64, 1024])
def test_roundtrip_tiles_and_partial_last_tile(rows_per_tile):
    x = kv_like(150, 3, 64)
    blob = kl.compress(x, rows_per_tile=rows_per_tile)
    h = B.parse_header(memoryview(blob))
    assert h.n_tiles == -(-150 // rows_per_tile)
    assert_exact(x, kl.decompress(blob))


def test_special_values_and_every_bit_pattern():
    allbits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = allbits.reshape(512, 128)  # NaNs with payloads, +-inf, +-0, subnormals, extremes
    assert_exact(x, kl.decompress(kl.compress(x)))
    y = kv_like(300, 2, 32)
    y[0, 0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40])
    y[100, 1, 3] = 3e38
    assert_exact(y, kl.decompress(kl.compress(y)))


def test_constant_and_zero_tensors():
    for x in (torch.zeros(200, 64, dtype=torch.bfloat16), torch.full((200, 64), -2.5).bfloat16()):
        blob = kl.compress(x)
        # one symbol: nearly free; the 7 raw mantissa bits remain (7/16 of the bytes)
        assert len(blob) < x.numel() * 2 * (7 / 16 + 0.02)
        assert_exact(x, kl.decompress(blob))


def test_random_bits_fall_back_to_raw_tiles():
    x = torch.randint(-32768, 32768, (2048, 64), dtype=torch.int16).view(torch.bfloat16)
    blob = kl.compress(x, rows_per_tile=256)
    h = B.parse_header(memoryview(blob))
    assert (h.modes == B.MODE_RAW).all() and h.embedded is None
    assert len(blob) < x.numel() * 2 * 1.01
    assert_exact(x, kl.decompress(blob))


def test_kv_like_data_compresses():
    x = kv_like(2048, 3, 64)
    blob = kl.compress(x)
    assert x.numel() * 2 / len(blob) > 1.3
    assert_exact(x, kl.decompress(blob))


def test_calibrated_tables_roundtrip_and_mismatch(tmp_path):
    cal = [[(kv_like(512, 2, 32, seed=1), kv_like(512, 2, 32, seed=2)) for _ in range(2)]]
    ts = kl.build_kv_tables(cal)
    assert len(ts) == 4
    ts.save(tmp_path / "t.kvzt")
    ts2 = kl.TableSet.load(tmp_path / "t.kvzt")
    assert ts2.table_id == ts.table_id
    x = kv_like(700, 2, 32, seed=1)
    blob = kl.compress(x, tables=ts, slot=kl.kv_slot(1, "k"))
    assert_exact(x, kl.decompress(blob, tables=ts2))
    with pytest.raises(kl.CorruptBlobError, match="pass it as"):
        kl.decompress(blob)
    other = kl.build_kv_tables([[(kv_like(64, 2, 32, seed=5), kv_like(64, 2, 32, seed=6))]])
    with pytest.raises(kl.CorruptBlobError, match="got table set"):
        kl.decompress(blob, tables=other)
    with pytest.raises(ValueError, match="slot must be in"):
        kl.compress(x, tables=ts, slot=9)
    with pytest.raises(ValueError, match="not a whole number of rows"):
        kl.compress(torch.zeros(7, 5, dtype=torch.bfloat16), tables=ts, slot=0)


def test_decompress_into_out():
    x = kv_like(100, 3, 64)
    out = torch.empty(100 * 3 * 64, dtype=torch.bfloat16)
    r = kl.decompress(kl.compress(x), out=out)
    assert r is out
    assert_exact(x.view(-1), out)
    with pytest.raises(ValueError, match="out must be a contiguous bfloat16 tensor of 19200"):
        kl.decompress(kl.compress(x), out=torch.empty(10, dtype=torch.bfloat16))


def test_bad_inputs_are_named():
    with pytest.raises(
        ValueError, match=r"x must be bfloat16, got torch.float32 with shape \(3, 4\)"
    ):
        kl.compress(torch.zeros(3, 4))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        kl.compress(np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="blob must be bytes"):
        kl.decompress("abc")


def test_noncontiguous_input():
    x = kv_like(64, 4, 32).transpose(0, 1)
    assert_exact(x.contiguous(), kl.decompress(kl.compress(x)))


def test_normalized_tables_properties():
    from kvzip_lossless.tables import PROB_SCALE, normalize_counts

    g = np.random.default_rng(0)
    c = g.integers(0, 10**6, (50, 32)) * (g.random((50, 32)) < 0.3)
    c[0] = 0
    f = normalize_counts(c)
    assert (f >= 1).all() and (f.astype(np.int64).sum(-1) == PROB_SCALE).all()


def test_reference_checksum_matches_the_spec_formula_on_numpy_and_torch():
    from kvzip_lossless import _torch
    from kvzip_lossless.checksum import partial_sum, tile_checksums

    def spec(vals):  # spec/blob.md section 6, one Python int at a time
        def fmix(h):
            h ^= h >> 16
            h = (h * 0x85EBCA6B) & 0xFFFFFFFF
            h ^= h >> 13
            h = (h * 0xC2B2AE35) & 0xFFFFFFFF
            return h ^ (h >> 16)

        return sum(fmix((p * 0x9E3779B1 + int(v)) & 0xFFFFFFFF) for p, v in enumerate(vals))

    g = np.random.default_rng(1)
    vals = g.integers(0, 1 << 16, (3, 1000)).astype(np.uint16)
    vals[0, :5] = [0, 0xFFFF, 0x7F80, 0xFF80, 1]
    want = [spec(v) & 0xFFFFFFFF for v in vals]
    assert tile_checksums(vals).tolist() == want
    assert tile_checksums(vals[:, :0]).tolist() == [0, 0, 0]
    t = torch.from_numpy(vals.view(np.int16))
    assert [int(_torch.checksum(r)) & 0xFFFFFFFF for r in t] == want
    idx = np.array([3, 17, 999])
    # the share of a position set: the tile's sum less the others' share
    rest = np.setdiff1d(np.arange(1000), idx)
    assert (partial_sum(idx, vals[1][idx]) + partial_sum(rest, vals[1][rest])) % (1 << 32) == want[
        1
    ]
