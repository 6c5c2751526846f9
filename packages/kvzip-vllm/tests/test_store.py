"""The tier's store without vLLM: bit-exact round trips, byte budget, LRU order, damage."""

from __future__ import annotations

import pytest
import torch

import kvzip_lossless
from kvzip_vllm.store import BlockStore, block_key, namespace


def _block(seed: int, layers: int = 3, heads: int = 3, n: int = 32, d: int = 64):
    g = torch.Generator().manual_seed(seed)
    # KV-like: a per-channel offset plus noise, bf16
    base = torch.randn(1, 1, 1, d, generator=g) * 2
    k = (base + torch.randn(layers, heads, n, d, generator=g)).to(torch.bfloat16)
    v = torch.randn(layers, heads, n, d, generator=g).to(torch.bfloat16)
    return [k, v]


def test_roundtrip_bit_exact():
    store = BlockStore(64 << 20)
    blocks = {bytes([i]) * 32: _block(i) for i in range(3)}
    for key, tensors in blocks.items():
        nbytes, evicted = store.put(key, tensors)
        assert nbytes > 0 and evicted == []
    for key, (k, v) in blocks.items():
        outs = [torch.empty_like(k), torch.empty_like(v)]
        assert store.get(key, outs)
        for got, want in zip(outs, (k, v), strict=True):
            diff = (got.view(torch.int16) != want.view(torch.int16)).nonzero()
            assert diff.numel() == 0, f"block {key[:1].hex()} differs at {diff[:5].tolist()}"
    s = store.stats
    assert s.blocks_held == 3 and s.raw_bytes_held == 3 * 2 * _block(0)[0].numel() * 2
    assert s.bytes_saved == s.raw_bytes_held - s.bytes_held


def test_budget_and_lru_order():
    one = sum(len(kvzip_lossless.compress(t)) for t in _block(0))
    store = BlockStore(int(one * 2.5))  # room for two blocks
    a, b, c = (bytes([i]) * 32 for i in range(3))
    store.put(a, _block(0))
    store.put(b, _block(1))
    outs = [torch.empty_like(t) for t in _block(0)]
    assert store.get(a, outs)  # a is now the most recently used: b goes first
    _, evicted = store.put(c, _block(2))
    assert evicted == [b]
    assert a in store and c in store and b not in store
    assert not store.get(b, outs)  # never served after eviction
    assert store.stats.evictions == 1 and store.stats.bytes_held <= store.budget_bytes


def test_block_larger_than_budget_is_skipped():
    store = BlockStore(100)
    nbytes, evicted = store.put(b"k" * 32, _block(0))
    assert nbytes == 0 and evicted == [] and len(store) == 0
    assert store.stats.blocks_skipped == 1


def test_damaged_entry_is_dropped_not_served():
    store = BlockStore(64 << 20)
    key = b"x" * 32
    k, v = _block(0)
    store.put(key, [k, v])
    blobs = store._entries[key].blobs
    bad = bytearray(blobs[0])
    bad[len(bad) // 2] ^= 0xFF
    store._entries[key].blobs = (bytes(bad), blobs[1])
    outs = [torch.zeros_like(k), torch.zeros_like(v)]
    assert not store.get(key, outs)
    assert key not in store


def test_keys_depend_on_model_layout_and_prefix():
    ns = dict(model="m", layout="per-layer-block", block_size=128, dtype="torch.bfloat16")
    base = block_key(namespace(**ns), b"h1")
    assert base == block_key(namespace(**ns), b"h1")
    assert base != block_key(namespace(**ns), b"h2")
    for field, other in (("model", "m2"), ("block_size", 64), ("dtype", "torch.float16")):
        assert base != block_key(namespace(**{**ns, field: other}), b"h1"), field
    assert f"kvzip_lossless/{kvzip_lossless.FORMAT_VERSION}".encode() in namespace(**ns)


def test_bad_budget_rejected():
    with pytest.raises(ValueError, match="budget_bytes"):
        BlockStore(0)
