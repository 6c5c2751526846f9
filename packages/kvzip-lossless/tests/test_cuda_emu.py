"""The CUDA C batched kernels (csrc/kvzl.cu) run on the CPU: the source compiled as C++ with
``cuda_emu/emu.h`` (one thread per CUDA thread, warp shuffles and ballots through a per-warp
barrier) and called through the same ctypes entry points, so gpu_batch's CUDA path runs on
CPU tensors: the same bytes as ``compress``, exact decode, damage flagged per blob. The one-blob
decoder (``gpu.GpuBlob``'s CUDA path, the same row loop) runs the same way. The H200 runs the
real thing (``-m gpu``); this catches logic errors where there is no GPU."""

import ctypes
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import kvzip_lossless as kl
from kvzip_lossless import _cuda, batch, codec, gpu, gpu_batch
from kvzip_lossless import blob as B

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import test_batch as tb  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (C++20)")


@pytest.fixture(scope="module")
def emu(tmp_path_factory, monkeypatch_module):
    sys.path.insert(0, str(HERE / "cuda_emu"))
    from to_cpp import convert

    d = tmp_path_factory.mktemp("emu")
    cpp = d / "kvzl_emu.cpp"
    cpp.write_text(convert(_cuda._SRC.read_text()))
    so = d / "kvzl_emu.so"
    cmd = ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", f"-I{HERE / 'cuda_emu'}",
           "-o", str(so), str(cpp)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    L = ctypes.CDLL(str(so))
    P, I, LL = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    L.kvzl_benc_launch.argtypes = [P, P, I, P, P, P, P, P, P, P, P, P, LL, P]
    L.kvzl_basm_launch.argtypes = [P, P, P, P, P, I, P]
    L.kvzl_bmant_launch.argtypes = [P, P, P, I, LL, P]
    L.kvzl_bhead_launch.argtypes = [P, P, I, P, P]
    L.kvzl_bdec_launch.argtypes = [P, P, P, P, P, P, I, P, P, P, P, P, P, P]
    L.kvzl_bdec_smem_launch.argtypes = [P, P, P, P, P, P, I, I, P, P, P, P, P, P, P]
    L.kvzl_benc_smem_launch.argtypes = [P, P, I, P, P, P, I, P, P, P, P, P, P, LL, P]
    L.kvzl_bfold_launch.argtypes = [P, P, P, P, P, I, P, P]
    L.kvzl_decode_launch.argtypes = [P, P, I, P, P, P, I, I, P, P, P, P]
    monkeypatch_module.setattr(_cuda, "lib", lambda device=None: L)
    monkeypatch_module.setattr(_cuda, "_stream", lambda: ctypes.c_void_p(0))
    return L


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _decode(buf, offs, plans, sets, xs):
    oo = np.concatenate([[0], np.cumsum([x.numel() for x in xs])[:-1]])
    out = torch.empty(sum(x.numel() for x in xs), dtype=torch.bfloat16)
    si = batch._set_index(plans, sets)
    _, bad = gpu_batch.decode_batch(buf, offs, plans, sets, si, out, oo, backend="cuda")
    return out, bad.tolist()


@pytest.fixture(params=gpu_batch.CUDA_DECODERS)
def design(request, monkeypatch):
    """Each CUDA encoder and decoder design (first: tables through L1; second: shared memory)."""
    monkeypatch.setenv("KVZIP_LOSSLESS_ENCODER", request.param)
    monkeypatch.setenv("KVZIP_LOSSLESS_DECODER", request.param)
    return request.param


