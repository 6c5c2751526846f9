"""The Triton coder: same bytes as the CPU coder, exact decode, damage detected.

On a machine without CUDA the kernels run under TRITON_INTERPRET=1 on tiny shapes (CPU twin);
the tests marked gpu run the compiled kernels on CUDA at realistic sizes.
"""

import pytest
import torch

import kvzip_lossless as kl
from kvzip_lossless import _torch, codec, gpu, tiles
from kvzip_lossless import blob as B

pytestmark = pytest.mark.skipif(not gpu.available(), reason="needs Triton (interpreter or CUDA)")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def kv_like(t, h, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, d, generator=g) * (torch.rand(1, h, d, generator=g) * 3 + 0.05)
    return (x + torch.randn(1, h, d, generator=g) * 2).bfloat16()


def gpu_encode(x, tables=None, slot=None, rpt=8):
    shape = tuple(x.shape)
    t = tiles.resolve_table(tables, slot, shape, x.numel())
    table, cols, tid, sl, emb = tiles.prepare_table(
        _torch.as_u16(x) if t is None else None, shape, t, tables, slot
    )
    parts = gpu.encode_parts(x.to(DEV), table, cols, rpt)
    return gpu.assemble_host(x, parts, shape, cols, rpt, tid, sl, emb), table


def gpu_decode(blob, table):
    h = B.parse_header(memoryview(blob))
    return gpu.decompress(memoryview(blob), h, table, device=DEV).cpu()


def tables():
    # fitted on the test tensor's own law (seed 3), so that its tiles are coded, not raw
    return kl.build_kv_tables([[(kv_like(4000, 2, 16, 3), kv_like(4000, 2, 16, 3))]])


@pytest.mark.parametrize("case", ["embedded", "calibrated_k", "calibrated_v", "escapes", "odd"])
def test_gpu_bytes_equal_cpu_and_decode_exact(case):
    ts = tables()
    x, kw = kv_like(40, 2, 16, 3), {}
    if case.startswith("calibrated"):
        kw = dict(tables=ts, slot=kl.kv_slot(0, case[-1]))
    elif case == "escapes":
        x[2, 0, 1], x[9, 1, 2], x[20, 1, 15] = 3e38, -1e-38, float("nan")
    elif case == "odd":
        x = kv_like(40, 1, 37, 4)  # 37 columns: a partial 32-lane chunk
    cpu_blob = kl.compress(x, rows_per_tile=16, **kw)  # tiles of 16, 16 and 8 rows
    h = B.parse_header(memoryview(cpu_blob))
    assert (h.modes == B.MODE_RANS).any(), "test must exercise coded tiles"
    if case == "escapes":
        assert h.n_exc.sum() >= 3
    gpu_blob, table = gpu_encode(x, rpt=16, **kw)
    assert gpu_blob == cpu_blob
    y = gpu_decode(cpu_blob, table)
    assert torch.equal(y.view(torch.int16), x.view(torch.int16))


def test_gpu_decode_detects_damage():
    x = kv_like(32, 2, 16, 5)
    blob = kl.compress(x, rows_per_tile=16)
    h = B.parse_header(memoryview(blob))
    table = codec.table_for(h, None)
    for pos in (len(blob) - 3, h.tiles_start + 10, h.tiles_start + int(h.lengths[0]) + 150):
        b = bytearray(blob)
        b[pos] ^= 0x21
        with pytest.raises(kl.CorruptBlobError):
            gpu_decode(bytes(b), table)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_public_api_matches_cpu():
    x = kv_like(3000, 8, 128, 6)
    cpu_blob = kl.compress(x)
    assert kl.compress(x.cuda()) == cpu_blob
    y = kl.decompress(cpu_blob, device="cuda")
    assert y.is_cuda and torch.equal(y.cpu().view(torch.int16), x.view(torch.int16))
    out = torch.empty_like(x, device="cuda")
    kl.decompress(cpu_blob, out=out)
    assert torch.equal(out.cpu().view(torch.int16), x.view(torch.int16))
