"""The tier's GPU pipeline without vLLM: stores from and restores into a paged cache laid out
as vLLM's, bit-exact, damage refused, budget kept, counters, and one timed restore.

Every test runs on CUDA (marked gpu) and as a CPU twin on small shapes, where the same
pipeline runs without streams and kvzip-lossless's Triton decode kernel under the interpreter.
The timed restore writes ``cuda_tier_restore.json`` / ``.md`` to ``$KVZIP_RESULTS_DIR`` when
set (the H200 run; figures in the package README come from those files).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import pytest
import torch

# Triton reads TRITON_INTERPRET when it is first imported (its own library functions are
# jitted then): a module imported earlier in the session may have beaten this line.
TRITON_EARLY = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kvzip_lossless  # noqa: E402
from kvzip_lossless import blob as B  # noqa: E402
from kvzip_vllm import cuda_pipeline  # noqa: E402
from kvzip_vllm.batch_decode import DecodeStep, plan_block  # noqa: E402
from kvzip_vllm.cuda_pipeline import CudaTierPipeline  # noqa: E402
from kvzip_vllm.store import BlockStore, pack_record  # noqa: E402

pytest.importorskip("triton", reason="kvzip-lossless's GPU decode kernel is a Triton kernel")

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and not TRITON_EARLY
DEVICES = [
    pytest.param(
        "cpu",
        id="cpu",
        # a GPU machine runs the CUDA cases instead; without CUDA, conftest.py guarantees the
        # interpreter (checked below), so the CPU twin always runs there
        marks=pytest.mark.skipif(
            not INTERPRET, reason="the CPU twin runs where there is no CUDA (Triton interpreted)"
        ),
    ),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]
if not CUDA and not INTERPRET:
    raise RuntimeError(
        "no CUDA and Triton not interpreted: the CPU twins need TRITON_INTERPRET=1 set before "
        "triton is first imported (tests/conftest.py sets it)"
    )
# (layers, kv_heads, block_size, head_size): small for the interpreter; Llama-8B's heads on CUDA
SHAPES = {"cpu": (3, 2, 16, 16), "cuda": (4, 8, 16, 128)}
NUM_BLOCKS = 12
# vLLM's KVCacheLayout stride orders over logical [L, B, H, N, C] (vllm/v1/kv_cache_layout.py)
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "BLNHC": (1, 0, 3, 2, 4)}


def paged_caches(layers, heads, block_size, head_size, device, layout="LBNHC", blocks=NUM_BLOCKS):
    """One backing buffer viewed per layer as ``[num_blocks, kv_heads, block_size,
    2 * head_size]`` bf16 with the layout's strides, as vLLM's create_kv_cache_views does."""
    shape = (layers, blocks, heads, block_size, 2 * head_size)
    strides, step = [0] * 5, 1
    for dim in reversed(LAYOUTS[layout]):
        strides[dim] = step
        step *= shape[dim]
    buf = torch.zeros(step, dtype=torch.bfloat16, device=device)
    view = torch.as_strided(buf, shape, strides)
    return buf, [view[layer] for layer in range(layers)]


def kv_values(shape, seed, device):
    """KV-like bf16: per (head, channel) a scale and an offset (keys' constant offsets), noise."""
    g = torch.Generator().manual_seed(seed)
    *lead, h, d = shape
    scale = torch.rand(h, d, generator=g) * 2 + 0.05
    offset = torch.randn(h, d, generator=g) * 1.5
    x = torch.randn(*lead, h, d, generator=g) * scale + offset
    return x.to(torch.bfloat16).to(device)


def fill(caches, seed):
    """Every block of every layer, K and V, with KV-like values of one law per layer."""
    for layer, cache in enumerate(caches):
        b, h, n, c = cache.shape
        cache.copy_(kv_values((b, n, h, c), seed * 1000 + layer, cache.device).permute(0, 2, 1, 3))


def calibrated_tables(layers, heads, head_size, tokens=256):
    """A table set fitted on other draws of the same law (as one fitted on calibration text)."""
    window = []
    for layer in range(layers):
        x = kv_values((tokens, heads, 2 * head_size), 1000 + layer, "cpu")
        window.append((x[..., :head_size].contiguous(), x[..., head_size:].contiguous()))
    return kvzip_lossless.build_kv_tables([window])


def bits(t):
    return t.contiguous().view(torch.int16)


def assert_block_equal(caches, got_id, want, want_id):
    for layer, (cache, ref) in enumerate(zip(caches, want, strict=True)):
        diff = (bits(cache[got_id]) != bits(ref[want_id])).nonzero()
        assert diff.numel() == 0, (
            f"layer {layer}: block {got_id} != stored block {want_id} at {diff[:4].tolist()}"
        )


def store_blocks(pipe, pairs):
    pipe.start_stores(pairs)
    pipe.drain()
    return pipe.collect()


def key(i):
    return bytes([i]) * 32


@pytest.fixture
def make(request):
    pipes = []

    def build(device, layout="LBNHC", budget=1 << 30, tables="calibrated"):
        layers, heads, n, d = SHAPES[device]
        buf, caches = paged_caches(layers, heads, n, d, device, layout)
        ts = calibrated_tables(layers, heads, d) if tables == "calibrated" else None
        store = BlockStore(budget, tables=ts, fit_tokens=2 * n if tables == "fit" else 0)
        pipe = CudaTierPipeline(store, caches, n)
        pipes.append(pipe)
        return buf, caches, store, pipe

    yield build
    for pipe in pipes:
        pipe.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "layout,tables", [("LBNHC", "calibrated"), ("BLNHC", "fit"), ("LBHNC", "embedded")]
)
def test_restore_into_other_blocks_bit_exact(make, monkeypatch, device, layout, tables):
    monkeypatch.setattr(cuda_pipeline, "BLOCKS_PER_GROUP", 2)  # two copy/decode block groups
    buf, caches, store, pipe = make(device, layout, tables=tables)
    fill(caches, seed=1)
    want = [c.clone() for c in caches]
    src = [1, 3, 4, 7]
    stored, dropped = store_blocks(pipe, [(key(i), i) for i in src])
    assert stored == [key(i) for i in src] and dropped == []
    assert (store.tables is not None) == (tables != "embedded")
    blob = store.get_blobs(key(src[-1]))[0]
    assert (B.parse_header(memoryview(blob)).modes == B.MODE_RANS).any(), "no coded tile tested"
    buf.view(torch.int16).fill_(-1)  # wipe: a NaN pattern that no restored value has
    dst = [0, 2, 9, 11]
    loads = [("r1", key(1), 0), ("r1", key(3), 2), ("r2", key(4), 9), ("r2", key(7), 11)]
    pipe.start_loads(loads)
    assert pipe.wait_loads() == set()
    for s, d in zip(src, dst, strict=True):
        assert_block_equal(caches, d, want, s)
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst]
    assert all((bits(c[untouched]) == -1).all() for c in caches), "wrote outside the blocks"
    st = store.stats
    layers, heads, n, d = SHAPES[device]
    assert (st.restore_hits, st.blocks_restored, st.tokens_restored) == (2, 4, 4 * n)
    assert st.raw_bytes_stored == len(src) * layers * 2 * n * heads * d * 2
    assert 0 < st.bytes_stored and st.restore_seconds > 0 and st.load_errors == 0
    assert st.bytes_held > st.bytes_stored  # the decode plans are held and counted
    assert pipe.wait_loads() == set()  # idempotent


