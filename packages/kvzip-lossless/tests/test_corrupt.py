"""Damaged, truncated and mismatched blobs: always CorruptBlobError, never silent wrong output."""

import time
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import kvzip_lossless as kl
from kvzip_lossless import blob as B

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


GOLDEN = Path(__file__).parent / "golden"


def test_embedded_zlib_bomb_is_refused_quickly_without_inflating_it():
    bomb = (GOLDEN / "invalid_embedded_bomb.kvzl").read_bytes()  # inflates to 16 MiB
    assert len(bomb) < 64 << 10
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(kl.CorruptBlobError, match="inflates to more than the 2124 bytes"):
            kl.decompress(bomb)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 1.0
    assert peak < 1 << 20, f"{peak} bytes allocated refusing a blob whose table declares 2124"


def _with_embedded(blob: bytes, emb: bytes) -> bytes:
    """``blob`` with its embedded table bytes replaced (header and CRC rewritten)."""
    buf = memoryview(blob)
    h = B.parse_header(buf)
    head = B.pack_header(
        h.shape, h.columns, h.rows_per_tile, h.table_id, h.table_slot, emb,
        h.lengths, h.modes, h.n_exc, h.checksums,
    )  # fmt: skip
    return head + bytes(buf[h.tiles_start :])


def test_embedded_table_of_other_columns_or_short_is_refused():
    h = B.parse_header(memoryview(BLOB))
    raw = zlib.decompress(h.embedded)
    wrong_cols = raw[:8] + (h.columns + 1).to_bytes(4, "little") + raw[12:]
    for emb, msg in [
        (zlib.compress(wrong_cols), "declares 65 columns"),
        (zlib.compress(raw[:-2]), "its header declares"),
        (zlib.compress(raw[:5]), "shorter than its header"),
        (zlib.compress(raw) + b"xx", "bytes after its zlib stream"),
        (zlib.compress(raw)[:-6], "damaged"),
        (b"\x00" * 40, "damaged"),
    ]:
        with pytest.raises(kl.CorruptBlobError, match=msg):
            kl.decompress(_with_embedded(BLOB, emb))
    assert torch.equal(kl.decompress(_with_embedded(BLOB, zlib.compress(raw, 1))), X)


_REAL_EMB = B.parse_header(memoryview(BLOB)).embedded
_BOMB_EMB = zlib.compress(zlib.decompress(_REAL_EMB)[:12] + bytes(1 << 24), 9)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200), st.integers(0, 3000), st.booleans())
@example(_BOMB_EMB, 0, False)
def test_fuzz_embedded_tables(data, cut, bomb):
    """Hostile embedded tables (random bytes, a bomb's prefix, damaged real tables), each with
    a consistent header CRC so the inflate path is reached: CorruptBlobError or exact, fast."""
    emb = (_BOMB_EMB[:cut] + data) if bomb else (_REAL_EMB[:cut] + data if cut % 2 else data)
    t0 = time.perf_counter()
    check(_with_embedded(BLOB, emb))
    assert time.perf_counter() - t0 < 2.0
