"""``kvzip bench kernels`` end to end on the CPU: the Triton path interpreted on a tiny shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from kvzip_eval.cli import main


def test_bench_kernels_help_says_what_it_measures():
    res = CliRunner().invoke(main, ["bench", "kernels", "--help"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    for words in ("paged decode attention beside the fp8 decode kernels", "share of HBM",
                  "XQA", "--peak-tbps", "--cuda-variants",
                  "kvzip-cuda-<design>-<fmt>"):  # fmt: skip
        assert words in text, words


def test_bench_kernels_refuses_an_unknown_cuda_design(tmp_path):
    """--cuda-variants names designs of the CUDA kernel; anything else stops before any work,
    naming the designs there are."""
    res = CliRunner().invoke(main, ["bench", "kernels", "--cuda-variants", "v6,v8",
                                    "--out", str(tmp_path / "k")])  # fmt: skip
    assert res.exit_code == 2, res.output
    assert "v8" in res.output and "v6, v7, v7s4" in res.output
    assert not (tmp_path / "k").exists()


def test_kernel_keys_per_cuda_design():
    """One row per backend; the CUDA kernel once per design, the design in the key when more
    than the shipped v6 is timed (the key of the v6-only runs is kept)."""
    from kvzip_eval.bench.kernels import kernel_keys

    assert kernel_keys(["triton", "cuda"], "4bit") == [
        ("kvzip-triton-4bit", "triton", "v6"), ("kvzip-cuda-4bit", "cuda", "v6")]  # fmt: skip
    assert kernel_keys(["triton", "cuda"], "3.5bit", ["v6", "v7"]) == [
        ("kvzip-triton-3.5bit", "triton", "v6"), ("kvzip-cuda-v6-3.5bit", "cuda", "v6"),
        ("kvzip-cuda-v7-3.5bit", "cuda", "v7")]  # fmt: skip
    assert kernel_keys(["cuda"], "int4", ["v7s4"]) == [("kvzip-cuda-v7s4-int4", "cuda", "v7s4")]
    assert kernel_keys(["triton"], "int4", ["v6", "v7"]) == [("kvzip-triton-int4", "triton", "v6")]


def test_bench_kernels_on_the_cpu(tmp_path):
    """The Triton path interpreted on a tiny shape: kvzip's fp8 is the baseline where no fp8
    library runs (the CPU), the rows carry their bytes, speed and share, the plot is made."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    out = tmp_path / "k"
    cmd = [sys.executable, "-m", "kvzip_eval", "bench", "kernels", "--shapes", "tiny",
           "--batches", "2", "--contexts", "256", "--formats", "fp8,int4,4bit", "--iters", "2",
           "--warmup", "1", "--cuda-variants", "v6,v7", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "bench_kernels.json").read_text())
    assert doc["result"] == "bench-kernels" and doc["command"].startswith("kvzip bench kernels")
    by = {r["kernel"]: r for r in doc["rows"]}
    assert set(by) == {"kvzip-triton-fp8", "kvzip-triton-int4", "kvzip-triton-4bit"}
    assert doc["settings"]["cuda_variants"] == ["v6", "v7"]  # no CUDA backend on the CPU
    assert by["kvzip-triton-fp8"]["baseline"] and by["kvzip-triton-fp8"]["speedup_vs_best_fp8"] == 1
    assert set(doc["skipped"]) == {"xqa", "flashinfer-fp8", "vllm-fa3-fp8"}
    # bytes read: batch x context x KV heads x (K + V bytes per token and head)
    assert by["kvzip-triton-fp8"]["cache_bytes"] == 2 * 256 * 2 * (64 + 64)
    assert by["kvzip-triton-4bit"]["cache_bytes"] < by["kvzip-triton-int4"]["cache_bytes"] < (
        by["kvzip-triton-fp8"]["cache_bytes"])  # fmt: skip
    for r in doc["rows"]:
        assert r["us"] > 0 and r["pct_hbm"] is None  # no HBM peak for a CPU
        assert r["speedup_vs_best_fp8"] == pytest.approx(
            by["kvzip-triton-fp8"]["us"] / r["us"], rel=0.02)  # fmt: skip
    assert (out / "bench_kernels.png").read_bytes()[:4] == b"\x89PNG"
    assert "| tiny | 2 | 256 | kvzip-triton-int4 |" in (out / "bench_kernels.md").read_text()
