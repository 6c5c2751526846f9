"""The batched API (kvzip_lossless.batch, spec/blob.md section 9): the same bytes as
``compress``, exact decode, per-blob damage flags, refusals of bad input.

The CPU path runs the CPU coder; the GPU path's Triton kernels run on CPU tensors under
TRITON_INTERPRET=1 (small shapes: the interpreter is slow); ``-m gpu`` runs the CUDA C
kernels on an 8B-shaped chunk.
"""

import numpy as np
import pytest
import torch

import kvzip_lossless as kl
from kvzip_lossless import batch, gpu, gpu_batch
from kvzip_lossless import blob as B
from kvzip_lossless import tables as T


def kv_like(t, h, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, d, generator=g) * (torch.rand(1, h, d, generator=g) * 3 + 0.05)
    return (x + torch.randn(1, h, d, generator=g) * 2).bfloat16()


def table_set(seed=3, layers=2, h=2, d=16):
    w = [(kv_like(400, h, d, seed + k), kv_like(400, h, d, seed + 7 + k)) for k in range(layers)]
    return kl.build_kv_tables([w])


def batch_inputs():
    """Four tensors: coded tiles with escapes, a partial last tile, an all-raw tensor."""
    xs = [
        kv_like(40, 2, 16, 3),
        kv_like(40, 2, 16, 10),
        kv_like(23, 2, 16, 4),
        kv_like(40, 2, 16, 11),
    ]
    xs[0][2, 0, 1], xs[0][9, 1, 2], xs[2][3, 0, 0] = 3e38, float("nan"), -1e-38
    xs[3] = (torch.randn(40, 2, 16, generator=torch.Generator().manual_seed(5)) * 1e10).bfloat16()
    return xs, [0, 1, 2, 3]


def reference(xs, ts, slots, rpt):
    return [
        kl.compress(x, tables=ts, slot=s, rows_per_tile=rpt) for x, s in zip(xs, slots, strict=True)
    ]


def blob_bytes(data, offs, lens, i):
    return bytes(data[int(offs[i]) : int(offs[i]) + int(lens[i])].cpu().numpy().tobytes())


def test_cpu_batch_equals_compress_and_decodes_exactly():
    ts = table_set()
    xs, slots = batch_inputs()
    ref = reference(xs, ts, slots, 16)
    h = [B.parse_header(memoryview(r)) for r in ref]
    assert (h[0].modes == B.MODE_RANS).any() and h[0].n_exc.sum() >= 2
    assert (h[3].modes == B.MODE_RAW).all(), "the test must exercise raw tiles"
    eb = kl.encode_batch(xs, tables=ts, slots=slots, rows_per_tile=16)
    assert len(eb) == 4 and eb.nbytes == sum(len(r) for r in ref)
    assert [eb.blob(i) for i in range(4)] == ref
    assert (eb.offsets % batch.ALIGN == 0).all()
    assert (eb.plans == kl.plan_blobs(ref)).all()
    # into one buffer at chosen offsets (a gap between blobs)
    oo = np.array([0, 2000, 4000, 6000])
    out = torch.zeros(8000, dtype=torch.bfloat16)
    _, bad = kl.decode_batch(eb.data, eb.offsets, eb.plans, tables=ts, out=out, out_offsets=oo)
    assert bad.tolist() == [0, 0, 0, 0]
    for i, x in enumerate(xs):
        got = out[oo[i] : oo[i] + x.numel()].view(torch.int16)
        assert torch.equal(got, x.view(-1).view(torch.int16))
    assert torch.equal(out[1280:2000].view(torch.int16), torch.zeros(720, dtype=torch.int16))


def test_cpu_batch_flags_only_the_damaged_blob():
    ts = table_set()
    xs, slots = batch_inputs()
    eb = kl.encode_batch(xs, tables=ts, slots=slots, rows_per_tile=16)
    for i, pos in ((0, 30), (1, int(eb.lengths[1]) - 5), (3, 200)):
        d = eb.data.clone()
        d[int(eb.offsets[i]) + pos] ^= 0x10
        _, bad = kl.decode_batch(d, eb.offsets, eb.plans, tables=ts)
        assert bad.tolist() == [int(k == i) for k in range(4)], (i, pos)
        with pytest.raises(kl.CorruptBlobError, match=f"blob\\(s\\) \\[{i}\\]"):
            kl.check_batch(bad)


