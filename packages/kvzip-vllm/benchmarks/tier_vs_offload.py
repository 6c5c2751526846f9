#!/usr/bin/env python3
"""kvzip's tier beside vLLM's own CPU offloading, the same CPU bytes, the same traffic.

    python tier_vs_offload.py --out DIR [--models 8b,smollm2] [--contexts 8192,32768,131072]
        [--connectors offload,kvzip,none] [--repeats 2] [--concurrency 4] [--quick]
        [--smollm2-model FOLDER | --smollm2-pieces P0 P1]

Three engines per model, each in its own process (the GPU is freed between them), on one
workload:

- ``offload``: vLLM's ``OffloadingConnector`` as a user gets it from ``--kv-offloading-size``
  (``LLM(kv_offloading_size=GiB, kv_offloading_backend="native")``: vLLM sets
  ``cpu_bytes_to_use``, raw bf16 pages in page-locked memory, LRU);
- ``kvzip``: ``KvzipConnector`` with ``budget_bytes`` the same bytes (wrapped by
  ``tier_vs_offload_verify.CheckingKvzipConnector``: every block it restores is compared,
  byte for byte, with a device copy of the block it was asked to store);
- ``none``: no connector (a returning prompt is recomputed).

Every engine runs with ``async_scheduling=False`` and ``VLLM_USE_V2_MODEL_RUNNER=0`` (the
kvzip tier refuses asynchronous scheduling and model runner V2; the other two get the same
settings so that only the connector differs), block size 16, prefix caching on, eager unless
``--graphs``, and a small GPU KV cache (``num_gpu_blocks_override``: the longest prompt plus
``--gpu-slack-tokens``), so that a returning prompt must come from the CPU tier. vLLM's local
prefix cache is also emptied (``reset_prefix_cache()``, the tier kept) before every batch of
returning prompts.

The workload, per context length C: ``pairs`` pairs of prompts sharing their first C/2
tokens (shared prefixes) and ``unshared`` prompts of their own, each ``C - 255`` random
tokens (whole 256-token chunks plus the one token vLLM always computes). The CPU bytes are
sized so that the distinct bf16 pages of the whole workload (every context) are
``--working-set-ratio`` (1.3) times the bytes: more than a raw tier can hold. First pass:
every prompt once (shuffled, in batches of ``--concurrency``), the tier stores it; then
``--repeats`` passes of returning prompts (each pass shuffled again, the same order for every
engine), batches of ``--concurrency`` at once, ``max_tokens=1``.

Measured per model, context and connector: time to first token of the returning prompts
(vLLM's ``RequestOutput.metrics.first_token_latency``: from the request's arrival to its first
token, so a batch's queueing counts; the batch's wall time where vLLM gives none), p50, p90
and mean; the hit rate (tokens of the returning prompts not recomputed, vLLM's
``num_cached_tokens``, over the tokens it could have skipped: the prompt less its last
token); tokens held by the CPU tier after the first pass and the bytes they take (kvzip: its
``raw_bytes_held`` over bf16 bytes per token, in ``bytes_held`` plus its tables; offload: the
blocks its manager holds times tokens per block, in raw pages); stores dropped (kvzip: its
``stores_dropped_queue_full + store_errors + blocks_skipped``; offload: vLLM's
``vllm:kv_offload_allocation_failure``, a request whose chunks found no room); bit-exactness
of every block kvzip restored (the checker's counts, and the tier's own checksum failures,
``load_errors``); the first token and its top-5 log-probabilities against the recompute
engine's.

Writes ``DIR/NAME.json`` (``rows`` per model, context and connector, ``goals``, device, date,
versions, command) and ``DIR/NAME.md``, one log per engine. Needs a CUDA GPU and vLLM (0.26
on an H200); the kvzip packages of this checkout are put on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_serving import ENV, LLAMA31_8B, plugin_path  # noqa: E402

CONNECTORS = ("offload", "kvzip", "none")
BLOCK = 16  # vLLM's block size in every engine
CHUNK = 256  # the kvzip tier's chunk (tokens)
#: the workload per model: {context: (pairs sharing half their prompt, unshared prompts)}
PLANS = {
    "8b": {8192: (2, 4), 32768: (1, 2), 131072: (1, 0)},
    "smollm2": {8192: (3, 6)},
}
QUICK_PLANS = {
    "8b": {8192: (1, 2), 32768: (1, 1)},
    "smollm2": {8192: (2, 3)},
}
#: a context not in the plan: one pair and one prompt of its own
DEFAULT_GROUPS = (1, 1)
GOAL_TTFT = 0.9  # kvzip's p50 <= 0.9x offload's at 32k and 128k
GOAL_DENSITY = 1.45  # tokens per CPU byte, kvzip over offload
GOAL_MEAN = 0.7  # mean TTFT over the whole workload, kvzip over offload
GOAL_CONTEXTS = (32768, 131072)


class WorkloadError(ValueError):
    pass


# ------------------------------------------------------------------ workload (no vLLM)
def kv_bytes_per_token(cfg: dict, dtype_bytes: int = 2) -> int:
    """bf16 bytes of K and V per token: layers x KV heads x head dim x 2 x 2."""
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * heads * head_dim * 2 * dtype_bytes


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
    kind: str  # "shared" (one of a pair sharing its first context/2 tokens) or "unshared"
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
        n = prompt_tokens(ctx)
        half = ctx // 2
        for p in range(pairs):
            prefix = draw(half)
            for s in "ab":
                out.append(Prompt(f"{ctx}-pair{p}{s}", ctx, "shared", (*prefix, *draw(n - half))))
        for u in range(unshared):
            out.append(Prompt(f"{ctx}-own{u}", ctx, "unshared", tuple(draw(n))))
    return out


def distinct_tokens(prompts: list[Prompt], block: int = BLOCK) -> int:
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


def percentile(xs: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no values."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# ------------------------------------------------------------------ report (no vLLM)
def _r(x, nd=4):
    return None if x is None else round(x, nd)


def build_rows(engines: list[dict]) -> list[dict]:
    """Rows per (model, context, connector) plus a ``context: "all"`` row per engine (every
    returning request), from the engines' results (``run_engine``)."""
    rows = []
    none_first = {}
    for e in engines:
        if e.get("connector") == "none" and "returns" in e:
            for q in e["returns"]:
                none_first[(e["model"], q["prompt"], q["pass"])] = q
    for e in engines:
        if "returns" not in e:
            continue
        tier = e.get("tier", {})
        common = {
            "model": e["model"],
            "connector": e["connector"],
            "tokens_held": tier.get("tokens_held", 0),
            "cpu_bytes": e["cpu_bytes"],
            "tier_bytes_used": tier.get("bytes_used", 0),
            "tokens_per_cpu_byte": tier.get("tokens_per_byte_used"),
            "stores_dropped": tier.get("stores_dropped"),
            "bit_exact": tier.get("bit_exact"),
            "working_set_over_cpu_bytes": e["working_set_over_cpu_bytes"],
            # vLLM's own count over every returning request: tokens the connector loaded over
            # the tokens asked of it (those not in vLLM's local cache)
            "connector_hit_rate": (
                _r(tier["external_hits_returns"] / tier["external_queries_returns"])
                if tier.get("external_queries_returns")
                else None
            ),
        }
        groups: dict = {}
        for q in e["returns"]:
            groups.setdefault(q["context"], []).append(q)
        groups["all"] = list(e["returns"])
        for ctx, qs in groups.items():
            ttft = [q["ttft_s"] for q in qs]
            skippable = sum(q["tokens"] - 1 for q in qs)
            cached = sum(q["cached_tokens"] or 0 for q in qs)
            same, dlp = [], []
            for q in qs:
                ref = none_first.get((e["model"], q["prompt"], q["pass"]))
                if ref is None or e["connector"] == "none":
                    continue
                same.append(q["first_token"] == ref["first_token"])
                if q.get("logprob") is not None and ref.get("logprob") is not None:
                    dlp.append(abs(q["logprob"] - ref["logprob"]))
            rows.append(
                {
                    **common,
                    "context": ctx,
                    "n": len(qs),
                    "ttft_p50_s": _r(percentile(ttft, 50)),
                    "ttft_p90_s": _r(percentile(ttft, 90)),
                    "ttft_mean_s": _r(sum(ttft) / len(ttft)) if ttft else None,
                    "hit_rate": _r(cached / skippable) if skippable else None,
                    "first_token_equal_none": (sum(same) / len(same)) if same else None,
                    "max_abs_logprob_diff_none": _r(max(dlp), 6) if dlp else None,
                }
            )
    return rows


