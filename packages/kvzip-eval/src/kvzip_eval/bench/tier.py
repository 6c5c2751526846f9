"""``kvzip bench tier``: kvzip's lossless tier beside vLLM's own CPU offloading and recompute,
with the same CPU bytes and the same traffic.

One engine per connector, each in its own process (the GPU is freed between them):

- ``offload``: vLLM's ``OffloadingConnector`` as a user gets it from ``--kv-offloading-size``
  (``kv_offloading_size=GiB, kv_offloading_backend="native"``: raw pages in CPU memory, LRU);
- ``kvzip``: ``KvzipConnector`` with ``budget_bytes`` the same bytes, its worker wrapped by the
  bit-exactness checker (:mod:`kvzip_eval.bench.checker`: every block it restores is compared,
  byte for byte, with a device copy of the block it was asked to store);
- ``none``: no connector (a returning prompt is recomputed).

Every engine runs with vLLM's defaults (``--eager`` / ``--no-async-scheduling`` to change
them), prefix caching on and a small GPU KV cache (the longest prompt plus
``--gpu-slack-tokens``), so that a returning prompt must come from the CPU tier; vLLM's local
prefix cache is also emptied before every batch of returning prompts.

The prompts: ``--prompts FILE.jsonl`` (one ``{"prompt": TEXT}`` or ``{"prompt_token_ids":
[...]}`` per line; grouped by the power of two at or above their length), else a synthetic
workload per context C: pairs of prompts sharing their first C/2 tokens and prompts of their
own, each ``C - 255`` random tokens (whole 256-token chunks and the token vLLM always
computes). First pass: every prompt once (shuffled, in batches of ``--concurrency``), the tiers
store it; then ``--repeats`` passes of returning prompts, ``max_tokens=1``; then each context's
first ``ALONE`` prompts once more, one at a time (the restore without queueing). Two workloads, one
row each: ``restore``, CPU bytes for which the raw pages of the prompts are 0.75x the bytes
(both tiers hold them all: restore against restore), and ``capacity``, 1.3x (more than a raw
tier holds).

Reported per workload, context and connector: time to first token of the returning prompts
(vLLM's ``first_token_latency``, arrival to first token) p50, p90 and mean, and alone; the hit rate
(tokens not recomputed, vLLM's ``num_cached_tokens``, over the prompt less its last token);
tokens held by the tier after the first pass over the CPU bytes they take; stores dropped;
bit-exactness of every block kvzip restored (and the tier's own checksum failures); the first
token against the recompute engine's.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvzip_eval.bench import engines, output
from kvzip_eval.bench.connectors import file_label, parse_connector
from kvzip_eval.bench.stats import percentile

CHUNK = 256  # the kvzip tier's chunk (tokens)
#: the synthetic workload per context: (pairs sharing half their prompt, prompts of their own)
PLANS = {8192: (2, 4), 32768: (1, 2), 131072: (1, 0)}
DEFAULT_GROUPS = (1, 1)
#: the tier's counters that say where a run's time went (the markdown's table of them):
#: restores (all, the host's part, asynchronous jobs and those run as one pass with the one
#: before) and stores (the store thread's busy time, of it coding and copying; steps waiting);
#: steps with nothing to compute that rested in vLLM's poll while restores ran (idle_wait_s)
TIME_KEYS = ("restore_seconds", "load_host_seconds", "load_jobs_async", "load_jobs_merged",
             "store_busy_seconds", "store_encode_seconds", "store_copy_seconds",
             "store_wait_seconds", "idle_waits", "idle_waits_ended_by_load",
             "idle_wait_seconds")  # fmt: skip
#: ... and where the host's part of those went: the load thread's CPU time in it (far below
#: load_host_seconds: the thread waited, for the GIL or a lock, rather than worked), the
#: restores' lookups, offsets, device buffers, decode preparation and launches; the stores'
#: bringing back of spilled chunks and their last synchronisation; the device allocations
#: retried after freeing torch's cache (each synchronises the device)
HOST_KEYS = ("load_host_cpu_seconds", "load_lookup_seconds", "load_plan_seconds",
             "load_alloc_seconds", "load_prepare_seconds", "load_launch_seconds",
             "store_unspill_seconds", "store_sync_seconds", "store_fit_seconds",
             "store_code_seconds",
             "store_thread_cpu_seconds", "cuda_alloc_retries")  # fmt: skip
#: prompts of each context that return once more alone after the passes (``ttft_alone_s``)
ALONE = 2
#: workload -> the prompts' raw pages over the CPU bytes
WORKLOADS = {"restore": 0.75, "capacity": 1.3}


class WorkloadError(ValueError):
    pass


# ------------------------------------------------------------------ workload (no vLLM)
def prompt_tokens(context: int) -> int:
    """Tokens of a prompt at ``context``: whole chunks plus the token vLLM always computes."""
    if context < 2 * CHUNK or context % CHUNK:
        raise WorkloadError(
            f"context {context}: supported are multiples of {CHUNK} tokens, at least {2 * CHUNK}"
        )
    return context - CHUNK + 1


@dataclass(frozen=True)
class Prompt:
    name: str
    context: int
    kind: str  # "shared" (one of a pair sharing its first context/2 tokens), "unshared", "user"
    tokens: tuple[int, ...]


def build_workload(plan: dict[int, tuple[int, int]], vocab: int, seed: int = 0) -> list[Prompt]:
    """The prompts of ``plan`` ({context: (pairs, unshared)}), deterministic in ``seed``."""
    if vocab < 100:
        raise WorkloadError(f"vocab {vocab}: too small for random prompts (at least 100)")
    rng = random.Random(seed)
    out: list[Prompt] = []

    def draw(n: int) -> list[int]:
        return [rng.randrange(10, vocab - 10) for _ in range(n)]

    for ctx in sorted(plan):
        pairs, unshared = plan[ctx]
        if pairs < 0 or unshared < 0 or pairs + unshared == 0:
            raise WorkloadError(f"context {ctx}: plan {plan[ctx]} has no prompt")
        n, half = prompt_tokens(ctx), ctx // 2
        for p in range(pairs):
            prefix = draw(half)
            for s in "ab":
                out.append(Prompt(f"{ctx}-pair{p}{s}", ctx, "shared", (*prefix, *draw(n - half))))
        for u in range(unshared):
            out.append(Prompt(f"{ctx}-own{u}", ctx, "unshared", tuple(draw(n))))
    return out


def read_prompts(path: str, tokenizer_dir: str | None, max_tokens: int) -> list[Prompt]:
    """The user's prompts (JSONL: ``prompt`` text or ``prompt_token_ids``), each in the group of
    the power of two at or above its length; longer than ``max_tokens``: refused."""
    tok = None
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        d = json.loads(line)
        ids = d.get("prompt_token_ids")
        if ids is None:
            if "prompt" not in d:
                raise WorkloadError(f"{path}:{i + 1}: no 'prompt' or 'prompt_token_ids'")
            if tok is None:
                if tokenizer_dir is None:
                    raise WorkloadError("text prompts need --model (its tokenizer)")
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(tokenizer_dir)
            ids = tok(d["prompt"])["input_ids"]
        if not 2 <= len(ids) <= max_tokens:
            raise WorkloadError(f"{path}:{i + 1}: {len(ids)} tokens; supported 2 to {max_tokens}")
        ctx = 1 << (len(ids) - 1).bit_length()
        out.append(Prompt(d.get("name", f"user{i}"), ctx, "user", tuple(int(t) for t in ids)))
    if not out:
        raise WorkloadError(f"{path}: no prompts")
    return out


def distinct_tokens(prompts: list[Prompt], block: int) -> int:
    """Tokens in distinct whole blocks (a block is its whole prefix, as in vLLM's hashes):
    what a tier holding every prompt's pages once would hold."""
    seen: set[bytes] = set()
    for p in prompts:
        h = hashlib.sha256()
        for i in range(len(p.tokens) // block):
            h.update(str(p.tokens[i * block : (i + 1) * block]).encode())
            seen.add(h.copy().digest())
    return len(seen) * block


def cpu_bytes_for(working_set_bytes: int, ratio: float) -> int:
    """The CPU bytes for which the working set is ``ratio`` times the raw capacity."""
    if ratio <= 0:
        raise WorkloadError(f"working-set ratio {ratio}: must be > 0")
    return int(working_set_bytes / ratio)


def passes(n: int, repeats: int, seed: int) -> list[list[int]]:
    """The returning passes: each a shuffled order of the ``n`` prompts (seeded)."""
    rng = random.Random(seed + 1)
    out = []
    for _ in range(repeats):
        order = list(range(n))
        rng.shuffle(order)
        out.append(order)
    return out


def batches(order: list[int], size: int) -> list[list[int]]:
    if size < 1:
        raise WorkloadError(f"concurrency {size}: must be >= 1")
    return [order[i : i + size] for i in range(0, len(order), size)]


# ------------------------------------------------------------------ rows (no vLLM)
def _r(x, nd=4):
    return None if x is None else round(x, nd)


def build_rows(engs: list[dict]) -> list[dict]:
    """Rows per (workload, context, connector) plus a ``context: "all"`` row per engine (every
    returning request), from the engines' results (:func:`child`); the recompute engine's
    rows are repeated under each workload. Ratios against offload's row of the same
    workload and context: ``ttft_p50_vs_offload``, ``ttft_mean_vs_offload``,
    ``tokens_per_byte_vs_offload``."""
    done = [e for e in engs if "returns" in e]
    none = next((e for e in done if e["connector"] == "none"), None)
    ref = {(q["prompt"], q["pass"]): q for q in (none or {}).get("returns", [])}
    workloads = list(dict.fromkeys(e["workload"] for e in engs if e["connector"] != "none"))
    rows = []
    for e in done:
        tier = e.get("tier", {})
        for w in [e["workload"]] if e["connector"] != "none" else workloads or ["-"]:
            groups: dict = {}
            alone: dict = {}
            for q in e["returns"]:
                (alone if q["pass"] == "alone" else groups).setdefault(q["context"], []).append(q)
            groups["all"] = [q for q in e["returns"] if q["pass"] != "alone"]
            for ctx, qs in groups.items():
                ttft = [q["ttft_s"] for q in qs]
                lone = [q["ttft_s"] for q in alone.get(ctx, [])]
                skippable = sum(q["tokens"] - 1 for q in qs)
                cached = sum(q["cached_tokens"] or 0 for q in qs)
                same = [q["first_token"] == ref[(q["prompt"], q["pass"])]["first_token"]
                        for q in qs if (q["prompt"], q["pass"]) in ref]  # fmt: skip
                rows.append({
                    "workload": w,
                    "context": ctx,
                    "connector": e["connector"],
                    "n": len(qs),
                    "ttft_p50_s": _r(percentile(ttft, 50)),
                    "ttft_p90_s": _r(percentile(ttft, 90)),
                    "ttft_mean_s": _r(sum(ttft) / len(ttft)) if ttft else None,
                    "ttft_alone_s": _r(percentile(lone, 50)) if lone else None,
                    "hit_rate": _r(cached / skippable) if skippable else None,
                    "cpu_bytes": e["cpu_bytes"],
                    "tokens_held": tier.get("tokens_held", 0),
                    "tier_bytes_used": tier.get("bytes_used", 0),
                    "tokens_per_cpu_byte": tier.get("tokens_per_byte_used"),
                    "stores_dropped": tier.get("stores_dropped"),
                    "load_errors": tier.get("load_errors"),
                    "bit_exact": tier.get("bit_exact"),
                    "first_token_equal_none": (sum(same) / len(same))
                    if same and e["connector"] != "none" else None,
                })  # fmt: skip
    for r in rows:
        off = next((o for o in rows if o["connector"] == "offload" and o["workload"] ==
                    r["workload"] and o["context"] == r["context"]), None)  # fmt: skip
        for k, name in (("ttft_p50_s", "ttft_p50_vs_offload"),
                        ("ttft_mean_s", "ttft_mean_vs_offload"),
                        ("ttft_alone_s", "ttft_alone_vs_offload"),
                        ("tokens_per_cpu_byte", "tokens_per_byte_vs_offload")):  # fmt: skip
            r[name] = _r(r[k] / off[k], 3) if off and r.get(k) and off.get(k) else None
    return rows


# ------------------------------------------------------------------ one engine (child)
def _metric_sums(llm) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 (a vLLM without the in-memory reader: no metrics)
        return out
    for m in metrics:
        v = getattr(m, "value", None)
        if isinstance(v, (int, float)):
            name = m.name.removesuffix("_total")
            out[name] = out.get(name, 0) + v
    return out


def _offload_held(llm, bpt: int, block: int) -> dict:
    """Blocks vLLM's offloading manager holds (its scheduler half, in this process)."""
    try:
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        mgr = sched.connector.connector_scheduler.manager
        keys = mgr._num_allocated_blocks - len(mgr._free_list)
        extra = sched.vllm_config.kv_transfer_config.kv_connector_extra_config
        per_key = block * int(extra.get("blocks_per_chunk", 1))
        return {
            "keys_held": keys,
            "tokens_held": keys * per_key,
            "bytes_used": keys * per_key * bpt,
            "capacity_tokens": mgr._num_blocks * per_key,
        }
    except (AttributeError, TypeError) as e:  # fmt: skip
        return {"error": f"offloading manager not readable: {e!r}"}


def child(spec: dict) -> None:
    """One engine: warm-up, first pass, drain, returning passes; the result a record."""
    import torch
    from vllm import SamplingParams

    conn, extra = parse_connector(spec["connector"])
    root = Path(tempfile.mkdtemp(prefix=f"kvzip-bench-tier-{file_label(spec['connector'])}-"))
    stats = root / "tier-stats.json"
    prompts = [Prompt(p[0], p[1], p[2], tuple(p[3])) for p in spec["prompts"]]
    longest = max(len(p.tokens) for p in prompts)
    cuda = torch.cuda.is_available()
    kw: dict = dict(spec["engine_args"])
    if conn == "kvzip":
        kw["kv_transfer_config"] = {
            "kv_connector": "KvzipConnector" if spec["no_check"] else "CheckingKvzipConnector",
            "kv_connector_module_path": "kvzip_vllm.connector" if spec["no_check"]
            else "kvzip_eval.bench.checker",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"budget_bytes": spec["cpu_bytes"],
                                          "stats_path": str(stats), "chunk_tokens": CHUNK,
                                          **extra},
        }  # fmt: skip
    elif conn == "offload":  # what `--kv-offloading-size GiB` gives
        kw["kv_offloading_size"] = spec["cpu_bytes"] / (1 << 30)
        kw["kv_offloading_backend"] = "native"
    block = spec["block_size"]
    gpu_blocks = math.ceil((longest + spec["gpu_slack_tokens"]) / block)
    if cuda:
        kw["gpu_memory_utilization"] = spec["gpu_memory_utilization"]
    else:
        kw["kv_cache_memory_bytes"] = max(
            spec["kv_cache_bytes"], 2 * gpu_blocks * block * spec["bpt"]
        )
    llm, res = engines.start_engine(
        spec,
        block_size=block,
        max_model_len=min(longest + 16, spec["max_positions"]),
        max_num_seqs=max(8, spec["concurrency"]),
        num_gpu_blocks_override=gpu_blocks,
        enable_prefix_caching=True,
        disable_log_stats=False,
        **kw,
    )

    def gen(ps: list[Prompt]) -> list[dict]:
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False,
                            logprobs=5)  # fmt: skip
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": list(p.tokens)} for p in ps], sp,
                            use_tqdm=False)  # fmt: skip
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
        rows = []
        for p, o in zip(ps, outs, strict=True):
            m = getattr(o, "metrics", None)
            ftl = getattr(m, "first_token_latency", 0.0) if m is not None else 0.0
            tok = o.outputs[0].token_ids[0]
            lps = o.outputs[0].logprobs
            lp = lps[0].get(tok) if lps else None
            rows.append({
                "prompt": p.name, "context": p.context, "kind": p.kind, "tokens": len(p.tokens),
                "ttft_s": round(ftl if ftl and ftl > 0 else wall, 5),
                "ttft_source": "first_token_latency" if ftl and ftl > 0 else "batch_wall",
                "batch_wall_s": round(wall, 5), "cached_tokens": o.num_cached_tokens,
                "first_token": tok, "logprob": getattr(lp, "logprob", None),
            })  # fmt: skip
        return rows

    worker = None
    if conn == "kvzip":  # the worker half, in this process
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group().worker

    def tier_stats() -> dict:
        """kvzip's counters now: the worker's own where it runs in this process (its stats
        file is rewritten only when a step reports a change, so it can lag the counters),
        else its stats file."""
        if worker is not None:
            return json.loads(json.dumps(worker.stats()))
        try:
            return json.loads(stats.read_text()) if conn == "kvzip" else {}
        except (OSError, json.JSONDecodeError):
            return {}

    def drain(min_s: float) -> float:
        """The tier's stores in flight finished (the engine is idle between generates), then
        short steps that carry the workers' store reports to the scheduler until kvzip's
        counters stay still over three polls, ``min_s`` at least."""
        t = time.perf_counter()
        last, still = None, 0
        while time.perf_counter() - t < spec["drain_s"]:
            if worker is not None and worker.tier is not None:
                worker.tier.drain()
            gen([warm_short])
            time.sleep(0.25)
            s = tier_stats()
            now = (s.get("blocks_stored"), s.get("spill_bytes_held"), s.get("blocks_held"))
            still = still + 1 if now == last else 0
            last = now
            if time.perf_counter() - t >= min_s and still >= 2 and not s.get("spill_bytes_held"):
                break
        return round(time.perf_counter() - t, 2)

    rng = random.Random(spec["seed"] + 99)
    vocab = spec["vocab"]
    warm_short = Prompt("warm-short", 0, "warm", tuple(rng.randrange(10, 99) for _ in range(64)))
    warm_long = Prompt(
        "warm-long",
        0,
        "warm",
        tuple(rng.randrange(10, vocab - 10) for _ in range(min(4097, longest))),
    )
    # warm-up: a prompt stored, then restored (the tiers' first load builds their paths); then
    # both tiers emptied, so the workload starts from an empty tier
    gen([warm_short])
    gen([warm_long])
    drain(1.0)
    llm.reset_prefix_cache()
    res["warm_restore"] = gen([warm_long])[0]
    res["tier_reset"] = llm.reset_prefix_cache(reset_connector=True)
    gen([warm_short])  # the step that carries the tier's clear to its worker
    s0, m0 = tier_stats(), _metric_sums(llm)
    engines.emit("warm")
    order = list(range(len(prompts)))
    random.Random(spec["seed"] + 7).shuffle(order)
    t = time.perf_counter()
    for b in batches(order, spec["concurrency"]):
        gen([prompts[i] for i in b])
        engines.emit("batch")
    res["first_pass_s"] = round(time.perf_counter() - t, 2)
    res["drain_s"] = drain(2.0)
    s1, m1 = tier_stats(), _metric_sums(llm)
    bpt = spec["bpt"]
    held = (
        _offload_held(llm, bpt, block) if conn == "offload"
        else {"tokens_held": s1.get("raw_bytes_held", 0) // bpt,
              "bytes_used": s1.get("bytes_held", 0) + s1.get("table_bytes", 0)}
        if conn == "kvzip" else {"tokens_held": 0, "bytes_used": 0}
    )  # fmt: skip
    returns = []
    resets_refused = 0  # vLLM refuses while blocks are in use: local hits possible then
    t = time.perf_counter()
    for i, order in enumerate(passes(len(prompts), spec["repeats"], spec["seed"])):
        for b in batches(order, spec["concurrency"]):
            resets_refused += llm.reset_prefix_cache() is False  # the returns from the tier
            returns += [{**q, "pass": i} for q in gen([prompts[j] for j in b])]
            engines.emit("batch")
    # each context's first ALONE prompts once more, each returning with nothing beside it:
    # the restore's own time, without the queueing of a batch (vLLM's cache holds few long
    # prompts at once)
    # (timed without the checker's work: its restores were checked in the passes above)
    checking = conn == "kvzip" and not spec["no_check"]
    if checking:
        from kvzip_eval.bench import checker

        checker.pause(True)
    for ctx in dict.fromkeys(p.context for p in prompts):
        for j in [j for j, p in enumerate(prompts) if p.context == ctx][:ALONE]:
            resets_refused += llm.reset_prefix_cache() is False
            returns += [{**q, "pass": "alone"} for q in gen([prompts[j]])]
    if checking:
        checker.pause(False)
    res["returns_s"] = round(time.perf_counter() - t, 2)
    res["local_cache_resets_refused"] = resets_refused
    s2, m2 = tier_stats(), _metric_sums(llm)

    def delta(a, b, key):
        return b.get(key, 0) - a.get(key, 0)

    tier: dict = dict(held)
    if tier.get("tokens_held") and tier.get("bytes_used"):
        tier["tokens_per_byte_used"] = tier["tokens_held"] / tier["bytes_used"]
    if conn == "kvzip":
        dropped = ("stores_dropped_queue_full", "store_errors", "blocks_skipped")
        tier["stores_dropped"] = sum(delta(s0, s2, k) for k in dropped)
        tier["load_errors"] = delta(s0, s2, "load_errors")
        tier["ratio"] = s2.get("ratio")
        tier["stats_end"] = s2
        if not spec["no_check"]:
            from kvzip_eval.bench import checker

            c = checker.counts()
            tier["check"] = c
            tier["bit_exact"] = bool(c and c["blocks_checked"] > 0 and c["blocks_differ"] == 0)
    elif conn == "offload":
        name = "vllm:kv_offload_allocation_failure"
        tier["stores_dropped"] = int(m2[name] - m0.get(name, 0)) if name in m2 else None
        tier["load_bytes"] = delta(m1, m2, "vllm:kv_offload_load_bytes")
        tier["store_bytes"] = delta(m0, m2, "vllm:kv_offload_store_bytes")
    tier["external_hits_returns"] = delta(m1, m2, "vllm:external_prefix_cache_hits")
    tier["external_queries_returns"] = delta(m1, m2, "vllm:external_prefix_cache_queries")
    engines.emit("result", **res, tier=tier, returns=returns)


