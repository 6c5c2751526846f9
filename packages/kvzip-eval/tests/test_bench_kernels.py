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


def test_graph_timing_needs_a_cuda_device(tmp_path):
    """--timing graph captures each call in a CUDA graph: refused before any work where there
    is no CUDA device, naming what runs instead."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: graph timing runs here")
    res = CliRunner().invoke(main, ["bench", "kernels", "--timing", "graph",
                                    "--out", str(tmp_path / "k")])  # fmt: skip
    assert res.exit_code == 2, res.output
    assert "no CUDA device" in res.output and "eager" in res.output
    assert not (tmp_path / "k").exists()


@pytest.mark.gpu
def test_graph_timing_times_the_replays_of_the_same_call(tmp_path):
    """On a GPU: a plan's call captures in a CUDA graph (no host synchronisation inside) and
    its replay takes no longer than the eager call (the host's work is what the graph removes)."""
    import functools

    import torch

    from kvzip_eval.bench.kernels import timer
    from kvzip_formats import get_format
    from kvzip_formats.ops import PagedLayout
    from kvzip_kernels.decode_plan import plan
    from kvzip_kernels.testing import synthetic_calibration

    dev = torch.device("cuda")
    fmt = get_format("4bit", calibration=synthetic_calibration(1, 128))
    B, ctx, ps = 8, 4096, 16
    pools = [torch.randint(0, 255, (B * ctx // ps, 1, PagedLayout.of(fmt, 128, ps, k).page_bytes),
                           dtype=torch.uint8, device=dev) for k in ("k", "v")]  # fmt: skip
    for pool in pools:  # finite scales: random fp16 bytes may be NaN
        pool.view(torch.float16).nan_to_num_(0.0).clamp_(-1, 1)
    bt = torch.arange(B * ctx // ps, device=dev, dtype=torch.int32).view(B, -1)
    sl = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(B, 8, 128, device=dev, dtype=torch.bfloat16)
    p = plan(fmt, num_q_heads=8, head_dim=128, block_table=bt, seq_lens=sl, k_cache=pools[0],
             v_cache=pools[1], block_size=ps, max_seq_len=ctx)  # fmt: skip
    out = torch.empty_like(q)
    fn = functools.partial(p.run, q, *pools, out=out)
    eager = timer(torch, dev)(fn, 10, 2)
    graphed = timer(torch, dev, graph=True)(fn, 10, 2)
    assert 0 < graphed <= eager * 1.1


def test_kernel_keys_per_cuda_design():
    """One row per backend; the CUDA kernel once per design, the design in the key when more
    than the shipped choice (auto) is timed."""
    from kvzip_eval.bench.kernels import kernel_keys

    assert kernel_keys(["triton", "cuda"], "4bit") == [
        ("kvzip-triton-4bit", "triton", "auto"), ("kvzip-cuda-4bit", "cuda", "auto")]  # fmt: skip
    assert kernel_keys(["triton", "cuda"], "3.5bit", ["v6", "v7"]) == [
        ("kvzip-triton-3.5bit", "triton", "auto"), ("kvzip-cuda-v6-3.5bit", "cuda", "v6"),
        ("kvzip-cuda-v7-3.5bit", "cuda", "v7")]  # fmt: skip
    assert kernel_keys(["cuda"], "int4", ["v7s4"]) == [("kvzip-cuda-v7s4-int4", "cuda", "v7s4")]
    assert kernel_keys(["triton"], "int4", ["v6", "v7"]) == [
        ("kvzip-triton-int4", "triton", "auto")
    ]


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
    md = (out / "bench_kernels.md").read_text()
    assert "| tiny | 2 | 256 | kvzip-triton-int4 |" in md
    assert doc["settings"]["timing"] == "eager" and "each call eager" in md