def _find(rows, model, ctx, conn):
    return next(
        (r for r in rows if r["model"] == model and r["context"] == ctx and r["connector"] == conn),
        None,
    )


def evaluate_goals(rows: list[dict]) -> list[dict]:
    """The issue's goals, per model: kvzip against offload. ``met`` is None where a side is
    missing (not run, or failed)."""
    goals = []
    for model in sorted({r["model"] for r in rows}):

        def goal(name, ctx, value, target, met, note="", model=model):
            goals.append(
                {
                    "goal": name,
                    "model": model,
                    "context": ctx,
                    "value": _r(value, 4),
                    "target": target,
                    "met": met,
                    **({"note": note} if note else {}),
                }
            )

        for ctx in GOAL_CONTEXTS:
            k, o = _find(rows, model, ctx, "kvzip"), _find(rows, model, ctx, "offload")
            if k is None and o is None:
                continue
            v = (
                k["ttft_p50_s"] / o["ttft_p50_s"]
                if k and o and k["ttft_p50_s"] is not None and o["ttft_p50_s"]
                else None
            )
            goal(
                "ttft_p50_kvzip_over_offload",
                ctx,
                v,
                f"<= {GOAL_TTFT}",
                None if v is None else v <= GOAL_TTFT,
            )
        k, o = _find(rows, model, "all", "kvzip"), _find(rows, model, "all", "offload")
        d = (
            k["tokens_per_cpu_byte"] / o["tokens_per_cpu_byte"]
            if k and o and k["tokens_per_cpu_byte"] and o["tokens_per_cpu_byte"]
            else None
        )
        goal(
            "tokens_per_cpu_byte_kvzip_over_offload",
            "all",
            d,
            f">= {GOAL_DENSITY}",
            None if d is None else d >= GOAL_DENSITY,
            "tokens held over the bytes they take (kvzip: entries and tables)",
        )
        sd = k["stores_dropped"] if k else None
        goal("kvzip_stores_dropped", "all", sd, "== 0", None if sd is None else sd == 0)
        m = (
            k["ttft_mean_s"] / o["ttft_mean_s"]
            if k and o and k["ttft_mean_s"] is not None and o["ttft_mean_s"]
            else None
        )
        ws = k["working_set_over_cpu_bytes"] if k else None
        goal(
            "ttft_mean_kvzip_over_offload",
            "all",
            m,
            f"<= {GOAL_MEAN}",
            None if m is None else m <= GOAL_MEAN,
            f"every returning request, working set {ws}x the CPU bytes" if ws else "",
        )
        be = k["bit_exact"] if k else None
        goal("kvzip_bit_exact", "all", None, "every restored block equal", be)
    return goals


