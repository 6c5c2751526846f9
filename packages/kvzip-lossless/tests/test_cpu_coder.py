"""The compiled CPU coder (numba, ``_cpu_fast.py``) against the numpy reference (``_cpu.py``):
the same bytes, the same values, the same refusals."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvzip_lossless as kl
from kvzip_lossless import _cpu_fast, codec
from kvzip_lossless import blob as B
from kvzip_lossless._torch import as_u16
from kvzip_lossless.tiles import resolve_table

pytestmark = pytest.mark.skipif(not _cpu_fast.available(), reason="numba does not import")
GOLDEN = Path(__file__).parent / "golden"


def both(x, tables=None, slot=None, rpt=1024):
    """The blob from each coder (asserted equal) and the values."""
    shape = tuple(x.shape)
    t = resolve_table(tables, slot, shape, x.numel())
    v = as_u16(x)
    blobs = [codec.compress_u16(v, shape, t, tables, slot, rpt, cpu=c) for c in ("numpy", "numba")]
    assert blobs[0] == blobs[1], "numba and numpy coders wrote different bytes"
    return blobs[0], v


def decode_both(blob, tables=None):
    """The values each decoder restores, or the error each raised."""
    out = []
    buf = memoryview(blob)
    for c in ("numpy", "numba"):
        try:
            h = B.parse_header(buf)
            out.append(codec.decode_u16(buf, h, codec.table_for(h, tables), cpu=c))
        except kl.CorruptBlobError:
            out.append("error")
    return out


def test_golden_vectors_same_bytes_and_values():
    ts = kl.TableSet.load(GOLDEN / "tables.kvzt")
    for f in sorted(GOLDEN.glob("valid_*.kvzl")):
        name = f.stem[6:]
        meta = json.loads((GOLDEN / f"valid_{name}.json").read_text())
        want = np.frombuffer((GOLDEN / f"valid_{name}.u16").read_bytes(), "<u2")
        x = torch.from_numpy(want.view(np.int16).copy()).view(torch.bfloat16)
        x = x.reshape(meta["shape"])
        kw = dict(tables=ts, slot=0) if name.endswith("calibrated") else {}
        blob, _ = both(x, rpt=meta["rows_per_tile"], **kw)
        assert blob == f.read_bytes(), name
        for got in decode_both(blob, ts):
            assert np.array_equal(got, want), name


def test_golden_invalid_vectors_refused_by_both():
    for name in json.loads((GOLDEN / "invalid.json").read_text()):
        assert decode_both((GOLDEN / f"invalid_{name}.kvzl").read_bytes()) == ["error"] * 2, name


_TABLES = kl.build_kv_tables(
    [[(torch.randn(300, 2, 16, generator=torch.Generator().manual_seed(s)).bfloat16() * 3,) * 2]
     for s in (1, 2)]
)  # fmt: skip


@st.composite
def tensors(draw):
    kind = draw(st.sampled_from(["kv", "bits", "const", "specials", "calibrated"]))
    rows = draw(st.integers(1, 120))
    cols = 32 if kind == "calibrated" else draw(st.sampled_from([1, 3, 31, 32, 33, 64, 70]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    if kind == "bits":
        x = torch.randint(-32768, 32768, (rows, cols), generator=g, dtype=torch.int16)
        x = x.view(torch.bfloat16)
    elif kind == "const":
        x = torch.full((rows, cols), draw(st.floats(-1e4, 1e4, width=16)), dtype=torch.bfloat16)
    else:
        scale = torch.rand(1, cols, generator=g) * draw(st.sampled_from([0.01, 1.0, 50.0]))
        x = (torch.randn(rows, cols, generator=g) * scale).bfloat16()
        if kind == "specials":
            flat = x.view(-1)
            for v in (float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, 3e38):
                flat[draw(st.integers(0, flat.numel() - 1))] = v
    rpt = draw(st.sampled_from([1, 2, 7, 16, 64, 1024]))
    if kind == "calibrated":
        return x.reshape(rows, 2, 16), dict(tables=_TABLES, slot=draw(st.integers(0, 1))), rpt
    return x, {}, rpt


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tensors())
def test_random_tensors_same_bytes_and_exact(case):
    x, kw, rpt = case
    blob, v = both(x, rpt=rpt, **kw)
    for got in decode_both(blob, kw.get("tables")):
        assert np.array_equal(got, v)


_BASE = both(
    (torch.randn(40, 2, 16, generator=torch.Generator().manual_seed(9)) * 2).bfloat16(), rpt=16
)[0]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(_BASE) - 1), st.integers(1, 255)), max_size=3))
def test_damaged_blobs_refused_alike(flips):
    b = bytearray(_BASE)
    for pos, val in flips:
        b[pos] ^= val
    ref, fast = decode_both(bytes(b))
    if isinstance(ref, str) or isinstance(fast, str):
        assert isinstance(ref, str) and isinstance(fast, str), "only one decoder refused"
    else:
        assert np.array_equal(ref, fast)


def test_coder_is_numba_by_default_and_numpy_on_request(monkeypatch):
    monkeypatch.delenv("KVZIP_LOSSLESS_CPU_CODER", raising=False)
    assert kl.coder("cpu") == "numba"
    monkeypatch.setenv("KVZIP_LOSSLESS_CPU_CODER", "numpy")
    assert kl.coder("cpu") == "numpy"
    monkeypatch.setenv("KVZIP_LOSSLESS_CPU_CODER", "C")
    with pytest.raises(ValueError, match="supported are numba, numpy"):
        kl.coder("cpu")


def test_without_numba_the_numpy_coder_runs(monkeypatch):
    monkeypatch.delenv("KVZIP_LOSSLESS_CPU_CODER", raising=False)
    monkeypatch.setattr(_cpu_fast, "numba", None)
    assert kl.coder("cpu") == "numpy"
    x = (torch.randn(50, 3, 8) * 4).bfloat16()
    assert torch.equal(kl.decompress(kl.compress(x)).view(torch.int16), x.view(torch.int16))
    with pytest.raises(RuntimeError, match="numba does not import"):
        codec._cpu_coder("numba")
