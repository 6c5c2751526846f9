#!/usr/bin/env python3
"""The tier's stores under load in vLLM on a GPU: no store lost while the tier has room.

    python gpu_store.py --out DIR [--long 130048 --n-long 4 --short 32768 --n-short 8]

Llama-3.1-8B shape (dummy weights), ``KvzipConnector`` (the plain one: no device copy of
every block), vLLM's defaults otherwise (asynchronous scheduling where vLLM turns it on, CUDA
graphs, the default store queue: half the free device memory, at most 16 GiB). Phase A:
``--n-long`` prompts of ``--long`` tokens prefilled back to back (one request after the
other, as users arriving), more KV than the store queue holds, so the stores spill to the
host or the steps wait; phase B: ``--n-short`` prompts of ``--short`` tokens at once. After
each phase the stores are waited for (short steps carry the worker's reports). Then vLLM's
prefix cache is reset and the last long prompt and the first short one return: restored from
the tier (times to first token against their recomputes, outputs against local prefix-cache
hits).

A thread samples the tier's counters (its ``stats_path``) every ``--sample-s``: the store
throughput while the GPU prefills is the bf16 bytes the tier coded during a phase's prefill
over the store thread's busy time then (``store_busy_seconds``: from a step's KV computed to
its chunks held), and over the wall time, against the KV bytes the prefill produced.

Writes ``DIR/gpu_store.json`` and ``.md`` and prints ``RESULT {json}``.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_serving import ENV, LLAMA31_8B, plugin_path, prompts  # noqa: E402
from gpu_e2e import _ids, _model_dir, _read, _timed  # noqa: E402

#: bf16 bytes of K and V per token of the 8B shape (32 layers x 8 heads x 128 x 2 x 2 bytes)
KV_BYTES_PER_TOKEN = 131072
COUNTERS = (
    "raw_bytes_stored",
    "blocks_stored",
    "store_busy_seconds",
    "store_seconds",
    "store_encode_seconds",
    "store_copy_seconds",
    "stores_spilled_host",
    "spill_bytes_held",
    "stores_waited_queue_full",
    "store_wait_seconds",
    "stores_dropped_queue_full",
    "store_errors",
    "blocks_skipped",
    "bytes_held",
    "evictions",
)


class Sampler(threading.Thread):
    """The tier's counters every ``every_s`` seconds: ``[(t, {counter: value})]``."""

    def __init__(self, path: Path, every_s: float):
        super().__init__(daemon=True)
        self.path, self.every_s = path, every_s
        self.rows: list[tuple[float, dict]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            self.snap()
            self.halt.wait(self.every_s)

    def snap(self) -> dict:
        s = _read(self.path)
        row = {k: s.get(k, 0) for k in COUNTERS}
        self.rows.append((time.perf_counter(), row))
        return row


def _window(before: dict, after: dict, seconds: float, tokens: int) -> dict:
    """Store and prefill rates over one phase's prefill."""
    coded = after["raw_bytes_stored"] - before["raw_bytes_stored"]
    busy = after["store_busy_seconds"] - before["store_busy_seconds"]
    enc = after["store_encode_seconds"] - before["store_encode_seconds"]
    copy = after["store_copy_seconds"] - before["store_copy_seconds"]
    prefill = tokens * KV_BYTES_PER_TOKEN
    store_busy = coded / busy / 1e9 if busy > 0 else None
    return {
        "prefill_s": round(seconds, 3),
        "prefill_tokens": tokens,
        "prefill_tok_per_s": round(tokens / seconds),
        "prefill_kv_GBps": round(prefill / seconds / 1e9, 3),
        "stored_GB_during": round(coded / 1e9, 3),
        "store_busy_s_during": round(busy, 3),
        "store_encode_s_during": round(enc, 3),
        "store_copy_s_during": round(copy, 3),
        "store_GBps_busy": round(store_busy, 3) if store_busy else None,
        "store_GBps_wall": round(coded / seconds / 1e9, 3),
        "store_busy_over_prefill": (
            round(store_busy / (prefill / seconds / 1e9), 3) if store_busy else None
        ),
    }


def _wait_stored(llm, sampler: Sampler, want: int, deadline_s: float, other) -> tuple[float, dict]:
    """Short steps until ``blocks_stored`` reaches ``want`` (or the deadline)."""
    t = time.perf_counter()
    row = sampler.snap()
    while time.perf_counter() - t < deadline_s and row["blocks_stored"] < want:
        _timed(llm, other, 1)  # a step carries the worker's store report
        time.sleep(0.1)
        row = sampler.snap()
    return time.perf_counter() - t, row


def run(args, res: dict) -> dict:
    """Fills ``res`` as it goes (a run stopped midway still leaves its phases)."""
    import torch
    import vllm
    from vllm import LLM

    root = Path(tempfile.mkdtemp(prefix="gpu-store-"))
    stats = root / "tier-stats.json"
    # the connector refuses model runner V2 (kvzip_vllm.connector.require_rewinding_model_runner)
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    chunk = args.chunk_tokens
    t0 = time.perf_counter()
    llm = LLM(
        model=_model_dir(root),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=args.long + args.gen + 64,
        max_num_seqs=max(8, args.n_short),
        gpu_memory_utilization=args.gpu_mem,
        enable_prefix_caching=True,
        seed=0,
        **({"async_scheduling": False} if args.no_async_scheduling else {}),
        kv_transfer_config={
            "kv_connector": "KvzipConnector",
            "kv_connector_module_path": "kvzip_vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "budget_bytes": int(args.budget_gb * 1e9),
                "stats_path": str(stats),
                "fit_tokens": args.fit_tokens,
                "chunk_tokens": chunk,
            },
        },
    )
    init_s = time.perf_counter() - t0
    cfg = llm.llm_engine.vllm_config
    vocab = LLAMA31_8B["vocab_size"]
    other = prompts(1, 64, seed=1, vocab=vocab)
    longs = prompts(args.n_long, args.long, seed=100, vocab=vocab)
    shorts = prompts(args.n_short, args.short, seed=200, vocab=vocab)
    _timed(llm, other, 1)  # warm-up (no whole chunk)
    sampler = Sampler(stats, args.sample_s)
    sampler.start()
    res["phases"] = {}

    # phase A: long prompts back to back
    before = sampler.snap()
    per, outs_a = [], []
    ta = time.perf_counter()
    for p in longs:
        dt, outs = _timed(llm, [p], args.gen)
        per.append(round(dt, 3))
        outs_a += _ids(outs)
    seconds = time.perf_counter() - ta
    after = sampler.snap()
    want_a = args.n_long * (args.long // chunk)
    wait_s, row = _wait_stored(llm, sampler, want_a, args.store_deadline_s, other)
    res["phases"]["long_back_to_back"] = {
        "prompts": args.n_long,
        "tokens_each": args.long,
        "request_s": per,
        **_window(before, after, seconds, args.n_long * args.long),
        "chunks_expected": want_a,
        "chunks_stored": row["blocks_stored"],
        "stores_drained_after_s": round(wait_s, 2),
        "counters": row,
    }

    # phase B: short prompts at once
    before = sampler.snap()
    tb = time.perf_counter()
    dt, outs = _timed(llm, shorts, args.gen)
    seconds = time.perf_counter() - tb
    outs_b = _ids(outs)
    after = sampler.snap()
    want_b = want_a + args.n_short * (args.short // chunk)
    wait_s, row = _wait_stored(llm, sampler, want_b, args.store_deadline_s, other)
    res["phases"]["short_concurrent"] = {
        "prompts": args.n_short,
        "tokens_each": args.short,
        **_window(before, after, seconds, args.n_short * args.short),
        "chunks_expected": want_b - want_a,
        "chunks_stored": row["blocks_stored"] - want_a,
        "stores_drained_after_s": round(wait_s, 2),
        "counters": row,
    }
    _timed(llm, other, 1)  # one more step: the scheduler learns of the last stores

    # returning users: local hits (references), then restored from the tier
    back = {"long": longs[-1], "short": shorts[0]}
    returning = {}
    for name, p in back.items():
        recompute_s = per[-1] if name == "long" else None
        _, local = _timed(llm, [p], args.gen)
        s0 = _read(stats)
        llm.reset_prefix_cache()
        restore_s, _ = _timed(llm, [p], 1)  # time to first token, restored from the tier
        s1 = _read(stats)
        llm.reset_prefix_cache()
        _, restored = _timed(llm, [p], args.gen)  # restored again: its output
        returning[name] = {
            "tokens": len(p["prompt_token_ids"]),
            "restore_ttft_s": round(restore_s, 3),
            "recompute_request_s": recompute_s,
            "tokens_restored": s1.get("tokens_restored", 0) - s0.get("tokens_restored", 0),
            "output_equal_local_hit": _ids(restored) == _ids(local),
            "output_equal_first_run": _ids(restored)[0]
            == (outs_a[-1] if name == "long" else outs_b[0]),
        }
    sampler.halt.set()
    final = _read(stats)
    ca, cb = res["phases"]["long_back_to_back"], res["phases"]["short_concurrent"]
    res.update(
        {
            "scenario": "store_under_load",
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "python": platform.python_version(),
            "command": "python " + " ".join(sys.argv),
            "init_s": round(init_s, 1),
            "async_scheduling": bool(getattr(cfg.scheduler_config, "async_scheduling", False)),
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "cuda_graphs": not cfg.model_config.enforce_eager,
            "budget_bytes": int(args.budget_gb * 1e9),
            "chunk_tokens": chunk,
            "store_stream_priority": int(os.environ.get("KVZIP_STORE_STREAM_PRIORITY", "-1")),
            "returning": returning,
            "timeline": [
                {"t": round(t - ta, 2), **{k: v for k, v in r.items() if v}}
                for t, r in sampler.rows
            ],
            "tier_stats": final,
            "checks": {
                "every_whole_chunk_stored": ca["chunks_stored"] >= ca["chunks_expected"]
                and cb["chunks_stored"] >= cb["chunks_expected"],
                "none_dropped": final.get("stores_dropped_queue_full", 1) == 0
                and final.get("store_errors", 1) == 0
                and final.get("blocks_skipped", 1) == 0,
                "returning_restored": all(
                    r["tokens_restored"] >= r["tokens"] - chunk for r in returning.values()
                ),
                "returning_equal_local_hit": all(
                    r["output_equal_local_hit"] for r in returning.values()
                ),
                "store_at_least_2x_prefill": all(
                    (ph["store_busy_over_prefill"] or 0) >= 2 for ph in (ca, cb)
                ),
            },
        }
    )
    return res


def write_md(path: Path, r: dict) -> None:
    ph = r["phases"]
    lines = [
        "# kvzip tier: stores under load in vLLM (no store lost while the tier has room)",
        "",
        f"Device {r['gpu']}, {r['date']}, vLLM {r['vllm']}, torch {r['torch']}, "
        f"Python {r['python']}; Llama-3.1-8B shape (dummy weights), KvzipConnector, budget "
        f"{r['budget_bytes'] / 1e9:.0f} GB, chunks of {r['chunk_tokens']} tokens, "
        f"asynchronous scheduling {r['async_scheduling']}, CUDA graphs {r['cuda_graphs']}, "
        f"max_num_batched_tokens {r['max_num_batched_tokens']}, store stream priority "
        f"{r['store_stream_priority']}. Command: `{r['command']}`.",
        "",
        "| phase | prompts x tokens | prefill s | prefill tok/s | prefill KV GB/s | stored GB "
        "during | store GB/s (busy) | store GB/s (wall) | store busy / prefill | chunks "
        "stored / expected | drained after s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in ph.items():
        lines.append(
            f"| {name} | {p['prompts']} x {p['tokens_each']} | {p['prefill_s']} | "
            f"{p['prefill_tok_per_s']} | {p['prefill_kv_GBps']} | {p['stored_GB_during']} | "
            f"{p['store_GBps_busy']} | {p['store_GBps_wall']} | {p['store_busy_over_prefill']} "
            f"| {p['chunks_stored']} / {p['chunks_expected']} | {p['stores_drained_after_s']} |"
        )
    s = r["tier_stats"]
    lines += [
        "",
        "Counters at the end: "
        + ", ".join(
            f"{k} {s.get(k)}"
            for k in (
                "stores_spilled_host",
                "spill_peak_bytes",
                "stores_waited_queue_full",
                "store_wait_seconds",
                "stores_dropped_queue_full",
                "store_errors",
                "blocks_skipped",
                "store_queue_peak_bytes",
                "evictions",
                "blocks_stored",
                "ratio",
            )
        )
        + ".",
        "",
        "| returning | tokens | restore TTFT s | first request s | tokens restored | output = "
        "local hit |",
        "|---|---|---|---|---|---|",
    ]
    for name, x in r["returning"].items():
        lines.append(
            f"| {name} | {x['tokens']} | {x['restore_ttft_s']} | {x['recompute_request_s']} | "
            f"{x['tokens_restored']} | {x['output_equal_local_hit']} |"
        )
    lines += [
        "",
        "Checks: " + ", ".join(f"{k} {v}" for k, v in r["checks"].items()) + ".",
        "",
        "store GB/s (busy): bf16 bytes the tier coded during the phase's prefill over the store "
        "thread's busy time then (from a step's KV computed to its chunks held): its throughput "
        "while competing with the prefill; (wall): over the phase's prefill time; prefill KV "
        "GB/s: the bf16 KV the prefill produced (131072 B/token). The timeline of the counters "
        "is in the JSON.",
    ]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=os.environ.get("KVZIP_RESULTS_DIR", "."))
    p.add_argument("--name", default="gpu_store")
    p.add_argument("--long", type=int, default=130048, help="tokens of each long prompt")
    p.add_argument("--n-long", type=int, default=4)
    p.add_argument("--short", type=int, default=32768, help="tokens of each short prompt")
    p.add_argument("--n-short", type=int, default=8)
    p.add_argument("--gen", type=int, default=8)
    p.add_argument("--gpu-mem", type=float, default=0.6)
    p.add_argument("--budget-gb", type=float, default=56.0)
    p.add_argument("--fit-tokens", type=int, default=1024)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--store-deadline-s", type=float, default=120)
    p.add_argument("--sample-s", type=float, default=0.5)
    p.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="async_scheduling=False (default: vLLM's own choice, on where vLLM turns it on)",
    )
    args = p.parse_args()
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    root = Path(tempfile.mkdtemp(prefix="gpu-store-"))
    extra = plugin_path(root).split(os.pathsep)
    sys.path[:0] = extra
    os.environ["PYTHONPATH"] = os.pathsep.join([*extra, os.environ.get("PYTHONPATH", "")])
    res: dict = {"command": "python " + " ".join(sys.argv)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        run(args, res)
    except BaseException:  # (the phases done so far are written, with the error)
        import traceback

        res["error"] = traceback.format_exc()[-3000:]
        print(res["error"], flush=True)
    (out / f"{args.name}.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    if "error" not in res:
        write_md(out / f"{args.name}.md", res)
    print("RESULT " + json.dumps({k: v for k, v in res.items() if k != "timeline"}), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
