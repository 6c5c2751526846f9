"""benchmarks/tier_restore.py runs end to end on the CPU at a tiny size (the H200 run's code
path: the connector's pipeline storing and restoring chunks, the raw copy, the result files),
so the GPU run does not fail on a typo. Triton interpreted; synthetic KV."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the pipeline's decode kernel is a Triton kernel here")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "tier_restore.py"
FIELDS = ("context", "block_size", "restore_s", "raw_copy_s", "store_GBps", "ratio", "bit_exact")


def test_tier_restore_benchmark_runs_on_the_cpu(tmp_path):
    out = tmp_path / "tier_restore_cpu"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    args = ["--device", "cpu", "--contexts", "128", "--layers", "2", "--kv-heads", "2",
            "--head-dim", "16", "--chunk-tokens", "64", "--step-tokens", "64",
            "--repeats", "1", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.with_suffix(".json").read_text())
    (row,) = r["rows"]
    assert all(f in row for f in FIELDS), row
    assert row["context"] == 128 and row["block_size"] == 16 and row["chunk_tokens"] == 64
    assert row["bit_exact"] is True and row["failed_blocks"] == 0
    assert row["chunks_stored"] == row["chunks"] == 2 and row["evictions"] == 0
    assert row["ratio"] > 1.0 and row["store_GBps"] > 0 and row["restore_s"] > 0
    assert row["bytes_held"] <= row["arena_bytes"] <= row["raw_bytes"]
    for key in ("device", "date", "versions", "command"):
        assert r[key], key
    md = out.with_suffix(".md").read_text()
    assert "| 128 | 16 | 64 |" in md and r["command"] in md
    assert "context" in proc.stdout and "bit_exact" in proc.stdout  # the printed table


def test_tier_restore_benchmark_refuses_a_chunk_not_a_multiple_of_the_block(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--device",
            "cpu",
            "--chunk-tokens",
            "24",
            "--out",
            str(tmp_path / "x"),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "not a multiple of the block size" in proc.stderr