@pytest.mark.parametrize("device", DEVICES)
def test_damaged_or_missing_blocks_refused(make, device):
    buf, caches, store, pipe = make(device)
    fill(caches, seed=2)
    want = [c.clone() for c in caches]
    store_blocks(pipe, [(key(i), i) for i in (0, 1, 2, 3)])
    for k, damage in ((key(1), "flip"), (key(3), "truncate")):
        entry = store._entries[k]
        blobs = list(entry.blobs)
        if damage == "flip":  # in place, in the record the load copies to the device
            bad = np.frombuffer(blobs[3], np.uint8)  # layer 1 V
            bad[len(bad) - 6] ^= 0x5A  # inside the last tile's rANS words (or raw values)
        else:
            blobs[3] = blobs[3][: len(blobs[3]) // 2]
        entry.blobs = tuple(blobs)
    buf.view(torch.int16).fill_(-1)
    loads = [("a", key(0), 5), ("a", key(1), 6), ("a", key(2), 7), ("b", key(9), 8)]
    pipe.start_loads([*loads, ("c", key(3), 10)])
    assert pipe.wait_loads() == {6, 8, 10}
    assert_block_equal(caches, 5, want, 0)
    assert_block_equal(caches, 7, want, 2)
    for layer, cache in enumerate(caches):
        for b in (6, 8, 10):
            assert (bits(cache[b]) == -1).all(), f"layer {layer}: failed block {b} written"
    assert key(1) not in store and key(3) not in store and key(0) in store and key(2) in store
    stored, dropped = pipe.collect()
    assert stored == [] and sorted(dropped) == [key(1), key(3), key(9)]
    st = store.stats
    assert st.load_errors == 3 and st.blocks_restored == 2 and st.restore_hits == 1


@pytest.mark.parametrize("device", DEVICES)
def test_budget_evicts_lru_and_reports_dropped(make, device):
    _, caches, probe, pipe = make(device)
    fill(caches, seed=3)
    store_blocks(pipe, [(key(0), 0)])
    one = probe.stats.bytes_held
    _, caches, store, pipe = make(device, budget=int(one * 2.5))
    fill(caches, seed=3)
    stored, dropped = store_blocks(pipe, [(key(0), 0), (key(1), 1)])
    assert stored == [key(0), key(1)] and dropped == []
    pipe.start_loads([("r", key(0), 4)])  # key 0 is now the most recently used
    assert pipe.wait_loads() == set()
    stored, dropped = store_blocks(pipe, [(key(2), 2)])
    assert stored == [key(2)] and dropped == [key(1)]
    assert key(1) not in store and key(0) in store and key(2) in store
    st = store.stats
    assert st.evictions == 1 and st.bytes_held <= st.budget_bytes and st.blocks_held == 2
    pipe.start_loads([("r", key(1), 5)])
    assert pipe.wait_loads() == {5}  # evicted: never served


@pytest.mark.parametrize("device", DEVICES)
def test_decode_step_mixed_blobs(device):
    """Two blocks whose blobs use table-set slots, embedded tables, escapes and a raw tile,
    decoded in one step from their records (two block groups, plans shifted on the device);
    a damaged blob is flagged alone."""
    h, d = (2, 16) if device == "cpu" else (8, 128)
    ts = calibrated_tables(2, h, d)
    xs, blocks = [], []
    for j in range(2):
        xs.append([])
        for i in range(6):  # blob i: table-set slot i for i < 4
            x = kv_values((16, h, 2 * d), 1000 + min(i, 3) // 2, "cpu").roll(j, 0)
            x = x[..., :d] if i % 2 == 0 else x[..., d:]
            x = x.contiguous()
            if i == 2:
                x[3, 0, 1], x[5, 1, 2], x[9, 0, 0] = 3e38, -1e-38, float("nan")  # escapes
            if i == 4:  # uniform bits: the tile does not shrink and is stored raw
                g = torch.Generator().manual_seed(4 + j)
                x = torch.randint(-(1 << 15), 1 << 15, x.shape, generator=g, dtype=torch.int16)
                x = x.view(torch.bfloat16)
            xs[j].append(x)
        blocks.append(
            tuple(
                kvzip_lossless.compress(x, tables=ts, slot=i)
                if i < 4
                else kvzip_lossless.compress(x)
                for i, x in enumerate(xs[j])
            )
        )
    headers = [B.parse_header(memoryview(b)) for b in blocks[0]]
    assert headers[2].n_exc.sum() >= 3 and (headers[4].modes == B.MODE_RAW).all()
    assert headers[5].embedded is not None and headers[0].embedded is None
    full = [plan_block(b, ts) for b in blocks]
    plans = [p.without_tail() for p in full]
    records = [pack_record(b, p.tail)[0].numpy() for b, p in zip(blocks, full, strict=True)]
    dev = torch.device(device)
    for damaged in (None, (1, 1)):  # (block, blob)
        step = DecodeStep(plans, blocks, dev, ts, {})
        staged = np.full(step.total, 0xEE, np.uint8)  # padding the step must not read
        for j, rec in enumerate(records):
            staged[step.rec_base[j] : step.rec_base[j] + len(rec)] = rec
        if damaged is not None:
            j, i = damaged
            end = step.rec_base[j] + sum(len(b) for b in blocks[j][: i + 1])
            staged[end - 10] ^= 0x11
        out = torch.zeros((6, 2, 16, h, d), dtype=torch.bfloat16, device=dev)
        blob_dev = torch.from_numpy(staged).to(dev)
        step.upload()
        for j in range(2):  # one group per block, as two copy groups of a load
            step.prepare(j, j + 1, blob_dev)
            step.decode(j, j + 1, blob_dev, out)
        flags = step.finish(blob_dev, out).view(6, 2).cpu()
        for i in range(6):
            for j in range(2):
                assert bool(flags[i, j]) == ((j, i) == damaged), f"block {j} blob {i}"
                if (j, i) != damaged:
                    assert torch.equal(bits(out[i, j].cpu()), bits(xs[j][i])), f"block {j} blob {i}"


def test_pipeline_module_imports_no_vllm():
    import subprocess

    code = (
        "import sys, kvzip_vllm.cuda_pipeline, kvzip_vllm.store, kvzip_vllm.blocks; "
        "bad = [m for m in sys.modules if m.split('.')[0] == 'vllm']; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ------------------------------------------------------------------ timed restore (H200)
def real_kv(kv_dir, layers, tokens, heads, head_size, t0):
    """Per layer [tokens, heads, 2 * head_size] bf16 (K then V) from a real KV dump
    (``K.npy``/``V.npy``: uint16 bf16 bits [layer, token, head, dim], e.g. SmolLM2's): layer
    ``l`` takes dump layer ``l % L``, tokens from ``t0``, columns tiled to the shape."""
    kv = [np.load(os.path.join(kv_dir, f"{x}.npy"), mmap_mode="r") for x in ("K", "V")]
    L, T = kv[0].shape[:2]
    if t0 + tokens > T:
        raise ValueError(f"{kv_dir} holds {T} tokens, {t0 + tokens} needed")
    cols = heads * head_size
    out = []
    for layer in range(layers):
        parts = []
        for a in kv:
            x = np.asarray(a[layer % L, t0 : t0 + tokens]).reshape(tokens, -1)
            x = np.tile(x, (1, -(-cols // x.shape[1])))[:, :cols].astype(np.int16)
            parts.append(torch.from_numpy(x).view(torch.bfloat16).reshape(tokens, heads, -1))
        out.append(torch.cat(parts, -1))
    return out


@pytest.mark.gpu
def test_timed_restore_llama8b_shapes():
    """Store 64 blocks x 30 layers of Llama-8B-shaped KV (8 KV heads, head 128, block 16),
    restore them into other blocks (every tensor checked), time it beside a pinned
    host-to-device copy of the same raw bytes. Synthetic KV-like data, or real KV tiled to the
    shape when ``KVZIP_REAL_KV`` names a dump directory (``K.npy``, ``V.npy``; not in git)."""
    timed_restore(torch.device("cuda"), layers=30, blocks=64)


def timed_restore(dev, layers, blocks):
    """The timed restore's body (``dev`` CPU: a dry run of the code on small shapes)."""
    heads, n, d = 8, 16, 128
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    buf, caches = paged_caches(layers, heads, n, d, dev, "LBNHC", blocks=2 * blocks)
    kv_dir = os.environ.get("KVZIP_REAL_KV")
    if kv_dir:
        tokens = 2 * blocks * n
        for layer, x in enumerate(real_kv(kv_dir, layers, tokens, heads, d, 0)):
            caches[layer].copy_(x.reshape(2 * blocks, n, heads, 2 * d).permute(0, 2, 1, 3))
        fit = real_kv(kv_dir, layers, 512, heads, d, blocks * n)  # tokens not restored
        tables = kvzip_lossless.build_kv_tables(
            [[(x[..., :d].contiguous(), x[..., d:].contiguous()) for x in fit]]
        )
        data = (
            f"real KV ({kv_dir}: K.npy/V.npy, layer l from dump layer l mod its layers, columns "
            f"tiled to {heads}x{d}); table set fitted on 512 later tokens of the dump, not restored"
        )
    else:
        fill(caches, seed=5)
        tables = calibrated_tables(layers, heads, d, tokens=512)
        data = (
            "synthetic KV-like bf16 (per head-channel scale and offset, Gaussian noise); "
            "table set fitted on 512 other tokens of the same law"
        )
    want = [c.clone() for c in caches]
    store = BlockStore(1 << 30, tables=tables, fit_tokens=0)  # the arena: 1 GiB
    pipe = CudaTierPipeline(store, caches, n)
    try:
        # warm-up: builds the CUDA coder and compiles the kernels
        store_blocks(pipe, [(b"warm" + bytes(28), blocks)])
        pipe.start_loads([("w", b"warm" + bytes(28), blocks + 1)])
        assert pipe.wait_loads() == set()
        sync()
        t0 = time.perf_counter()
        stored, _ = store_blocks(pipe, [(key(i), i) for i in range(blocks)])
        store_s = time.perf_counter() - t0
        assert len(stored) == blocks
        runs, stage_runs, plan_runs = [], [], []
        for _ in range(3):
            buf.view(torch.int16)[:].fill_(-1)
            sync()
            t0 = time.perf_counter()
            pipe.start_loads([("r", key(i), blocks + i) for i in range(blocks)])
            t1 = time.perf_counter()
            failed = pipe.wait_loads()
            sync()
            runs.append(time.perf_counter() - t0)
            stage_runs.append(t1 - t0)
            plan_runs.append(pipe.last_host_s["plan"])
            assert failed == set()
            for i in range(blocks):
                assert_block_equal(caches, blocks + i, want, i)
        raw = blocks * layers * 2 * n * heads * d * 2
        host = torch.empty(raw, dtype=torch.uint8, pin_memory=cuda)
        dst = torch.empty(raw, dtype=torch.uint8, device=dev)
        raw_runs = []
        for _ in range(5):
            sync()
            t0 = time.perf_counter()
            dst.copy_(host, non_blocking=True)
            sync()
            raw_runs.append(time.perf_counter() - t0)
        # the public one-blob API on one block's 60 blobs, for scale
        blobs = store.get_blobs(key(0))
        out = torch.empty(n, heads, d, dtype=torch.bfloat16, device=dev)
        sync()
        t0 = time.perf_counter()
        for b in blobs:
            kvzip_lossless.decompress(b, tables=tables, out=out)
        sync()
        one_block_api_s = time.perf_counter() - t0
        entries = [store.get_entry(key(i)) for i in range(blocks)]
        compressed = sum(len(b) for bl, _, _ in entries for b in bl)
        plan_bytes = sum(plan.host_bytes + plan.tail_bytes for _, plan, _ in entries)
        pinned = all(rec.is_pinned() for _, _, rec in entries)
        work = count_host_work(pipe, [("r", key(i), blocks + i) for i in range(blocks)])
    finally:
        pipe.close()
    from kvzip_lossless import gpu

    res = {
        "what": f"kvzip-vllm CudaTierPipeline: store then restore of {blocks} blocks into other "
        "paged-cache blocks (LBNHC layout), every tensor compared bit for bit",
        "device": torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": __import__("triton").__version__,
            "kvzip_lossless": kvzip_lossless.__version__,
            "format_version": kvzip_lossless.FORMAT_VERSION,
        },
        "decode_backend": gpu.default_backend(dev),
        "shape": dict(
            blocks=blocks,
            layers=layers,
            kv_heads=heads,
            block_size=n,
            head_size=d,
            blobs=blocks * layers * 2,
        ),
        "data": data,
        "raw_bytes": raw,
        "compressed_bytes": compressed,
        "plan_bytes": plan_bytes,
        "ratio": round(raw / compressed, 4),
        "store_s": store_s,
        "restore_s_runs": runs,
        "restore_s": statistics.median(runs),
        "restore_host_staging_s": statistics.median(stage_runs),
        "restore_host_plan_s": statistics.median(plan_runs),
        "records_pinned": pinned,
        "raw_pinned_h2d_s": statistics.median(raw_runs),
        "one_block_api_decompress_s": one_block_api_s,
        "every_tensor_exact": True,
    }
    res["restore_vs_raw_copy"] = round(res["restore_s"] / res["raw_pinned_h2d_s"], 2)
    res["start_loads_work"] = work
    out_dir = os.environ.get("KVZIP_RESULTS_DIR")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "cuda_tier_restore.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(out_dir, "cuda_tier_restore.md"), "w") as f:
            f.write(_markdown(res))
    print(json.dumps(res, indent=1))


def count_host_work(pipe, loads) -> dict:
    """What one ``start_loads`` issues from the host (not timed): torch ops (views apart) and
    decode kernel launches. Bookkeeping for the report: an error here is recorded, not raised,
    so that the timings of the run are still written."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kvzip_vllm import batch_decode

    class Count(TorchDispatchMode):
        ops = views = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            self.views += bool(getattr(func, "is_view", False))
            return func(*args, **(kwargs or {}))

    launch, launches = batch_decode._launch, [0]

    def counted(*a, **k):
        launches[0] += 1
        return launch(*a, **k)

    try:
        batch_decode._launch = counted
        with Count() as c:
            pipe.start_loads(loads)
        assert pipe.wait_loads() == set()
        return {"torch_ops": c.ops, "of_which_views": c.views, "decode_launches": launches[0]}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        batch_decode._launch = launch


def _markdown(r) -> str:
    s = r["shape"]
    ms = lambda name: f"{r[name] * 1e3:.2f} ms"  # noqa: E731
    rows = [
        (
            f"restore, {s['blocks']} blocks (median of 3 runs; stage, decode, scatter)",
            ms("restore_s"),
        ),
        ("... of which host staging and launches (start_loads)", ms("restore_host_staging_s")),
        ("... ... of which the step's per-blob plan (DecodeStep)", ms("restore_host_plan_s")),
        ("... host work it issues (counted in one more run)", json.dumps(r["start_loads_work"])),
        (
            "store records page-locked (copied to the GPU from where they lie)",
            str(r["records_pinned"]),
        ),
        ("pinned host-to-device copy of the same raw bf16 bytes", ms("raw_pinned_h2d_s")),
        ("restore / raw copy", f"{r['restore_vs_raw_copy']}x"),
        ("store of those blocks (encode, plans, worker thread)", f"{r['store_s']:.3f} s"),
        (
            f"one block's {2 * s['layers']} blobs by kvzip_lossless.decompress, one by one",
            ms("one_block_api_decompress_s"),
        ),
        ("ratio (blobs only; table set not counted)", f"{r['ratio']}"),
        (
            "decode plans held (bytes per block, beside the blobs)",
            f"{r['plan_bytes'] // s['blocks']}",
        ),
    ]
    lines = [
        "# kvzip-vllm GPU tier: restore timing",
        "",
        f"{r['what']}. Device {r['device']}, {r['date']}, decode backend `{r['decode_backend']}`, "
        f"versions {r['versions']}.",
        "",
        f"Shape: {s['blocks']} blocks x {s['layers']} layers x (K, V), {s['kv_heads']} KV heads, "
        f"head {s['head_size']}, block {s['block_size']} tokens ({s['blobs']} blobs, "
        f"{r['raw_bytes'] / 1e6:.1f} MB bf16). Data: {r['data']}.",
        "",
        "| what | figure |",
        "|---|---|",
        *[f"| {a} | {b} |" for a, b in rows],
        "",
        f"Command: `{r['command']}`",
        "",
    ]
    return "\n".join(lines)