def test_cuda_kernels_same_bytes_exact_and_flags(emu, design):
    ts = tb.table_set()
    xs, slots = tb.batch_inputs()
    ref = tb.reference(xs, ts, slots, 16)
    data, offs, lens, plans = gpu_batch.encode_batch(xs, ts, slots, 16, backend="cuda")
    assert [tb.blob_bytes(data, offs, lens, i) for i in range(4)] == ref
    assert (plans == kl.plan_blobs(ref)).all()
    out, bad = _decode(data, offs, plans, [ts], xs)
    assert bad == [0] * 4
    assert torch.equal(out.view(torch.int16), torch.cat([x.view(-1) for x in xs]).view(torch.int16))
    # header (shape: CRC), lane states, escapes/mantissas, a raw tile, the last word
    for i, pos in ((0, 44), (0, 120), (2, 70), (0, 300), (3, 150), (1, int(lens[1]) - 3)):
        b = data.clone()
        b[int(offs[i]) + pos] ^= 0x21
        assert [int(v != 0) for v in _decode(b, offs, plans, [ts], xs)[1]] == [
            int(k == i) for k in range(4)
        ], (i, pos)


def test_cuda_kernels_many_chunks(emu, design):
    """1,024 columns (32 chunks a tile), two tiles a blob, a partial last tile, an escape."""
    big = [tb.kv_like(100, 8, 128, s) for s in range(2)]
    big[1][5, 3, 7] = 3e38
    ts = kl.build_kv_tables([[(big[0], big[1])]])
    ref = tb.reference(big, ts, [0, 1], 64)
    d, o, ln, p = gpu_batch.encode_batch(big, ts, [0, 1], 64, backend="cuda")
    assert [tb.blob_bytes(d, o, ln, i) for i in range(2)] == ref
    out, bad = _decode(d, o, p, [ts], big)
    assert bad == [0] * 2
    assert torch.equal(
        out.view(torch.int16), torch.cat([x.view(-1) for x in big]).view(torch.int16)
    )


def _single_decode(blob: bytes, table, check=False):
    """``gpu.GpuBlob`` with the CUDA C decoder (kvzl_decode), on CPU tensors."""
    h = B.parse_header(memoryview(blob))
    gb = gpu.GpuBlob(memoryview(blob), h, table, torch.device("cpu"), backend="cuda")
    out = torch.empty(h.shape, dtype=torch.bfloat16)
    flag = gb.decode(torch.frombuffer(bytearray(blob), dtype=torch.uint8), out, check=check)
    return out, int(flag)


@pytest.mark.parametrize("case", ["calibrated", "escapes", "embedded", "odd"])
def test_cuda_single_blob_decoder_exact_and_flags(emu, case):
    """kvzl_decode, the one-blob decoder: the batched decoders' row loop (``rans_rows``) with
    escapes patched after the launch; exact on coded tiles with escapes, partial 32-lane
    chunks (37 columns), several tiles; a flipped byte in a lane state, a word or a mantissa
    raises."""
    ts = tb.table_set()
    kw = dict(tables=ts, slot=1)
    x = tb.kv_like(40, 2, 16, 10)
    if case == "escapes":
        x[2, 0, 1], x[9, 1, 2], x[20, 1, 15] = 3e38, -1e-38, float("nan")
    elif case == "embedded":
        kw = {}
    elif case == "odd":
        x, kw = tb.kv_like(40, 1, 37, 4), {}
    blob = kl.compress(x, rows_per_tile=16, **kw)
    h = B.parse_header(memoryview(blob))
    assert (h.modes == B.MODE_RANS).sum() >= 2, "test must exercise coded tiles"
    if case == "escapes":
        assert h.n_exc.sum() >= 3
    table = codec.table_for(h, ts if kw else None)
    y, flag = _single_decode(blob, table)
    assert flag == 0
    assert torch.equal(y.view(torch.int16), x.view(torch.int16))
    for pos in (h.tiles_start + 4 * 1 + 2, len(blob) - 3, h.tiles_start + int(h.lengths[0]) // 2):
        b = bytearray(blob)
        b[pos] ^= 0x21
        with pytest.raises(kl.CorruptBlobError):
            _single_decode(bytes(b), table, check=True)