# ------------------------------------------------------------------ the call (parent)
def run(o) -> dict:
    """The whole call (options ``o`` as ``kvzip bench tier`` takes them). Returns the result."""
    import torch
    from tqdm import tqdm

    out = Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="kvzip-bench-tier-"))
    cfg, folder, load_format = engines.model_folder(o.model, root)
    max_pos = int(cfg.get("max_position_embeddings", 1 << 30))
    block = o.block_size or (16 if torch.cuda.is_available() else 32)
    if CHUNK % block:
        raise WorkloadError(f"--block-size {block}: must divide the tier's chunk ({CHUNK})")
    if o.prompts:
        prompts = read_prompts(o.prompts, o.model, max_pos - 16)
        skipped = []
    else:
        plan = {c: PLANS.get(c, DEFAULT_GROUPS) for c in o.contexts}
        usable = {c: g for c, g in plan.items() if prompt_tokens(c) + 16 <= max_pos}
        skipped = [f"{c} (beyond the model's {max_pos} positions)" for c in plan if c not in usable]
        if not usable:
            raise WorkloadError(f"no context fits the model's {max_pos} positions")
        prompts = build_workload(usable, cfg["vocab_size"], o.seed)
    bpt = engines.kv_bytes_per_token(cfg)
    ws = distinct_tokens(prompts, block) * bpt
    cpu = {w: cpu_bytes_for(ws, WORKLOADS[w]) for w in o.workloads}
    plan_engines = [(w, c) for w in o.workloads for c in o.connectors if c != "none"]
    if "none" in o.connectors:
        plan_engines.insert(0, ("-", "none"))
    batches_per = (1 + o.repeats) * len(batches(list(range(len(prompts))), o.concurrency))
    bar = tqdm(total=len(plan_engines) * (batches_per + 1), desc="bench tier", unit="batch")
    started, engs = time.monotonic(), []
    for w, conn in plan_engines:
        base = {"workload": w, "connector": conn, "cpu_bytes": cpu[w] if conn != "none" else 0}
        left = o.deadline_s - (time.monotonic() - started)
        if left < 30:
            engs.append({**base, "error": f"not started: {left:.0f} s left of the deadline"})
            continue
        spec = {
            **base, "prompts": [(p.name, p.context, p.kind, p.tokens) for p in prompts],
            "model_dir": folder, "load_format": load_format, "vocab": cfg["vocab_size"],
            "bpt": bpt, "max_positions": max_pos, "seed": o.seed, "concurrency": o.concurrency,
            "repeats": o.repeats, "block_size": block, "gpu_slack_tokens": o.gpu_slack_tokens,
            "gpu_memory_utilization": o.gpu_memory_utilization,
            "kv_cache_bytes": o.kv_cache_bytes, "drain_s": o.drain_s, "no_check": o.no_check,
            "engine_args": o.engine_args,
        }  # fmt: skip
        done = [0]
        bar.set_postfix_str(f"{w} {conn}")

        def progress(recs, done=done):
            n = sum(r["kind"] in ("warm", "batch") for r in recs)
            if n > done[0]:
                bar.update(n - done[0])
                done[0] = n

        name = f"tier_{conn}" if conn == "none" else f"tier_{w}_{file_label(conn)}"
        t = time.perf_counter()
        rc, recs = engines.run_child("kvzip_eval.bench.tier", spec, out / f"{name}.log",
                                     engines.child_env(root), min(left, o.engine_timeout_s),
                                     progress)  # fmt: skip
        bar.update(batches_per + 1 - done[0])
        e = engines.engine_result(base, f"{w} {conn}", rc, recs, out / f"{name}.log")
        e["wall_s"] = round(time.perf_counter() - t, 1)
        engs.append(e)
    bar.close()
    rows = build_rows(engs)
    device = next((e["device"] for e in engs if e.get("device")), None)
    doc = output.header("tier", "kvzip's lossless tier beside vLLM's CPU offloading and "
                        "recompute: same CPU bytes, same traffic", device)  # fmt: skip
    doc.update(
        model=o.model or "Llama-3.1-8B's shape, dummy weights",
        prompts=o.prompts or "synthetic",
        workload={
            "prompts": len(prompts), "contexts": sorted({p.context for p in prompts}),
            "skipped_contexts": skipped, "kv_bytes_per_token": bpt, "working_set_bytes": ws,
            "cpu_bytes": cpu, "working_set_over_cpu_bytes": {w: WORKLOADS[w] for w in cpu},
        },
        settings={"repeats": o.repeats, "concurrency": o.concurrency, "block_size": block,
                  "gpu_slack_tokens": o.gpu_slack_tokens, "kvzip_chunk_tokens": CHUNK,
                  "kvzip_checked": not o.no_check, "engine_args": o.engine_args},
        rows=rows,
        engines=[{k: v for k, v in e.items() if k != "returns"} for e in engs],
        requests={e["name"]: e.get("returns") for e in engs if "returns" in e},
    )  # fmt: skip
    output.write(out, "bench_tier", doc, _markdown(doc), lambda ax: _plot(ax, rows))
    return doc


