r"""What the shared tier costs: server memory per stored block beyond its blobs, the value
format's bytes, and put / get / probe times over loopback, on a real ``redis-server``.

    python packages/kvzip-vllm/benchmarks/shared_store_costs.py \
        --out results/vllm/shared_store_costs

Blocks are 2 x ``layers`` random blobs of ``blob_bytes`` each (the store never looks inside a
blob, so random bytes time it as well as real ones).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from redis_server import RedisServer  # noqa: E402

from kvzip_vllm.shared_store import SharedBlobStore, decode_value, encode_value  # noqa: E402

CASES = [  # (name, layers, blob bytes)
    ("16 layers x 2 kinds x 4 KiB", 16, 4 << 10),
    ("32 layers x 2 kinds x 22 KiB", 32, 22 << 10),
]


def _ms(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {
        "p50_ms": round(1e3 * statistics.median(xs), 3),
        "p95_ms": round(1e3 * xs[int(0.95 * (len(xs) - 1))], 3),
    }


def run_case(srv: RedisServer, name: str, layers: int, blob_bytes: int, n: int) -> dict:
    raw = redis.Redis.from_url(srv.url, protocol=2)
    raw.flushall()
    st = SharedBlobStore(srv.url, 4 << 30, namespace="bench")
    blocks = [[os.urandom(blob_bytes) for _ in range(2 * layers)] for _ in range(n)]
    keys = [i.to_bytes(32, "little") for i in range(n)]
    value_bytes = len(encode_value(st.redis_key(keys[0]), blocks[0]))
    blob_total = 2 * layers * blob_bytes

    # warm the connection and the client's query buffer, then measure memory per value
    st.put(b"warm" * 8, blocks[0])
    raw.delete(st.redis_key(b"warm" * 8))
    mem0 = raw.info("memory")["used_memory"]
    put_s = []
    for k, b in zip(keys, blocks, strict=True):
        t0 = time.perf_counter()
        assert st.put(k, b)
        put_s.append(time.perf_counter() - t0)
    mem1 = raw.info("memory")["used_memory"]
    get_s = []
    for k, b in zip(keys, blocks, strict=True):
        t0 = time.perf_counter()
        got = st.get(k)
        get_s.append(time.perf_counter() - t0)
        assert got == b
    probe_s = []
    for _ in range(50):
        t0 = time.perf_counter()
        assert all(st.contains_many(keys[:64]))
        probe_s.append(time.perf_counter() - t0)
    rkey = st.redis_key(keys[0])
    enc_s, dec_s = [], []
    for _ in range(20):
        t0 = time.perf_counter()
        v = encode_value(rkey, blocks[0])
        enc_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        decode_value(rkey, v)
        dec_s.append(time.perf_counter() - t0)
    st.close()
    per_value = (mem1 - mem0) / n
    return {
        "case": name,
        "blocks": n,
        "blobs_per_block": 2 * layers,
        "blob_bytes_per_block": blob_total,
        "value_bytes": value_bytes,
        "format_overhead_bytes": value_bytes - blob_total,
        "server_bytes_per_block": round(per_value),
        "server_overhead_vs_value": round(per_value / value_bytes - 1, 4),
        "put": _ms(put_s),
        "get": _ms(get_s),
        "contains_many_64": _ms(probe_s),
        "encode_with_digest": _ms(enc_s),
        "decode_with_digest": _ms(dec_s),
        "get_MBps_p50": round(value_bytes / statistics.median(get_s) / 1e6, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="path without extension (.json and .md)")
    p.add_argument("--blocks", type=int, default=200)
    args = p.parse_args()
    server_version = subprocess.run(
        ["redis-server", "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    with RedisServer() as srv:
        rows = [run_case(srv, name, L, b, args.blocks) for name, L, b in CASES]
    meta = {
        "device": f"cpu ({platform.machine()}), {os.cpu_count()} cores visible, loopback TCP",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "redis_py": redis.__version__,
        "redis_server": server_version,
        "command": "python packages/kvzip-vllm/benchmarks/shared_store_costs.py "
        f"--out {args.out} --blocks {args.blocks}",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({**meta, "cases": rows}, indent=2) + "\n")
    lines = [
        "# kvzip-vllm shared tier: what a block costs on the Redis server and per call",
        "",
        f"{meta['device']}, {meta['date']}, Python {meta['python']}, redis-py "
        f"{meta['redis_py']}, {meta['redis_server']}; `{meta['command']}`",
        "",
        "| block | value bytes | format overhead | server bytes per block | server overhead "
        "| put p50 / p95 ms | get p50 / p95 ms | contains_many(64) p50 ms "
        "| digest encode / decode p50 ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['value_bytes']} | {r['format_overhead_bytes']} B "
            f"| {r['server_bytes_per_block']} | {100 * r['server_overhead_vs_value']:.2f}% "
            f"| {r['put']['p50_ms']} / {r['put']['p95_ms']} "
            f"| {r['get']['p50_ms']} / {r['get']['p95_ms']} "
            f"| {r['contains_many_64']['p50_ms']} "
            f"| {r['encode_with_digest']['p50_ms']} / {r['decode_with_digest']['p50_ms']} |"
        )
    lines += [
        "",
        "Server bytes per block: Redis `used_memory` growth over the blocks stored, divided by "
        "their number (per-key bookkeeping and allocator rounding included: jemalloc serves a "
        "large value from a size class, four per power of two, so a value just past a class "
        "boundary takes up to 25% more). Times on a "
        "machine whose 2 cores other jobs share: noisy, and loopback only (no network).",
        "",
    ]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