def _fmt(x):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def write_md(path: Path, doc: dict) -> None:
    s = doc["settings"]
    lines = [
        "# kvzip's tier beside vLLM's OffloadingConnector: same CPU bytes, same traffic",
        "",
        f"Device {doc.get('device')}, {doc['date']}, vLLM {doc.get('vllm')}, torch "
        f"{doc.get('torch')}, Python {doc['python']}. Command: `{doc['command']}`.",
        "",
        f"Each connector in its own engine (its own process); every engine: "
        f"async_scheduling=False, VLLM_USE_V2_MODEL_RUNNER=0, "
        f"{'eager' if s['eager'] else 'CUDA graphs'}, block size "
        f"{s.get('block_size', BLOCK)}, prefix caching on, GPU KV cache "
        f"{s['gpu_slack_tokens']} tokens above the longest prompt, vLLM's local prefix "
        f"cache emptied before every batch of returning prompts; {s['repeats']} returning "
        f"pass(es) ({s.get('none_repeats')} for none), batches of {s['concurrency']} at "
        f"once, max_tokens=1. Random token ids.",
        "",
    ]
    for m in doc["models"]:
        lines.append(
            f"- {m['model']}: {m['prompts']} prompts ({m['plan']}), working set "
            f"{m['working_set_bytes'] / 1e9:.2f} GB of bf16 pages ({m['distinct_tokens']} "
            f"distinct tokens, {m['kv_bytes_per_token']} B/token), CPU bytes "
            f"{m['cpu_bytes'] / 1e9:.2f} GB (working set {m['working_set_ratio']}x)"
            + (f"; skipped contexts: {m['skipped']}" if m.get("skipped") else "")
        )
    lines += [
        "",
        "| model | context | connector | n | TTFT p50 s | TTFT p90 s | TTFT mean s | hit rate "
        "| tokens held | CPU bytes | tokens / byte used | stores dropped | bit-exact | first "
        "token = none |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        lines.append(
            "| "
            + " | ".join(
                _fmt(r[k])
                for k in (
                    "model",
                    "context",
                    "connector",
                    "n",
                    "ttft_p50_s",
                    "ttft_p90_s",
                    "ttft_mean_s",
                    "hit_rate",
                    "tokens_held",
                    "cpu_bytes",
                    "tokens_per_cpu_byte",
                    "stores_dropped",
                    "bit_exact",
                    "first_token_equal_none",
                )
            )
            + " |"
        )
    lines += ["", "| goal | model | context | value | target | met |", "|---|---|---|---|---|---|"]
    for g in doc["goals"]:
        lines.append(
            f"| {g['goal']} | {g['model']} | {g['context']} | {_fmt(g['value'])} | "
            f"{g['target']} | {_fmt(g['met'])} |"
        )
    timed = [
        e for e in doc["engines"] if ((e.get("tier") or {}).get("check") or {}).get("hook_seconds")
    ]
    if timed:
        lines += [
            "",
            "Host seconds in the kvzip connector's hooks over the whole engine run (both roles, "
            "warm-up included; `checker`: the benchmark's comparison, not the tier's), calls:",
            "",
        ]
        for e in timed:
            c = e["tier"]["check"]
            top = sorted(c["hook_seconds"].items(), key=lambda kv: -kv[1])
            lines.append(
                f"- {e['model']}: "
                + ", ".join(f"{k} {v:.3f} s ({c['hook_calls'].get(k, '-')})" for k, v in top)
            )
            st = e["tier"].get("stats_end") or {}
            parts = ("restore_seconds", "load_submit_seconds", "load_host_seconds",
                     "load_wait_seconds")  # fmt: skip
            if all(k in st for k in parts):
                lines.append(
                    f"  - the tier's loads: restore {st['restore_seconds']:.3f} s (start of the "
                    f"step's loads to the end of their wait), of which submit "
                    f"{st['load_submit_seconds']:.3f} s, host start "
                    f"{st['load_host_seconds']:.3f} s, wait {st['load_wait_seconds']:.3f} s"
                )
            calls = c.get("load_calls") or []
            if calls:
                walls = sorted(w for w, _, _ in calls)
                cpus = sorted(x for _, x, _ in calls)
                lines.append(
                    f"  - `start_load_kv` with loads: {len(calls)} calls, wall median "
                    f"{walls[len(walls) // 2] * 1e3:.1f} ms (max {walls[-1] * 1e3:.1f}), this "
                    f"thread's CPU median {cpus[len(cpus) // 2] * 1e3:.1f} ms"
                )
            steps = [x for x in c.get("steps") or [] if x["loads"] and x.get("rest") is not None]
            if steps:
                med = {
                    k: sorted(x[k] for x in steps)[len(steps) // 2]
                    for k in ("load", "forward", "after", "rest", "device")
                    if all(x.get(k) is not None for x in steps)
                }
                lines.append(
                    f"  - steps that restored ({len(steps)}), median ms: "
                    + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
                    + " (load: start_load_kv; forward: from there to wait_for_save; after: to "
                    "the end of get_block_ids_with_load_errors, the checker included; rest: to "
                    "the next step; device: the compute stream, step start to forward end)"
                )
    failed = [e for e in doc["engines"] if "error" in e]
    if failed:
        lines += ["", "Engines that did not finish:"]
        lines += [f"- {e['model']} {e['connector']}: {e['error'][-300:]!r}" for e in failed]
    lines += [
        "",
        "TTFT: vLLM's first_token_latency (arrival to first token: a batch's queueing counts). "
        "Hit rate: tokens of the returning prompts vLLM did not compute (num_cached_tokens) "
        "over the prompt less its last token. Tokens held: after the first pass. Tokens / byte "
        "used: tokens held over the CPU bytes they take (kvzip: its entries plus tables; "
        "offload: raw pages). Stores dropped: kvzip stores_dropped_queue_full + store_errors + "
        "blocks_skipped; offload vllm:kv_offload_allocation_failure (null: vLLM reported none). "
        "Bit-exact (kvzip): every block restored during the run compared byte for byte with a "
        "device copy of the block the tier was asked to store, and no chunk failed the tier's "
        "own checksums. First token = none: the first token equal to the recompute engine's.",
    ]
    path.write_text("\n".join(lines) + "\n")


# ------------------------------------------------------------------ one engine (vLLM)
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


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _offload_held(llm, bpt: int, block: int) -> dict:
    """Blocks vLLM's offloading manager holds (its scheduler half, in this process)."""
    try:
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        conn = sched.connector
        mgr = conn.connector_scheduler.manager
        keys = mgr._num_allocated_blocks - len(mgr._free_list)
        extra = sched.vllm_config.kv_transfer_config.kv_connector_extra_config
        per_key = block * int(extra.get("blocks_per_chunk", 1))
        return {
            "keys_held": keys,
            "keys_capacity": mgr._num_blocks,
            "tokens_held": keys * per_key,
            "bytes_used": keys * per_key * bpt,
            "capacity_tokens": mgr._num_blocks * per_key,
        }
    except (AttributeError, TypeError) as e:
        return {"error": f"offloading manager not readable: {e!r}"}


def say(msg: str) -> None:
    print(f"[tier_vs_offload {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_engine(spec: dict) -> dict:
    """One engine: warm-up, first pass, drain, returning passes. ``spec`` from ``main``."""
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    conn = spec["connector"]
    root = Path(tempfile.mkdtemp(prefix=f"tvo-{conn}-"))
    stats = root / "tier-stats.json"
    prompts = build_workload(spec["plan_int"], spec["vocab"], spec["seed"])
    longest = max(len(p.tokens) for p in prompts)
    kw: dict = {}
    if conn == "kvzip":
        checked = not spec["no_check"]
        kw["kv_transfer_config"] = {
            "kv_connector": "CheckingKvzipConnector" if checked else "KvzipConnector",
            "kv_connector_module_path": (
                "tier_vs_offload_verify" if checked else "kvzip_vllm.connector"
            ),
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "budget_bytes": spec["cpu_bytes"],
                "stats_path": str(stats),
                "fit_tokens": 1024,
                "chunk_tokens": CHUNK,
            },
        }
    elif conn == "offload":  # what `--kv-offloading-size GiB` gives
        kw["kv_offloading_size"] = spec["cpu_bytes"] / (1 << 30)
        kw["kv_offloading_backend"] = "native"
    block = spec["block_size"]
    gpu_blocks = math.ceil((longest + spec["gpu_slack_tokens"]) / block)
    res: dict = {"model": spec["model"], "connector": conn, "cpu_bytes": spec["cpu_bytes"]}
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model_dir"],
        load_format=spec["load_format"],
        skip_tokenizer_init=True,
        dtype="bfloat16",
        block_size=block,
        max_model_len=min(longest + 16, spec["max_positions"]),
        max_num_seqs=max(8, spec["concurrency"]),
        gpu_memory_utilization=spec["gpu_mem"],
        num_gpu_blocks_override=gpu_blocks,
        enable_prefix_caching=True,
        enforce_eager=spec["eager"],
        async_scheduling=False,
        disable_log_stats=False,
        seed=0,
        **kw,
    )
    res["init_s"] = round(time.perf_counter() - t0, 1)
    say(f"engine up in {res['init_s']} s")
    cfg = llm.llm_engine.vllm_config
    res["engine"] = {
        "num_gpu_blocks": cfg.cache_config.num_gpu_blocks,
        "async_scheduling": bool(getattr(cfg.scheduler_config, "async_scheduling", False)),
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "enforce_eager": cfg.model_config.enforce_eager,
        "kv_connector": getattr(cfg.kv_transfer_config, "kv_connector", None),
        "kv_connector_extra_config": dict(
            getattr(cfg.kv_transfer_config, "kv_connector_extra_config", None) or {}
        ),
        "use_v2_model_runner": bool(getattr(cfg, "use_v2_model_runner", False)),
    }
    on_gpu = torch.cuda.is_available()

    def sync():
        if on_gpu:
            torch.cuda.synchronize()

    def gen(ps: list[Prompt], max_tokens: int = 1):
        sp = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=5
        )
        sync()
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": list(p.tokens)} for p in ps], sp, use_tqdm=False)
        sync()
        wall = time.perf_counter() - t
        rows = []
        for p, o in zip(ps, outs, strict=True):
            m = getattr(o, "metrics", None)
            ftl = getattr(m, "first_token_latency", 0.0) if m is not None else 0.0
            tok = o.outputs[0].token_ids[0]
            lps = o.outputs[0].logprobs
            lp = lps[0].get(tok) if lps else None
            rows.append(
                {
                    "prompt": p.name,
                    "context": p.context,
                    "kind": p.kind,
                    "tokens": len(p.tokens),
                    "ttft_s": round(ftl if ftl and ftl > 0 else wall, 5),
                    "ttft_source": "first_token_latency" if ftl and ftl > 0 else "batch_wall",
                    "batch_wall_s": round(wall, 5),
                    "cached_tokens": o.num_cached_tokens,
                    "first_token": tok,
                    "logprob": getattr(lp, "logprob", None),
                    "top5": sorted(
                        ((t, round(x.logprob, 6)) for t, x in (lps[0].items() if lps else [])),
                        key=lambda a: -a[1],
                    ),
                }
            )
        return rows

    def tier_stats() -> dict:
        return _read(stats) if conn == "kvzip" else {}

    def drain(min_s: float) -> float:
        """Short steps (they carry the workers' store reports) until the tier's stores are
        done: kvzip's counters still over three polls, no spilled chunk left; at least
        ``min_s`` for all."""
        t = time.perf_counter()
        last, still = None, 0
        while time.perf_counter() - t < spec["drain_s"]:
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
    warm_short = Prompt("warm-short", 0, "warm", tuple(rng.randrange(10, 99) for _ in range(64)))
    warm_long = Prompt(
        "warm-long",
        0,
        "warm",
        tuple(rng.randrange(10, spec["vocab"] - 10) for _ in range(min(4097, longest))),
    )
    # warm-up: a prompt, stored, then restored (the tiers' first load builds their paths);
    # then both tiers emptied, so the workload starts from an empty tier
    gen([warm_short])
    gen([warm_long])
    say("warm-up prompts done")
    drain(1.0)
    llm.reset_prefix_cache()
    res["warm_restore"] = gen([warm_long])[0]
    ok = llm.reset_prefix_cache(reset_connector=True)
    gen([warm_short])  # the step that carries the tier's clear to its worker
    res["tier_reset"] = ok
    s0, m0 = tier_stats(), _metric_sums(llm)
    say(f"warm restore {res['warm_restore']['ttft_s']} s, tier reset {ok}")

    # first pass: every prompt once, shuffled, in batches
    order = list(range(len(prompts)))
    random.Random(spec["seed"] + 7).shuffle(order)
    first = []
    t = time.perf_counter()
    for b in batches(order, spec["concurrency"]):
        first += gen([prompts[i] for i in b])
    res["first_pass_s"] = round(time.perf_counter() - t, 2)
    say(f"first pass {res['first_pass_s']} s")
    res["drain_s"] = drain(2.0)
    say(f"drained in {res['drain_s']} s")
    s1, m1 = tier_stats(), _metric_sums(llm)
    held = (
        _offload_held(llm, spec["bpt"], spec["block_size"])
        if conn == "offload"
        else {
            "tokens_held": s1.get("raw_bytes_held", 0) // spec["bpt"],
            "bytes_used": s1.get("bytes_held", 0) + s1.get("table_bytes", 0),
        }
        if conn == "kvzip"
        else {"tokens_held": 0, "bytes_used": 0}
    )

    # returning passes
    returns = []
    resets_refused = 0  # vLLM refuses while blocks are in use: local hits possible then
    t = time.perf_counter()
    for i, order in enumerate(passes(len(prompts), spec["repeats"], spec["seed"])):
        for b in batches(order, spec["concurrency"]):
            # vLLM's local cache only: the returns come from the tier
            resets_refused += llm.reset_prefix_cache() is False
            for q in gen([prompts[j] for j in b]):
                returns.append({**q, "pass": i})
    res["returns_s"] = round(time.perf_counter() - t, 2)
    res["local_cache_resets_refused"] = resets_refused
    say(f"returns {res['returns_s']} s")
    s2, m2 = tier_stats(), _metric_sums(llm)
    held_end = _offload_held(llm, spec["bpt"], spec["block_size"]) if conn == "offload" else {}

    def delta(a, b, key):
        return b.get(key, 0) - a.get(key, 0)

    tier: dict = dict(held)
    if tier.get("tokens_held") and tier.get("bytes_used"):
        tier["tokens_per_byte_used"] = tier["tokens_held"] / tier["bytes_used"]
    if conn == "kvzip":
        dropped_keys = ("stores_dropped_queue_full", "store_errors", "blocks_skipped")
        tier["stores_dropped"] = sum(delta(s0, s2, k) for k in dropped_keys)
        tier["stores_dropped_parts"] = {k: delta(s0, s2, k) for k in dropped_keys}
        tier["load_errors"] = delta(s0, s2, "load_errors")
        tier["tokens_held_end"] = s2.get("raw_bytes_held", 0) // spec["bpt"]
        tier["ratio"] = s2.get("ratio")
        tier["ratio_with_tables"] = s2.get("ratio_with_tables")
        if not spec["no_check"]:
            import tier_vs_offload_verify

            c = tier_vs_offload_verify.counts()
            tier["check"] = c
            tier["bit_exact"] = (
                bool(c and c["blocks_checked"] > 0 and c["blocks_differ"] == 0)
                and tier["load_errors"] == 0
            )
        tier["stats_end"] = s2
    elif conn == "offload":
        name = "vllm:kv_offload_allocation_failure"
        if name in m2:
            tier["stores_dropped"] = int(m2[name] - m0.get(name, 0))
        else:
            tier["stores_dropped"] = None
            tier["stores_dropped_note"] = f"vLLM reported no {name} metric"
        tier["held_end"] = held_end
        tier["load_bytes"] = delta(m1, m2, "vllm:kv_offload_load_bytes")
        tier["store_bytes"] = delta(m0, m2, "vllm:kv_offload_store_bytes")
    tier["external_hits_returns"] = delta(m1, m2, "vllm:external_prefix_cache_hits")
    tier["external_queries_returns"] = delta(m1, m2, "vllm:external_prefix_cache_queries")
    res.update(
        {
            "tier": tier,
            "first": first,
            "returns": returns,
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if on_gpu else platform.processor() or "cpu",
        }
    )
    return res