def _markdown(doc: dict) -> list[str]:
    wl = doc["workload"]
    lines = [
        f"Model: {doc['model']}; prompts: {doc['prompts']} ({wl['prompts']}, contexts "
        f"{wl['contexts']}), working set {wl['working_set_bytes'] / 1e9:.3f} GB of bf16 pages "
        f"({wl['kv_bytes_per_token']} B/token). CPU bytes per workload: "
        + ", ".join(f"{w} {b / 1e9:.3f} GB (working set {wl['working_set_over_cpu_bytes'][w]}x)"
                    for w, b in wl["cpu_bytes"].items())
        + f". {doc['settings']}",
        "",
    ]  # fmt: skip
    lines += output.table(doc["rows"], [
        ("workload", "workload"), ("context", "context"), ("connector", "connector"), ("n", "n"),
        ("ttft_p50_s", "TTFT p50 s"), ("ttft_p90_s", "TTFT p90 s"), ("ttft_mean_s", "mean s"),
        ("ttft_p50_vs_offload", "p50 vs offload"), ("ttft_alone_s", "TTFT alone s"),
        ("ttft_alone_vs_offload", "alone vs offload"), ("hit_rate", "hit rate"),
        ("tokens_held", "tokens held"), ("cpu_bytes", "CPU bytes"),
        ("tokens_per_cpu_byte", "tokens / byte used"),
        ("tokens_per_byte_vs_offload", "vs offload"), ("stores_dropped", "stores dropped"),
        ("load_errors", "chunks not restored"), ("bit_exact", "bit-exact"),
        ("first_token_equal_none", "first token = none")])  # fmt: skip
    for e in doc["engines"]:
        c = (e.get("tier") or {}).get("check")
        if c:
            lines += ["", f"Checker ({e['name']}): {c}"]
    where = [(e.get("name", e.get("connector")), (e.get("tier") or {}).get("stats_end"))
             for e in doc["engines"]]  # fmt: skip
    for head, keys in (("Where kvzip's time went", TIME_KEYS), ("Its host part", HOST_KEYS)):
        if not any(st for _, st in where):
            break
        lines += [
            "",
            f"{head} (its counters at the end of the run; seconds):",
            "",
            "| engine | " + " | ".join(keys) + " |",
            "|---|" + "---|" * len(keys),
        ]
        for name, st in where:
            if st:
                lines.append(f"| {name} | " + " | ".join(
                    str(_r(st[k], 3) if isinstance(st.get(k), float) else st.get(k, "-"))
                    for k in keys) + " |")  # fmt: skip
    lines += output.engines_md(doc["engines"])
    lines += [
        "",
        "TTFT: vLLM's first_token_latency (arrival to first token: a batch's queueing counts). "
        f"TTFT alone: the median of each context's first {ALONE} prompts returning once more, "
        "each with nothing beside it (the restore without a batch's queueing), kvzip's "
        "bit-exactness checker paused (its fingerprints of the restored blocks would be in the "
        "time; the passes before are checked). "
        "Hit rate: tokens of the returning prompts vLLM did not compute (num_cached_tokens) "
        "over the prompt less its last token. Tokens held: after the first pass. Tokens / byte "
        "used: tokens held over the CPU bytes they take (kvzip: entries plus tables; offload: "
        "raw pages). Stores dropped: kvzip stores_dropped_queue_full + store_errors + "
        "blocks_skipped; offload vllm:kv_offload_allocation_failure. Chunks not restored "
        "(kvzip): loads that failed (missing, evicted or failing the tier's checksums: vLLM "
        "recomputed them). Bit-exact (kvzip): every block restored compared byte for byte with "
        "a device copy of the block the tier was asked to store. First token = none: the "
        "first token equal to the recompute engine's.",
    ]
    return lines