def test_prepared_decode_reads_data_only_when_run_and_runs_once():
    """``prepare_decode_batch``: the checks now (bad input refused at once), the blobs read at
    ``run`` (here copied in after the prepare, as a restore does), the same values and flags
    as ``decode_batch``; a second run is refused."""
    ts = table_set()
    xs, slots = batch_inputs()
    eb = kl.encode_batch(xs, tables=ts, slots=slots, rows_per_tile=16)
    data = torch.zeros_like(eb.data)
    prep = kl.prepare_decode_batch(data, eb.offsets, eb.plans, tables=ts)
    data.copy_(eb.data)
    out, bad = prep.run()
    assert bad.tolist() == [0, 0, 0, 0]
    oo = np.concatenate([[0], np.cumsum([x.numel() for x in xs])[:-1]])
    for i, x in enumerate(xs):
        got = out[oo[i] : oo[i] + x.numel()].view(torch.int16)
        assert torch.equal(got, x.view(-1).view(torch.int16))
    with pytest.raises(RuntimeError, match="has run already"):
        prep.run()
    # prepared over the zeros, run over the zeros: every blob flagged, nothing trusted
    _, bad = kl.prepare_decode_batch(
        torch.zeros_like(eb.data), eb.offsets, eb.plans, tables=ts
    ).run()
    assert bad.tolist() == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="lies outside data"):
        kl.prepare_decode_batch(data[:100], eb.offsets, eb.plans, tables=ts)
    assert not kl.prepare_copies_nothing("cpu")  # (CUDA C decoder: -m gpu below)


def test_cuda_decoder_is_chosen_by_argument_then_environment(monkeypatch):
    monkeypatch.delenv("KVZIP_LOSSLESS_DECODER", raising=False)
    assert gpu_batch.cuda_decoder() == gpu_batch.DEFAULT_DECODER
    monkeypatch.setenv("KVZIP_LOSSLESS_DECODER", "smem")
    assert gpu_batch.cuda_decoder() == "smem"
    assert gpu_batch.cuda_decoder("l1") == "l1"
    monkeypatch.setenv("KVZIP_LOSSLESS_DECODER", "fast")
    with pytest.raises(ValueError, match="unknown CUDA decoder 'fast'.*'l1', 'smem'"):
        gpu_batch.cuda_decoder()
    monkeypatch.delenv("KVZIP_LOSSLESS_ENCODER", raising=False)
    assert gpu_batch.cuda_encoder() == gpu_batch.DEFAULT_ENCODER
    monkeypatch.setenv("KVZIP_LOSSLESS_ENCODER", "smem")
    assert gpu_batch.cuda_encoder() == "smem" and gpu_batch.cuda_encoder("l1") == "l1"
    monkeypatch.setenv("KVZIP_LOSSLESS_ENCODER", "x")
    with pytest.raises(ValueError, match="unknown CUDA encoder 'x'"):
        gpu_batch.cuda_encoder()