# ------------------------------------------------------------------ the run
def _model(args, name: str, root: Path) -> tuple[dict, str, str]:
    """(config, folder, load_format) of a model."""
    if name == "8b":
        d = root / "llama31-8b-shape"
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(LLAMA31_8B, indent=1))
        return LLAMA31_8B, str(d), "dummy"
    if name == "smollm2":
        folder = args.smollm2_model
        if folder is None and args.smollm2_pieces:
            from carry_model import unpack

            folder = str(unpack([Path(p) for p in args.smollm2_pieces], root / "smollm2"))
        if folder is None:
            raise WorkloadError("model smollm2 needs --smollm2-model FOLDER or --smollm2-pieces")
        cfg = json.loads((Path(folder) / "config.json").read_text())
        return cfg, folder, "auto"
    raise WorkloadError(f"model {name!r}: supported are 8b, smollm2")


def model_setup(
    name: str, cfg: dict, plan: dict, ratio: float, seed: int, block: int = BLOCK
) -> dict:
    """The workload of one model and its CPU bytes (no vLLM)."""
    max_pos = int(cfg.get("max_position_embeddings", 1 << 30))
    usable = {c: g for c, g in plan.items() if prompt_tokens(c) + 16 <= max_pos}
    skipped = sorted(set(plan) - set(usable))
    if not usable:
        raise WorkloadError(f"{name}: no context fits its {max_pos} positions")
    prompts = build_workload(usable, cfg["vocab_size"], seed)
    bpt = kv_bytes_per_token(cfg)
    tokens = distinct_tokens(prompts, block)
    ws = tokens * bpt
    cpu = cpu_bytes_for(ws, ratio)
    return {
        "model": name,
        "plan": {str(c): list(g) for c, g in usable.items()},
        "skipped": [f"{c} (beyond {max_pos} positions)" for c in skipped],
        "prompts": len(prompts),
        "distinct_tokens": tokens,
        "kv_bytes_per_token": bpt,
        "working_set_bytes": ws,
        "cpu_bytes": cpu,
        "working_set_ratio": round(ws / cpu, 4),
        "max_positions": max_pos,
    }


