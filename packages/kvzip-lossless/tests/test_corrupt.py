"""Damaged, truncated and mismatched blobs: always CorruptBlobError, never silent wrong output."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvzip_lossless as kl

X = (torch.randn(48, 2, 32, generator=torch.Generator().manual_seed(3)) * 2 + 1).bfloat16()
BLOB = kl.compress(X, rows_per_tile=16)


def check(blob):
    """Either a clear CorruptBlobError, or (only if the damage hit padding) the exact input."""
    try:
        y = kl.decompress(blob)
    except kl.CorruptBlobError:
        return "error"
    assert torch.equal(y.view(torch.int16), X.view(torch.int16)), "silent wrong output"
    return "exact"


def test_every_truncation_raises():
    for n in range(0, len(BLOB), 7):
        with pytest.raises(kl.CorruptBlobError):
            kl.decompress(BLOB[:n])
    with pytest.raises(kl.CorruptBlobError, match="truncated or padded"):
        kl.decompress(BLOB + b"\0\0\0\0")


def test_single_byte_flips():
    outcomes = {"error": 0, "exact": 0}
    for i in range(0, len(BLOB), 3):
        b = bytearray(BLOB)
        b[i] ^= 0xA5
        outcomes[check(bytes(b))] += 1
    # Only alignment padding may be flipped unnoticed (and then the output is exact).
    assert outcomes["exact"] <= 0.02 * sum(outcomes.values())


def test_out_untouched_on_error():
    out = torch.full((X.numel(),), 7.0, dtype=torch.bfloat16)
    b = bytearray(BLOB)
    b[-30] ^= 1
    with pytest.raises(kl.CorruptBlobError):
        kl.decompress(bytes(b), out=out)
    assert (out == 7.0).all()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=600))
def test_fuzz_random_bytes(data):
    for blob in (data, BLOB[:64] + data):
        try:
            kl.decompress(blob)
        except kl.CorruptBlobError:
            pass


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.integers(0, len(BLOB) - 1),
            st.integers(1, 255),
            st.sampled_from(["xor", "insert", "delete", "truncate"]),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_fuzz_mutated_blobs(edits):
    b = bytearray(BLOB)
    for pos, val, op in edits:
        pos = min(pos, max(len(b) - 1, 0))
        if op == "xor" and b:
            b[pos] ^= val
        elif op == "insert":
            b[pos:pos] = bytes([val])
        elif op == "delete" and b:
            del b[pos]
        else:
            b = b[:pos]
    if bytes(b) == BLOB:
        return
    check(bytes(b))


def test_golden_invalid_vectors():
    import json
    from pathlib import Path

    g = Path(__file__).parent / "golden"
    for name, msg in json.loads((g / "invalid.json").read_text()).items():
        with pytest.raises(kl.CorruptBlobError, match=msg):
            kl.decompress((g / f"invalid_{name}.kvzl").read_bytes())


def test_golden_valid_vectors_decode_and_encode_to_the_same_bytes():
    import json
    from pathlib import Path

    g = Path(__file__).parent / "golden"
    ts = kl.TableSet.load(g / "tables.kvzt")
    names = sorted(p.stem[6:] for p in g.glob("valid_*.kvzl"))
    assert len(names) >= 5
    for name in names:
        blob = (g / f"valid_{name}.kvzl").read_bytes()
        meta = json.loads((g / f"valid_{name}.json").read_text())
        want = np.frombuffer((g / f"valid_{name}.u16").read_bytes(), "<i2")
        y = kl.decompress(blob, tables=ts)
        assert list(y.shape) == meta["shape"]
        assert np.array_equal(y.view(torch.int16).numpy().ravel(), want), name
        x = torch.from_numpy(want.copy()).view(torch.bfloat16).reshape(meta["shape"])
        kw = dict(tables=ts, slot=0) if name.endswith("calibrated") else {}
        assert kl.compress(x, rows_per_tile=meta["rows_per_tile"], **kw) == blob, name