def test_batch_refuses_bad_input():
    ts = table_set()
    xs, slots = batch_inputs()
    eb = kl.encode_batch(xs, tables=ts, slots=slots, rows_per_tile=16)
    with pytest.raises(ValueError, match="plans must be"):
        kl.decode_batch(eb.data, eb.offsets, eb.plans[:, :5], tables=ts)
    bad_plan = eb.plans.copy()
    bad_plan[1, 4] += 1  # n_tiles
    with pytest.raises(ValueError, match="plan 1 is malformed"):
        kl.decode_batch(eb.data, eb.offsets, bad_plan, tables=ts)
    with pytest.raises(ValueError, match="multiples of 4"):
        kl.decode_batch(eb.data, eb.offsets + 2, eb.plans, tables=ts)
    with pytest.raises(ValueError, match="outside data"):
        kl.decode_batch(eb.data[:-8], eb.offsets, eb.plans, tables=ts)
    with pytest.raises(ValueError, match="was not given"):
        kl.decode_batch(eb.data, eb.offsets, eb.plans, tables=table_set(seed=20))
    for field, value, why in ((2, 5, "of 5 columns"), (7, 99, "no slot 99")):
        wrong = eb.plans.copy()
        wrong[2, field] = value  # blob 2 names columns or a slot its table set lacks
        with pytest.raises(ValueError, match=why):
            batch._set_index(wrong, [ts])
    with pytest.raises(ValueError, match="out holds"):
        kl.decode_batch(eb.data, eb.offsets, eb.plans, tables=ts,
                        out=torch.empty(100, dtype=torch.bfloat16))  # fmt: skip
    with pytest.raises(ValueError, match="one slot per tensor"):
        kl.encode_batch(xs, tables=ts, slots=slots[:2])
    with pytest.raises(TypeError, match="TableSet"):
        kl.encode_batch(xs, tables=None, slots=slots)
    with pytest.raises(ValueError, match="slot must be"):
        kl.encode_batch(xs, tables=ts, slots=[0, 1, 2, 9])
    with pytest.raises(ValueError, match="bfloat16"):
        kl.encode_batch([xs[0].float()], tables=ts, slots=[0])
    with pytest.raises(ValueError, match="embeds its own table"):
        kl.plan_blobs([kl.compress(xs[0])])


def test_fit_table_torch_equals_numpy():
    x = kv_like(300, 4, 16, 8)
    a = x.view(torch.int16).reshape(300, -1)
    for b in (T.BUCKETS_K, T.BUCKETS_V):
        ref = T.fit_table([a.numpy().view(np.uint16), a[:100].numpy().view(np.uint16)], b)
        assert T.fit_table_torch([a, a[:100]], b).to_bytes() == ref.to_bytes()


def fit_cases(seed):
    """Tables' samples (int16 ``[rows, columns]``) and bucket maps for the batched fit: KV-like
    windows of several lengths (one row, none), a table whose values are all equal, one of
    every bit pattern (escapes, NaN, inf: many distinct values), columns of another count,
    and a bucket map that puts symbol 0 (a sample's first row's context) in bucket 1."""
    g = torch.Generator().manual_seed(seed)

    def kv(rows, cols):
        return kv_like(rows, 1, cols, int(torch.randint(1 << 30, (1,), generator=g)))

    def bits(x):
        return x.view(torch.int16).flatten(1)

    odd = tuple((31 - s) % 5 for s in range(T.NSYM))
    slots = [
        [bits(kv(64, 48)), bits(kv(1, 48)), bits(kv(0, 48)), bits(kv(64, 48))],
        [bits(kv(64, 48)), bits(kv(17, 48))],
        [torch.full((40, 48), -0.75, dtype=torch.bfloat16).view(torch.int16)],
        [torch.randint(-(1 << 15), 1 << 15, (300, 48), dtype=torch.int16, generator=g)],
        [bits(kv(64, 20)), bits(kv(5, 20))],
        [bits(kv(64, 48)), bits(kv(3, 48))],
    ]
    buckets = [T.BUCKETS_K, T.BUCKETS_V, T.BUCKETS_K, T.BUCKETS_K, T.BUCKETS_V, odd]
    return slots, buckets


@pytest.mark.parametrize("stack_values", [1 << 20, 1000])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_tables_torch_equals_numpy_table_by_table(seed, stack_values, monkeypatch):
    """The batched fit (one stack of like samples, or many: a small stack size) gives each
    table's bytes as numpy's fit_table, and fit_table_torch the same."""
    monkeypatch.setitem(T._STACK_VALUES, "cpu", stack_values)
    slots, buckets = fit_cases(seed)
    ref = [
        T.fit_table([x.numpy().view(np.uint16) for x in s], b)
        for s, b in zip(slots, buckets, strict=True)
    ]
    got = T.fit_tables_torch(slots, buckets)
    assert [t.to_bytes() for t in got] == [t.to_bytes() for t in ref]
    assert T.fit_table_torch(slots[5], buckets[5]).to_bytes() == ref[5].to_bytes()
    # all equal: per column one symbol, in two contexts (first row, the rest), takes all but 31
    assert (got[2].freq == T.PROB_SCALE - T.NSYM + 1).sum() == 2 * 48