def _plans(args) -> dict:
    base = QUICK_PLANS if args.quick else PLANS
    out = {}
    for m in args.models:
        plan = dict(base.get(m, {}))
        if args.contexts:
            plan = {c: plan.get(c, PLANS.get(m, {}).get(c, DEFAULT_GROUPS)) for c in args.contexts}
        out[m] = plan
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("KVZIP_RESULTS_DIR", "."))
    ap.add_argument("--name", default="tier_vs_offload")
    ap.add_argument("--models", default="8b,smollm2")
    ap.add_argument("--contexts", default=None, help="e.g. 8192,32768,131072 (default: plan's)")
    ap.add_argument("--connectors", default=",".join(CONNECTORS))
    ap.add_argument("--repeats", type=int, default=2, help="returning passes")
    ap.add_argument("--none-repeats", type=int, default=1, help="returning passes, none")
    ap.add_argument("--concurrency", type=int, default=4, help="requests at once")
    ap.add_argument("--working-set-ratio", type=float, default=1.3)
    ap.add_argument("--quick", action="store_true", help="smaller plans, 8k and 32k, 1 repeat")
    ap.add_argument("--graphs", action="store_true", help="CUDA graphs (default: eager)")
    ap.add_argument("--gpu-mem", type=float, default=0.45)
    ap.add_argument("--block-size", type=int, default=BLOCK, help="vLLM's (CPU: 32)")
    ap.add_argument("--gpu-slack-tokens", type=int, default=4096)
    ap.add_argument("--drain-s", type=float, default=90)
    ap.add_argument("--no-check", action="store_true", help="kvzip without the block checker")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smollm2-model", default=None, help="the embedded model's HF folder")
    ap.add_argument("--smollm2-pieces", nargs="*", default=None, help="carry_model.py pieces")
    ap.add_argument("--deadline-s", type=float, default=510, help="no engine starts past it")
    ap.add_argument("--engine-timeout-s", type=float, default=300)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:  # one engine: spec in, result out
        if os.environ.get("TIER_VS_OFFLOAD_STACKS_S"):  # where a stuck engine is, in its log
            import faulthandler

            faulthandler.dump_traceback_later(float(os.environ["TIER_VS_OFFLOAD_STACKS_S"]))
        spec = json.loads(Path(args.child).read_text())
        spec["plan_int"] = {int(c): tuple(g) for c, g in spec["plan"].items()}
        res = run_engine(spec)
        Path(spec["result"]).write_text(json.dumps(res) + "\n")
        sys.stdout.flush()
        os._exit(0)

    t_start = time.monotonic()
    args.models = [m for m in args.models.split(",") if m]
    args.contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else None
    conns = [c for c in args.connectors.split(",") if c]
    bad = [c for c in conns if c not in CONNECTORS]
    if bad:
        ap.error(f"connectors {bad}: supported are {', '.join(CONNECTORS)}")
    if args.quick:
        args.repeats = min(args.repeats, 1)
        args.none_repeats = min(args.none_repeats, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="tier-vs-offload-"))
    extra = plugin_path(root).split(os.pathsep)
    env = dict(os.environ, **{k: os.environ.get(k, v) for k, v in ENV.items()})
    env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    env["PYTHONPATH"] = os.pathsep.join([*extra, env.get("PYTHONPATH", "")])
    plans = _plans(args)
    models, engines = [], []
    for name in args.models:
        cfg, folder, load_format = _model(args, name, root)
        ms = model_setup(name, cfg, plans[name], args.working_set_ratio, args.seed, args.block_size)
        models.append(ms)
        print(f"{name}: {json.dumps(ms)}", flush=True)
        for conn in conns:
            elapsed = time.monotonic() - t_start
            left = args.deadline_s - elapsed
            base = {
                "model": name,
                "connector": conn,
                "cpu_bytes": ms["cpu_bytes"] if conn != "none" else 0,
            }
            if left < 30:
                engines.append({**base, "error": f"not started: {left:.0f} s left of the deadline"})
                continue
            spec = {
                **ms,
                "connector": conn,
                "model_dir": folder,
                "load_format": load_format,
                "vocab": cfg["vocab_size"],
                "bpt": ms["kv_bytes_per_token"],
                "cpu_bytes": ms["cpu_bytes"],
                "seed": args.seed,
                "concurrency": args.concurrency,
                # the recompute engine's times do not depend on a tier: fewer passes
                "repeats": args.none_repeats if conn == "none" else args.repeats,
                "eager": not args.graphs,
                "gpu_mem": args.gpu_mem,
                "gpu_slack_tokens": args.gpu_slack_tokens,
                "block_size": args.block_size,
                "drain_s": args.drain_s,
                "no_check": args.no_check,
                "result": str(root / f"{name}-{conn}.json"),
            }
            sp = root / f"{name}-{conn}.spec.json"
            sp.write_text(json.dumps(spec))
            log = out / f"{args.name}_{name}_{conn}.log"
            t = time.perf_counter()
            try:
                with open(log, "w") as f:
                    rc = subprocess.run(
                        [sys.executable, str(Path(__file__).resolve()), "--child", str(sp)],
                        env=env,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        # the run's files are written by deadline + 20 s at the latest
                        timeout=min(args.engine_timeout_s, args.deadline_s + 20 - elapsed),
                    ).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            r = _read(Path(spec["result"]))
            if not r:
                tail = log.read_text()[-1500:] if log.exists() else ""
                r = {**base, "error": f"rc {rc}: {tail}"}
            else:
                r["cpu_bytes"] = base["cpu_bytes"]
            r["working_set_over_cpu_bytes"] = ms["working_set_ratio"] if conn != "none" else None
            r["wall_s"] = round(time.perf_counter() - t, 1)
            engines.append(r)
            summary = {
                k: r.get(k) for k in ("init_s", "first_pass_s", "drain_s", "returns_s", "wall_s")
            }
            print(f"{name} {conn}: {summary} {r.get('error', '')[-400:]}", flush=True)

    rows = build_rows(engines)
    ok = [e for e in engines if "error" not in e]
    doc = {
        "scenario": "tier_vs_offload",
        "device": ok[0]["device"] if ok else None,
        "vllm": ok[0]["vllm"] if ok else None,
        "torch": ok[0]["torch"] if ok else None,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "python " + " ".join(sys.argv),
        "settings": {
            "async_scheduling": False,
            "VLLM_USE_V2_MODEL_RUNNER": "0",
            "eager": not args.graphs,
            "repeats": args.repeats,
            "none_repeats": args.none_repeats,
            "concurrency": args.concurrency,
            "working_set_ratio": args.working_set_ratio,
            "gpu_slack_tokens": args.gpu_slack_tokens,
            "block_size": args.block_size,
            "kvzip_chunk_tokens": CHUNK,
            "kvzip_checked": not args.no_check,
        },
        "models": models,
        "rows": rows,
        "goals": evaluate_goals(rows),
        "wall_s": round(time.monotonic() - t_start, 1),
        "engines": [{k: v for k, v in e.items() if k not in ("first", "returns")} for e in engines],
        "requests": {
            f"{e['model']}/{e['connector']}": {"first": e.get("first"), "returns": e.get("returns")}
            for e in ok
        },
    }
    (out / f"{args.name}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    write_md(out / f"{args.name}.md", doc)
    print((out / f"{args.name}.md").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
