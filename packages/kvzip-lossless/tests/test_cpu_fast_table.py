"""The compiled decoder's one-load decode table (``_cpu_fast._table_arrays``): every field of
every entry against the table it is built from, and the numpy fallback where the next-row
field cannot hold the table's rows."""

import numpy as np
import pytest
import torch

import kvzip_lossless as kl
from kvzip_lossless import _cpu_fast, codec
from kvzip_lossless import blob as B
from kvzip_lossless.tables import NSYM

pytestmark = pytest.mark.skipif(not _cpu_fast.available(), reason="numba does not import")


def _tables():
    g = torch.Generator().manual_seed(3)
    kv = [[((torch.randn(200, 2, 16, generator=g) * 3).bfloat16(),) * 2]]
    return kl.build_kv_tables(kv)


@pytest.mark.parametrize("slot", [0, 1])  # K (bucketed contexts) and V (one context)
def test_decode_entries_hold_the_tables_fields(slot):
    table = _tables().tables[slot]
    t = _cpu_fast._table_arrays(table)
    C, nb = table.columns, table.n_buckets
    dec = t["dec"].reshape(C, nb, NSYM)
    packed = table.packed().astype(np.int64).reshape(C, nb, NSYM)
    cum, freq = packed >> 16, packed & 0xFFFF
    assert np.array_equal(dec & 0x1FFF, cum + freq)
    assert np.array_equal((dec >> 13) & 4095, cum)
    assert np.array_equal(
        (dec >> 25) & 0xFFFF, np.broadcast_to(t["vt"].reshape(C, 1, NSYM), dec.shape)
    )
    nxt = dec >> 41
    assert np.array_equal(nxt, np.broadcast_to(t["cnext"].reshape(C, 1, NSYM), dec.shape))
    # the next row is the same column's row of the symbol's bucket
    bmap = np.asarray(table.buckets)
    assert np.array_equal(
        nxt[:, 0, :] // (nb * NSYM), np.broadcast_to(np.arange(C)[:, None], (C, NSYM))
    )
    assert np.array_equal((nxt[:, 0, :] // NSYM) % nb, np.broadcast_to(bmap, (C, NSYM)))


def test_tables_too_large_for_the_entry_decode_on_numpy(monkeypatch):
    ts = _tables()
    x = (torch.randn(70, 2, 16, generator=torch.Generator().manual_seed(5)) * 2).bfloat16()
    blob = kl.compress(x, tables=ts, slot=0)
    buf = memoryview(blob)
    h = B.parse_header(buf)
    table = codec.table_for(h, ts)
    want = codec.decode_u16(buf, h, table, cpu="numpy")
    monkeypatch.setattr(_cpu_fast, "MAX_ROWS", table.columns * table.n_buckets * NSYM - 1)
    table._derived.pop(_cpu_fast._KEY, None)

    def no_kernel(*a):
        raise AssertionError("the compiled decoder ran on a table it cannot index")

    monkeypatch.setattr(_cpu_fast, "_decode_blob", no_kernel)
    try:
        assert _cpu_fast._table_arrays(table)["dec"] is None
        assert _cpu_fast.decode_u16(buf, h, table) is None  # declined: the caller falls back
        assert np.array_equal(codec.decode_u16(buf, h, table, cpu="numba"), want)
    finally:
        table._derived.pop(_cpu_fast._KEY, None)
    assert np.array_equal(want, x.contiguous().view(torch.int16).numpy().view(np.uint16).ravel())
