"""A tier reset followed by stores of equal keys in the same step (issue 29, case 3).

``POST /reset_prefix_cache?reset_external=true`` (``LLM.reset_prefix_cache(
reset_connector=True)``) empties vLLM's prefix cache and the tier; the next step carries the
clear to the worker, which empties its store before that step's stores. A prompt computed
again in that step stores its chunks under the keys they had before the reset: the
scheduler's view of what the worker holds must equal the worker's, so a later request
restores them. The real scheduler and worker halves, the steps fed by hand.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the tier's halves import vllm (extra 'cpu')")

from test_connector_units import BS, _caches, _sched_out, _vllm_config, _worker  # noqa: E402
from tier_steps import finish_loads  # noqa: E402

# every test under both load designs (conftest.load_mode)
pytestmark = pytest.mark.usefixtures("load_mode")

CHUNKS = 4


def _tier():
    from kvzip_vllm.tier.scheduler import KvzipScheduler

    sched = KvzipScheduler(_vllm_config(), None, b"ns")
    w = _worker()
    w.register_kv_caches(_caches())
    return sched, w


def _step(sched, w, so):
    """One step: the scheduler's plan, the worker's loads and stores, its report taken in."""
    meta = sched.build_connector_meta(so)
    w.start_load_kv(meta)
    finish_loads(w)  # (asynchronous: vLLM schedules the request once get_finished says so)
    w.wait_for_save(meta)
    assert w._background.drain(60)  # stores coded in the background: reported this step
    assert w.get_block_ids_with_load_errors() == set()
    report = w.build_connector_worker_meta()
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=report))
    return meta, report


def _request(req_id: str, hashes: list[bytes]):
    return SimpleNamespace(request_id=req_id, block_hashes=hashes, num_tokens=CHUNKS * BS + 1)


def _prefill(sched, w, req, first_block: int):
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # nothing held: computed
    ids = list(range(first_block, first_block + CHUNKS + 1))
    new = SimpleNamespace(req_id=req.request_id, block_ids=(ids,), num_computed_tokens=0)
    return _step(sched, w, _sched_out(new=[new], n={req.request_id: CHUNKS * BS + 1}))


def test_stores_of_equal_keys_in_the_reset_step_stay_held():
    sched, w = _tier()
    hashes = [bytes([i]) * 8 for i in range(CHUNKS)]
    first = _request("a", hashes)
    _prefill(sched, w, first, 0)
    keys = sched.keys_of(first)
    assert [sched.held(k) for k in keys] == [True] * CHUNKS
    sched.request_finished(first, [])
    assert sched.reset_cache()  # the tier's part of POST /reset_prefix_cache
    assert [sched.held(k) for k in keys] == [False] * CHUNKS
    # the same prompt, in the step that carries the clear: computed in full, stored again
    meta, report = _prefill(sched, w, _request("b", hashes), 5)
    assert meta.clear and [s.key for s in meta.stores] == keys
    assert report.stored == keys and [k in w.store for k in keys] == [True] * CHUNKS
    assert [sched.held(k) for k in keys] == [True] * CHUNKS  # the scheduler agrees
    assert report.cleared and not report.dropped  # the clear, not every key, is reported
    # a later request with that prefix is restored from the tier: every whole chunk but the
    # one holding its last token
    later = _request("c", hashes)
    sched.on_new_request(later)
    assert sched.get_num_new_matched_tokens(later, 0) == (CHUNKS * BS, True)


def test_a_store_reported_after_the_reset_from_before_the_clear_is_not_counted():
    """A report of stores that ran before the worker's clear can reach the scheduler after
    ``reset_cache`` (asynchronous stores): the clear undoes it."""
    from kvzip_vllm.tier.metadata import KvzipWorkerMetadata

    sched, w = _tier()
    early = bytes([9]) * 32
    sched.reset_cache()
    sched.update_connector_output(
        SimpleNamespace(kv_connector_worker_meta=KvzipWorkerMetadata(stored=[early], seq=1))
    )
    assert sched.held(early)  # as reported; the worker's clear has not run yet
    hashes = [bytes([i]) * 8 for i in range(CHUNKS)]
    req = _request("a", hashes)
    _prefill(sched, w, req, 0)
    assert not sched.held(early) and early not in w.store
    assert [sched.held(k) for k in sched.keys_of(req)] == [k in w.store for k in sched.keys_of(req)]


def test_with_tensor_parallelism_a_key_stored_by_every_rank_after_their_clear_is_held():
    from kvzip_vllm.tier.metadata import KvzipWorkerMetadata
    from kvzip_vllm.tier.scheduler import KvzipScheduler

    cfg = _vllm_config()
    cfg.parallel_config.tensor_parallel_size = 2
    sched = KvzipScheduler(cfg, None, b"ns")
    old, new = bytes([1]) * 32, bytes([2]) * 32

    def report(rank, **kw):
        return KvzipWorkerMetadata(rank=rank, seq=1, **kw)

    both = report(0, stored=[old]).aggregate(report(1, stored=[old]))
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=both))
    assert sched.held(old)
    sched.reset_cache()
    both = report(0, cleared=True, stored=[old, new]).aggregate(
        report(1, cleared=True, stored=[new])
    )
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=both))
    # rank 1 did not store ``old`` again after its clear: not held by every rank
    assert sched.held(new) and not sched.held(old)


def test_through_vllms_scheduler_a_prompt_after_the_reset_is_restored():
    """The sequence of the issue under vLLM's own ``Scheduler`` (``sched_harness.py``): a
    prompt stored, ``reset_prefix_cache(reset_connector=True)``, the same prompt computed
    again (its chunks stored in the step that carries the clear), then a third time: every
    chunk held by the worker is counted held by the scheduler and restored, bit for bit."""
    import random

    import sched_harness as H

    h = H.Harness(async_scheduling=False).build()
    rng = random.Random(1)
    prompt = [rng.randrange(H.VOCAB) for _ in range(4 * H.CHUNK + 8)]
    h.add("a", prompt, 2)
    h.run()
    assert h.scheduler.reset_prefix_cache(reset_connector=True)
    h.add("b", prompt, 2)
    h.run()
    tier = h.scheduler.connector.scheduler
    keys = tier.keys_of(h.requests["b"])
    assert [k in h.worker.store for k in keys] == [True] * 4
    assert [tier.held(k) for k in keys] == [True] * 4
    h.scheduler.reset_prefix_cache()  # vLLM's own cache only
    h.add("c", prompt, 2)
    h.run()
    assert sorted(r.pos for r in h.records if r.kind == "load" and r.req_id == "c") == [0, 1, 2, 3]
    assert h.wrong_records() == []
    assert list(h.requests["c"].output_token_ids) == H.greedy(prompt, 2)


def test_chunks_whose_stores_are_not_yet_reported_count_as_held():
    """The GPU pipeline reports a step's stores with a later step, and an idle server takes
    none: a prompt returning before that report must still find its chunks (the worker's load
    waits for a store in flight: test_cuda_pipeline). Until the report, they count; a store
    reported dropped is forgotten."""
    from kvzip_vllm.tier.metadata import KvzipWorkerMetadata

    sched, _ = _tier()
    hashes = [bytes([i]) * 8 for i in range(CHUNKS)]
    first = _request("a", hashes)
    sched.on_new_request(first)
    assert sched.get_num_new_matched_tokens(first, 0) == (0, False)
    new = SimpleNamespace(req_id="a", block_ids=(list(range(CHUNKS + 1)),), num_computed_tokens=0)
    meta = sched.build_connector_meta(_sched_out(new=[new], n={"a": CHUNKS * BS + 1}))
    keys = sched.keys_of(first)
    assert [s.key for s in meta.stores] == keys
    sched.request_finished(first, [])
    # the step ran; its stores are still being coded, so the worker reports none of them
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=None))
    assert [sched.held(k) for k in keys] == [False] * CHUNKS
    back = _request("b", hashes)
    sched.on_new_request(back)
    assert sched.get_num_new_matched_tokens(back, 0) == (CHUNKS * BS, True)
    # the worker then reports the last chunk dropped (its store failed): the match stops there
    report = KvzipWorkerMetadata(stored=keys[:-1], dropped=keys[-1:], seq=1)
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=report))
    again = _request("c", hashes)
    sched.on_new_request(again)
    assert sched.get_num_new_matched_tokens(again, 0) == ((CHUNKS - 1) * BS, True)
