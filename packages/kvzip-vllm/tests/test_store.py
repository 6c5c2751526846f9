"""The tier's store without vLLM: bit-exact round trips, byte budget, LRU order, damage,
the per-model table set."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvzip_lossless
from kvzip_vllm.core.store import BlockStore, block_key, namespace

LAYERS, N, H, D = 3, 32, 3, 64


def _block(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) bf16 [N, H, D], KV-like: a per-channel offset plus noise."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(LAYERS):
        base = torch.randn(1, 1, D, generator=g) * 2
        k = (base + torch.randn(N, H, D, generator=g)).to(torch.bfloat16)
        v = torch.randn(N, H, D, generator=g).to(torch.bfloat16)
        out.append((k, v))
    return out


def _outs():
    return [torch.empty(N, H, D, dtype=torch.bfloat16) for _ in range(2 * LAYERS)]


def _assert_same(outs, block, key):
    want = [t for kv in block for t in kv]
    for i, (got, w) in enumerate(zip(outs, want, strict=True)):
        diff = (got.view(torch.int16) != w.view(torch.int16)).nonzero()
        assert diff.numel() == 0, f"block {key[:1].hex()} tensor {i} differs at {diff[:5].tolist()}"


def _blob_bytes(block) -> int:
    return sum(len(kvzip_lossless.compress(t)) for kv in block for t in kv)


@pytest.mark.parametrize("fit_tokens", [0, 2 * N], ids=["embedded-tables", "fitted-set"])
def test_roundtrip_bit_exact(fit_tokens):
    store = BlockStore(64 << 20, fit_tokens=fit_tokens)
    blocks = {bytes([i]) * 32: _block(i) for i in range(4)}
    for key, block in blocks.items():
        nbytes, evicted = store.put(key, block)
        assert nbytes > 0 and evicted == []
    # with fit_tokens, blocks 0-1 embed their tables; the set is fitted from them, 2-3 use it
    assert (store.tables is not None) == bool(fit_tokens)
    for key, block in blocks.items():
        outs = _outs()
        assert store.get(key, outs)
        _assert_same(outs, block, key)
    s = store.stats
    assert s.blocks_held == 4 and s.raw_bytes_held == 4 * 2 * LAYERS * N * H * D * 2
    assert s.bytes_saved == s.raw_bytes_held - s.bytes_held
    assert store.table_sized(30)
    assert s.table_bytes == (store.tables.nbytes if fit_tokens else 0)
    assert s.table_fit_tokens == fit_tokens


def test_loaded_table_set_is_used_and_required():
    tables = kvzip_lossless.build_kv_tables([_block(10), _block(11)])
    store = BlockStore(64 << 20, tables=tables)
    key, block = b"t" * 32, _block(1)
    store.put(key, block)
    blob = store._entries[key].blobs[0]
    with pytest.raises(kvzip_lossless.CorruptBlobError, match="table set"):
        kvzip_lossless.decompress(blob)  # references the set: not decodable without it
    outs = _outs()
    assert store.get(key, outs)
    _assert_same(outs, block, key)
    assert store.table_sized(30) and store.stats.table_bytes == tables.nbytes


def test_the_table_sets_stored_size_is_taken_off_the_caller(monkeypatch):
    """Setting a fitted table set returns at once with its raw size counted; its stored
    (LZMA) size, seconds of CPU for a large set, replaces it from a thread of its own."""
    import threading

    tables = kvzip_lossless.build_kv_tables([_block(10), _block(11)])
    release = threading.Event()
    real = type(tables).to_file_bytes

    def slow(self):
        release.wait(30)
        return real(self)

    monkeypatch.setattr(type(tables), "to_file_bytes", slow)
    store = BlockStore(64 << 20, fit_tokens=0)
    store.set_tables(tables, 256)
    assert store.stats.table_bytes == len(tables.to_bytes()) and not store.table_sized(0)
    release.set()
    assert store.table_sized(30) and store.stats.table_bytes == len(real(tables))
    assert store.stats.table_bytes < len(tables.to_bytes())


def test_budget_and_lru_order():
    one = _blob_bytes(_block(0))
    store = BlockStore(int(one * 2.5), fit_tokens=0)  # room for two blocks
    a, b, c = (bytes([i]) * 32 for i in range(3))
    store.put(a, _block(0))
    store.put(b, _block(1))
    assert store.get(a, _outs())  # a is now the most recently used: b goes first
    _, evicted = store.put(c, _block(2))
    assert evicted == [b]
    assert a in store and c in store and b not in store
    assert not store.get(b, _outs())  # never served after eviction
    assert store.stats.evictions == 1 and store.stats.bytes_held <= store.budget_bytes


def test_block_larger_than_budget_is_skipped():
    store = BlockStore(100, fit_tokens=0)
    nbytes, evicted = store.put(b"k" * 32, _block(0))
    assert nbytes == 0 and evicted == [] and len(store) == 0
    assert store.stats.blocks_skipped == 1


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_entry_is_dropped_not_served(damage):
    store = BlockStore(64 << 20, fit_tokens=0)
    key, block = b"x" * 32, _block(0)
    store.put(key, block)
    blobs = list(store._entries[key].blobs)
    if damage == "flip":
        bad = bytearray(blobs[3])
        bad[len(bad) // 2] ^= 0x10
        blobs[3] = bytes(bad)
    else:
        blobs[3] = blobs[3][: len(blobs[3]) // 2]
    store._entries[key].blobs = tuple(blobs)
    outs = [torch.zeros(N, H, D, dtype=torch.bfloat16) for _ in range(2 * LAYERS)]
    assert not store.get(key, outs) and key not in store
    assert all(int(o.view(torch.int16).abs().sum()) == 0 for o in outs), "wrote before checking"


def test_keys_depend_on_model_layout_and_prefix():
    ns = dict(model="m", layout="per-layer-block", block_size=128, dtype="torch.bfloat16")
    base = block_key(namespace(**ns), b"h1")
    assert base == block_key(namespace(**ns), b"h1")
    assert base != block_key(namespace(**ns), b"h2")
    for field, other in (
        ("model", "m2"),
        ("block_size", 64),
        ("dtype", "torch.float16"),
        ("tp_world", 2),
    ):
        assert base != block_key(namespace(**{**ns, field: other}), b"h1"), field
    assert f"kvzip_lossless/{kvzip_lossless.FORMAT_VERSION}".encode() in namespace(**ns)


def test_bad_budget_rejected():
    with pytest.raises(ValueError, match="budget_bytes"):
        BlockStore(0)


def test_entries_lie_in_one_arena_allocated_once_and_charged_as_used():
    import kvzip_vllm.core.store as st

    store = BlockStore(8 << 20, fit_tokens=0)
    arena, ptr = store.arena, store.arena.buf.data_ptr()
    assert arena.capacity <= store.budget_bytes and store.stats.arena_bytes == arena.capacity
    sizes = []
    for i in range(6):
        key, block = bytes([i]) * 32, _block(i)
        nbytes, _ = store.put(key, block)
        rec = st.record_bytes(store.get_blobs(key))
        # the aligned extent the record takes in the arena, nothing more
        assert nbytes == -(-rec // st.RECORD_ALIGN) * st.RECORD_ALIGN
        sizes.append(nbytes)
        e = store._entries[key]
        blob = np.asarray(e.blobs[0])
        assert blob.ctypes.data == ptr + e.off  # the blob lies in the arena, not a copy
    assert store.stats.bytes_held == sum(sizes) == arena.used
    assert store.stats.peak_bytes_held == sum(sizes)
    assert store.arena.buf.data_ptr() == ptr  # never reallocated
    store.drop(bytes([2]) * 32)
    assert store.stats.bytes_held == arena.used == sum(sizes) - sizes[2]
    store.clear()
    assert arena.used == 0 and arena.largest_free() == arena.capacity  # holes coalesced


def test_eviction_makes_a_contiguous_hole_and_never_exceeds_the_budget():
    one = BlockStore(64 << 20, fit_tokens=0).put(b"a" * 32, _block(0))[0]
    store = BlockStore(int(one * 3.5), fit_tokens=0)  # three records fit, a fourth evicts
    keys = [bytes([i]) * 32 for i in range(12)]
    for i, key in enumerate(keys):
        if i % 3 == 2:
            assert store.get(keys[i - 2], _outs())  # reorders LRU: holes are not in a row
        nbytes, evicted = store.put(key, _block(i))
        assert nbytes > 0
        s = store.stats
        assert s.bytes_held <= store.budget_bytes and store.arena.used <= store.arena.capacity
        for k in evicted:
            assert k not in store and not store.get(k, _outs())
    for key in store.keys():
        i = keys.index(key)
        outs = _outs()
        assert store.get(key, outs)
        _assert_same(outs, _block(i), key)


def test_a_leased_record_is_not_overwritten_until_released():
    one = BlockStore(64 << 20, fit_tokens=0).put(b"a" * 32, _block(0))[0]
    store = BlockStore(int(one * 1.5), fit_tokens=0)  # room for one record
    a, b = b"a" * 32, b"b" * 32
    store.put(a, _block(0))
    entry = store.lease(a)  # a load copying from it
    before = bytes(store.record(entry).numpy())
    nbytes, evicted = store.put(b, _block(1))  # evicts a, but its extent is still read
    assert evicted == [a] and nbytes == 0 and store.stats.blocks_skipped == 1
    assert bytes(store.record(entry).numpy()) == before
    store.unlease([entry])
    assert store.arena.used == 0
    assert store.put(b, _block(1))[0] > 0  # the extent is free again


def test_pinning_registers_the_arena_or_says_it_did_not(monkeypatch):
    import kvzip_vllm.core.store as st

    calls = []
    monkeypatch.setattr(st, "_host_register", lambda t: calls.append(t.numel()) or True)
    store = BlockStore(1 << 20, fit_tokens=0)
    assert store.pin() and store.stats.arena_pinned and calls == [store.arena.capacity]
    assert store.pin() and len(calls) == 1  # once
    monkeypatch.setattr(st, "_host_register", lambda t: False)
    other = BlockStore(1 << 20, fit_tokens=0)
    assert not other.pin() and not other.stats.arena_pinned


@pytest.mark.parametrize("tokens", [2 * N, 256])
def test_a_chunk_of_several_blocks_round_trips(tokens):
    g = torch.Generator().manual_seed(tokens)
    chunk = [
        tuple(torch.randn(tokens, H, D, generator=g).bfloat16() for _ in range(2))
        for _ in range(LAYERS)
    ]
    store = BlockStore(64 << 20, fit_tokens=0)
    store.put(b"c" * 32, chunk)
    outs = [torch.empty(tokens, H, D, dtype=torch.bfloat16) for _ in range(2 * LAYERS)]
    assert store.get(b"c" * 32, outs)
    _assert_same(outs, chunk, b"c")
    assert not store.get(b"c" * 32, _outs())  # a block-shaped buffer: refused, dropped


def test_chunk_tokens_must_be_a_multiple_of_the_block_size():
    from kvzip_vllm.settings import ConnectorSettingsError, blocks_per_chunk

    assert blocks_per_chunk(256, 16) == 16 and blocks_per_chunk(32, 32) == 1
    with pytest.raises(ConnectorSettingsError, match=r"chunk_tokens=100 .* block size 16"):
        blocks_per_chunk(100, 16)
    with pytest.raises(ConnectorSettingsError, match="multiple"):
        blocks_per_chunk(16, 32)