def test_normalize_counts_torch_equals_numpy():
    g = torch.Generator().manual_seed(4)
    c = torch.randint(0, 1000, (200, T.NSYM), generator=g) * (
        torch.rand(200, T.NSYM, generator=g) < 0.3
    )
    c[:3] = 0
    c[3, :2] = 7  # ties: the first maximum takes the rest
    c[4, 5] = 1 << 40
    assert np.array_equal(T._normalize_counts_torch(c).numpy(), T.normalize_counts(c.numpy()))


def test_build_kv_tables_equals_numpy_fit_table():
    """An 8B-like set in miniature (windows of 3 layers, one of one token): build_kv_tables'
    TableSet (counted by torch) is numpy's fit_table's, slot by slot, byte for byte."""
    windows = [
        [
            (kv_like(t, 2, 16, 10 * w + 2 * k), kv_like(t, 2, 16, 10 * w + 2 * k + 1))
            for k in range(3)
        ]
        for w, t in enumerate((40, 1, 33))
    ]
    ref = T.TableSet(
        [
            T.fit_table(
                [
                    w[s // 2][s % 2].view(torch.int16).flatten(1).numpy().view(np.uint16)
                    for w in windows
                ],
                T.BUCKETS_K if s % 2 == 0 else T.BUCKETS_V,
            )
            for s in range(6)
        ]
    )
    assert kl.build_kv_tables(windows).to_bytes() == ref.to_bytes()


def test_fit_tables_torch_reads_the_device_once(monkeypatch):
    """On the meta device (shapes, no data: any read of device data on the host fails) the fit
    runs through with one copy to the host: on a GPU one synchronisation for the whole set,
    where table by table CUDA's bincount alone took four per sample."""
    copies = []

    def cpu(t):
        copies.append(tuple(t.shape))
        return torch.zeros(t.shape, dtype=t.dtype)

    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    slots = [[torch.empty(r, 8, dtype=torch.int16, device="meta") for r in (9, 1)]] * 3
    tables = T.fit_tables_torch(slots, [T.BUCKETS_K, T.BUCKETS_V, T.BUCKETS_K])
    assert len(copies) == 1
    assert [t.freq.shape for t in tables] == [(8, 8, 32), (8, 1, 32), (8, 8, 32)]


def test_fit_tables_torch_refuses_bad_input():
    a = torch.zeros(4, 8, dtype=torch.int16)
    with pytest.raises(ValueError, match="at least one sample"):
        T.fit_tables_torch([[a], []], [T.BUCKETS_K, T.BUCKETS_V])
    with pytest.raises(ValueError, match="at least one sample"):
        T.fit_tables_torch([[a]], [T.BUCKETS_K, T.BUCKETS_V])
    with pytest.raises(ValueError, match="32 entries"):
        T.fit_tables_torch([[a]], [(0,) * 31])
    with pytest.raises(ValueError, match=r"int16 \[rows, 8\]"):
        T.fit_tables_torch([[a, a[:, :4]]], [T.BUCKETS_K])
    with pytest.raises(ValueError, match="int16"):
        T.fit_table_torch([a.float()])
    with pytest.raises(ValueError, match="torch tensors"):
        T.fit_tables_torch([[a, a.numpy()]], [T.BUCKETS_K])


needs_triton = pytest.mark.skipif(not gpu.available(), reason="needs Triton (interpreter or CUDA)")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_flat_values_is_a_view_only_where_the_tensors_lie_back_to_back():
    """A store job's chunks staged in one buffer (chunk-major, every layer's K then V) are
    read in place; any other arrangement is concatenated; the values are the same."""
    buf = torch.randn(3, 4, 5, 6).bfloat16()
    cases = {
        "in order": ([buf[j, k] for j in range(3) for k in range(4)], True),
        "a suffix of the buffer": ([buf[1:][j, k] for j in range(2) for k in range(4)], True),
        "out of order": ([buf[j, k] for k in range(4) for j in range(3)], False),
        "a gap": ([buf[0, 0], buf[0, 2]], False),
        "strided": ([buf[0].transpose(1, 2)], False),
        "another buffer": ([buf[0, 0], buf[0, 1].clone()], False),
    }
    for name, (ts, view) in cases.items():
        flat = gpu_batch.flat_values(ts)
        want = torch.cat([t.reshape(-1) for t in ts]).view(torch.int16)
        assert flat.dtype == torch.int16 and torch.equal(flat, want), name
        shared = flat.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        assert shared is view, name


@needs_triton
def test_triton_batch_same_bytes_exact_and_damage_flags():
    ts, ts2 = table_set(), table_set(seed=30)
    xs, slots = batch_inputs()
    xs = [x.to(DEV) for x in xs]
    ref = reference([x.cpu() for x in xs], ts, slots, 16)
    data, offs, lens, plans = gpu_batch.encode_batch(xs, ts, slots, 16, backend="triton")
    assert [blob_bytes(data, offs, lens, i) for i in range(4)] == ref
    assert (plans == kl.plan_blobs(ref)).all()
    # the same tensors as views lying back to back in one buffer (read in place): same bytes
    packed = torch.cat([x.reshape(-1) for x in xs])
    ends = np.cumsum([0] + [x.numel() for x in xs])
    views = [packed[a:b].view(x.shape) for a, b, x in zip(ends[:-1], ends[1:], xs, strict=True)]
    d1, o1, l1, _ = gpu_batch.encode_batch(views, ts, slots, 16, backend="triton")
    assert [blob_bytes(d1, o1, l1, i) for i in range(4)] == ref
    # a second batch with another table set, both copied into one buffer at other offsets
    y = kv_like(24, 2, 16, 12).to(DEV)
    d2, o2, l2, p2 = gpu_batch.encode_batch([y], ts2, [1], 16, backend="triton")
    assert blob_bytes(d2, o2, l2, 0) == kl.compress(y.cpu(), tables=ts2, slot=1, rows_per_tile=16)
    buf = torch.zeros(int(lens.sum()) + int(l2[0]) + 64, dtype=torch.uint8, device=DEV)
    at = np.array([64, 64 + int(l2[0])])
    buf[at[0] : at[0] + int(l2[0])] = d2
    buf[at[1] : at[1] + data.numel()] = data
    offsets = np.concatenate([[at[0]], at[1] + offs])
    plans_all = np.concatenate([p2, plans])
    sets = [ts, ts2]
    si = batch._set_index(plans_all, sets)
    tensors = [y, *xs]
    n_out = sum(t.numel() for t in tensors)
    oo = np.concatenate([[0], np.cumsum([t.numel() for t in tensors])[:-1]])
    out = torch.empty(n_out, dtype=torch.bfloat16, device=DEV)
    _, bad = gpu_batch.decode_batch(buf, offsets, plans_all, sets, si, out, oo, backend="triton")
    assert bad.tolist() == [0] * 5
    for i, t in enumerate(tensors):
        got = out[oo[i] : oo[i] + t.numel()].view(torch.int16)
        assert torch.equal(got, t.reshape(-1).view(torch.int16))
    # damage: header field (CRC), a coded tile's words, the end of a coded blob, a raw tile
    for i, pos in ((1, 44), (1, 120), (2, int(plans_all[2, 0]) - 3), (4, 150)):
        b = buf.clone()
        b[int(offsets[i]) + pos] ^= 0x21
        _, bad = gpu_batch.decode_batch(b, offsets, plans_all, sets, si, out, oo,
                                        backend="triton")  # fmt: skip
        assert [int(v != 0) for v in bad.tolist()] == [int(k == i) for k in range(5)], (i, pos)


def test_work_items_of_like_blobs_are_built_once_and_equal_a_fresh_build(monkeypatch):
    """A batch whose blobs share a tile count and width (a tier's chunks) reuses its work items
    (the same arrays on a second call), equal to a fresh build; other batches are built each
    time; the cache keeps the ``ITEMS_CACHED`` most recent."""
    monkeypatch.setattr(gpu_batch, "_ITEMS", type(gpu_batch._ITEMS)())
    nt, nch = np.full(5, 3, np.int64), np.full(5, 2, np.int64)
    first = gpu_batch._work_items(nt, nch, pinned=False)
    want = gpu_batch._decode_items(nt, nch)
    assert all(np.array_equal(a, b) for a, b in zip(first, want, strict=True))
    again = gpu_batch._work_items(nt, nch, pinned=False)
    assert all(a is b for a, b in zip(again, first, strict=True))
    mixed = np.array([3, 3, 2, 3, 3], np.int64)
    one, two = (gpu_batch._work_items(mixed, nch, pinned=False) for _ in range(2))
    assert one[0] is not two[0] and np.array_equal(one[0], gpu_batch._decode_items(mixed, nch)[0])
    for k in range(gpu_batch.ITEMS_CACHED + 2):
        gpu_batch._work_items(np.full(k + 1, 4, np.int64), np.full(k + 1, 2), pinned=False)
    assert len(gpu_batch._ITEMS) == gpu_batch.ITEMS_CACHED


@needs_triton
def test_triton_decode_of_like_blobs_twice_is_exact():
    """Two decodes of one batch of like blobs (the second with the cached work items): both
    bit-exact, no blob flagged."""
    ts = table_set()
    xs = [kv_like(40, 2, 16, seed).to(DEV) for seed in (3, 10, 4, 11)]
    slots = [0, 1, 2, 3]
    data, offs, lens, plans = gpu_batch.encode_batch(xs, ts, slots, 16, backend="triton")
    si = batch._set_index(plans, [ts])
    oo = np.arange(4) * xs[0].numel()
    for _ in range(2):
        out = torch.full((4 * xs[0].numel(),), float("nan"), dtype=torch.bfloat16, device=DEV)
        _, bad = gpu_batch.decode_batch(data, offs, plans, [ts], si, out, oo, backend="triton")
        assert bad.tolist() == [0] * 4
        assert torch.equal(out.view(torch.int16), torch.cat(xs).reshape(-1).view(torch.int16))


@needs_triton
def test_triton_prepared_decode_runs_on_data_copied_after_the_prepare():
    """The GPU path's two steps (descriptors up at the prepare, kernels at ``run``) on the
    Triton kernels: blobs copied into the buffer after the prepare decode exactly."""
    ts = table_set()
    xs, slots = batch_inputs()
    xs = [x.to(DEV) for x in xs]
    data, offs, lens, plans = gpu_batch.encode_batch(xs, ts, slots, 16, backend="triton")
    buf = torch.zeros_like(data)
    si = batch._set_index(plans, [ts])
    oo = np.concatenate([[0], np.cumsum([x.numel() for x in xs])[:-1]])
    out = torch.empty(sum(x.numel() for x in xs), dtype=torch.bfloat16, device=DEV)
    prep = gpu_batch.prepare_decode(buf, offs, plans, [ts], si, out, oo, backend="triton")
    buf.copy_(data)
    _, bad = prep.run()
    assert bad.tolist() == [0] * 4
    for i, x in enumerate(xs):
        assert torch.equal(out[oo[i] : oo[i] + x.numel()].view(torch.int16),
                           x.reshape(-1).view(torch.int16))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("design", gpu_batch.CUDA_DECODERS)
def test_cuda_batch_8b_chunk_matches_cpu(design, monkeypatch):
    """A 256-token chunk of an 8B-shaped model (4 layers here) through the CUDA kernels, with
    each CUDA encoder and decoder design (K's 8 context buckets and V's 1 in one batch): the
    CPU coder's bytes, exact values."""
    assert gpu_batch.CUDA_ENCODERS == gpu_batch.CUDA_DECODERS
    monkeypatch.setenv("KVZIP_LOSSLESS_DECODER", design)
    monkeypatch.setenv("KVZIP_LOSSLESS_ENCODER", design)
    # the CUDA C decoder reads its descriptors from page-locked host memory
    assert kl.prepare_copies_nothing("cuda") == (gpu.default_backend("cuda") == "cuda")
    layers = [(kv_like(256, 8, 128, 2 * k), kv_like(256, 8, 128, 2 * k + 1)) for k in range(4)]
    ts = kl.build_kv_tables([[(k.cuda(), v.cuda()) for k, v in layers]])
    assert ts.to_bytes() == kl.build_kv_tables([layers]).to_bytes()
    xs = [t for kv in layers for t in kv]
    xs[0][3, 1, 5] = 3e38
    slots = list(range(len(xs)))
    eb = kl.encode_batch([x.cuda() for x in xs], tables=ts, slots=slots)
    assert eb.data.is_cuda
    assert [eb.blob(i) for i in range(len(xs))] == reference(xs, ts, slots, 1024)
    out, bad = kl.decode_batch(eb.data, eb.offsets, eb.plans, tables=ts)
    assert bad.cpu().tolist() == [0] * len(xs)
    assert torch.equal(
        out.cpu().view(torch.int16), torch.cat([x.view(-1) for x in xs]).view(torch.int16)
    )
    d = eb.data.clone()
    d[int(eb.offsets[5]) + 500] ^= 1
    _, bad = kl.decode_batch(d, eb.offsets, eb.plans, tables=ts)
    assert [int(v != 0) for v in bad.cpu().tolist()] == [int(k == 5) for k in range(len(xs))]
    # a column count that is not a multiple of 32 (the last chunk's lanes partly idle)
    y = kv_like(300, 3, 20, 9)
    ty = kl.build_kv_tables([[(y, kv_like(300, 3, 20, 10))]])
    ey = kl.encode_batch([y.cuda()], tables=ty, slots=[0])
    assert ey.blob(0) == kl.compress(y, tables=ty, slot=0)
    oy, by = kl.decode_batch(ey.data, ey.offsets, ey.plans, tables=ty)
    assert by.cpu().tolist() == [0]
    assert torch.equal(oy.cpu().view(torch.int16), y.view(-1).view(torch.int16))


def test_bank_slot_arrays_are_each_blobs_table_offsets():
    """``Bank.slot_arrays`` (one lookup over all blobs) gives each blob its (set, slot)'s
    offsets, sizes and columns from the bank's per-table dictionaries; zeros for slot -1."""
    sets = [table_set(), table_set(seed=20)]
    bk = gpu_batch.Bank(sets, "cpu")
    rng = np.random.default_rng(0)
    n = 200
    set_idx = rng.integers(0, 2, n)
    slots = np.array([rng.integers(-1, len(sets[k])) for k in set_idx])
    got = bk.slot_arrays(set_idx, slots)
    for i in range(n):
        key = (int(set_idx[i]), int(slots[i]))
        want = (
            (0, 0, 0, 0, 0)
            if key[1] < 0
            else (bk.tab_off[key], bk.bmap_off[key], bk.base_off[key], bk.nb[key], bk.cols[key])
        )
        assert tuple(got[:, i].tolist()) == want, i
    with pytest.raises(ValueError, match="does not hold"):
        bk.slot_arrays(np.array([0]), np.array([len(sets[0]) + 5]))


def test_decode_items_are_every_blobs_tiles_and_column_chunks_in_order():
    """``gpu_batch._decode_items`` (int32 repeats into columns) lists, blob by blob and tile
    by tile, every (blob, tile, 32-column chunk) once, as the direct construction does; blobs
    without tiles and an empty batch included."""
    rng = np.random.default_rng(1)
    for n in (0, 1, 7, 300):
        nt = rng.integers(0, 20, n)
        nch = rng.integers(1, 40, n)
        items, t_blob = gpu_batch._decode_items(nt, nch)
        want = [(b, t, c) for b in range(n) for t in range(nt[b]) for c in range(nch[b])]
        assert items.dtype == np.int32 and t_blob.dtype == np.int32
        assert items.reshape(-1, 3).tolist() == [list(w) for w in want]
        assert t_blob.tolist() == [b for b in range(n) for _ in range(nt[b])]