def _plot(ax, rows: list[dict]) -> None:
    """TTFT p50 (bars) and p90 (whiskers) per workload and context, a bar per connector."""
    import numpy as np

    groups = list(
        dict.fromkeys((r["workload"], r["context"]) for r in rows if r["context"] != "all")
    )
    conns = list(dict.fromkeys(r["connector"] for r in rows))
    x = np.arange(len(groups))
    width = 0.8 / max(1, len(conns))
    for i, c in enumerate(conns):
        got = [next((r for r in rows if (r["workload"], r["context"]) == g
                     and r["connector"] == c), None) for g in groups]  # fmt: skip
        p50 = [r["ttft_p50_s"] or 0 if r else 0 for r in got]
        p90 = [max(0, (r["ttft_p90_s"] or 0) - (r["ttft_p50_s"] or 0)) if r else 0 for r in got]
        ax.bar(x + (i - (len(conns) - 1) / 2) * width, p50, width, yerr=[[0] * len(p50), p90],
               capsize=3, label=c)  # fmt: skip
    ax.set_xticks(x, [f"{w}\n{c // 1024}k" if c >= 1024 else f"{w}\n{c}" for w, c in groups])
    ax.set_ylabel("time to first token, s (p50; whisker: p90)")
    ax.set_title("Returning prompts: TTFT per context and connector")
    if conns:
        ax.legend()
    ax.grid(axis="y", alpha=0.3)


if __name__ == "__main__":
    spec = engines.child_spec()
    if spec is not None:
        child(spec)
        os._exit(0)  # vLLM's shutdown can hang; the result is out
