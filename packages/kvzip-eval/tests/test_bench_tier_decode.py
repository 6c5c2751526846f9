"""``kvzip bench tier-decode`` without vLLM: the decoders' inter-token latency from token
timestamps, each tier's CPU bytes against the host's memory, a connector's row (the ITL ratio,
the decoders' ITL while storing, the longest wait for the store path, the store throughput over
the prefill's KV rate), the result files and the plot. The run in vLLM: kvzip-vllm's
tests/test_bench_vllm.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from kvzip_eval.bench import interference as itf
from kvzip_eval.bench import output
from kvzip_eval.cli import main


def test_itl_is_every_gap_between_a_requests_token_times():
    stamps = {"a": [0.0, 0.1, 0.2, 0.7], "b": [1.0, 1.1], "c": [5.0]}
    s = itf.itl_summary(stamps)
    # gaps: a 0.1, 0.1, 0.5; b 0.1; c none
    assert s["n"] == 4 and s["max_s"] == 0.5 and s["p50_s"] == pytest.approx(0.1)
    assert 0.1 < s["p99_s"] <= 0.5
    assert itf.itl_summary({"a": [1.0]}) == {"n": 0, "p50_s": None, "p99_s": None, "max_s": None}


BPT_8B = 131072  # Llama-3.1-8B's bf16 KV bytes per token
H200_HOST = 133 * 10**9  # the H200 host's MemAvailable (125 GiB of RAM)


def _opts(long_prompts=1, long_context=131072, cpu_bytes=None):
    return SimpleNamespace(long_prompts=long_prompts, long_context=long_context,
                           cpu_bytes=cpu_bytes)  # fmt: skip


def test_the_default_cpu_bytes_hold_the_long_and_flush_prompts_and_fit_the_host():
    long_n = 131072 - itf.CHUNK + 1
    cpu = itf.cpu_bytes_for(_opts(), BPT_8B, H200_HOST)
    # the raw pages of the long prompts and the flush prompts are 0.9x the bytes: both tiers
    # hold the returning prompts; the decoders' prompts (stored first) are not counted
    assert 0.9 * cpu == pytest.approx((1 + itf.FLUSH) * long_n * BPT_8B, rel=1e-9)
    assert cpu <= itf.HOST_FRACTION * H200_HOST
    # an explicit value within the host's share is taken as it is
    assert itf.cpu_bytes_for(_opts(cpu_bytes=10**9), BPT_8B, H200_HOST) == 10**9


def test_cpu_bytes_beyond_the_hosts_share_are_refused_with_the_numbers():
    # 4 long prompts of 128k ask for 114 GB: more than 0.45 of 133 GB
    with pytest.raises(ValueError) as e:
        itf.cpu_bytes_for(_opts(long_prompts=4), BPT_8B, H200_HOST)
    msg = str(e.value)
    assert "114.3 GB" in msg and "133.0 GB" in msg and "4 long prompts" in msg
    assert "--long-prompts" in msg and "--long-context" in msg
    assert f"at most {int(0.45 * H200_HOST)}" in msg
    # two long prompts (76 GB): the OffloadingConnector's engine killed on an H100 host
    with pytest.raises(ValueError, match=r"76\.2 GB"):
        itf.cpu_bytes_for(_opts(long_prompts=2), BPT_8B, H200_HOST)
    # the OffloadingConnector's engine killed at 105 GB: refused before any engine starts
    with pytest.raises(ValueError, match=r"105\.0 GB \(--cpu-bytes 105000000000\)"):
        itf.cpu_bytes_for(_opts(cpu_bytes=105 * 10**9), BPT_8B, H200_HOST)


def _gpu_opts(decoders=16, **kw):
    base = dict(long_context=131072, decode_context=32768, decode_tokens=7680,
                gpu_memory_utilization=0.9, decoders=decoders)  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def test_a_gpu_cache_past_the_gpu_is_refused_with_the_decoders_that_fit():
    from kvzip_eval.bench.engines import LLAMA31_8B

    # the 8B shape's weights: 8.03e9 parameters in bf16
    assert itf.weight_bytes(LLAMA31_8B) == pytest.approx(16.06e9, rel=0.01)
    h200, h100 = 143771 * 2**20, 81559 * 2**20  # total memory as nvidia-smi reports it
    itf.check_gpu_fits(_gpu_opts(), LLAMA31_8B, BPT_8B, h200)  # the defaults fit an H200
    # on an H100 vLLM was handed 48,626 blocks (102 GB) and ran out of memory allocating them
    assert -(-itf.gpu_cache_tokens(_gpu_opts()) // 16) == 48626
    with pytest.raises(ValueError) as e:
        itf.check_gpu_fits(_gpu_opts(), LLAMA31_8B, BPT_8B, h100)
    msg = str(e.value)
    assert "778001 tokens" in msg and "102.0 GB" in msg and "16 decoders" in msg
    fit = int(msg.split("at most ")[1].split()[0])
    assert 0 < fit < 16
    itf.check_gpu_fits(_gpu_opts(decoders=fit), LLAMA31_8B, BPT_8B, h100)  # what it names fits
    with pytest.raises(ValueError):
        itf.check_gpu_fits(_gpu_opts(decoders=fit + 1), LLAMA31_8B, BPT_8B, h100)


def test_the_host_memory_is_read():
    assert 0 < itf.available_memory()


def _engine(conn, q99, r99, store_gbps=None, waits=(3.0, 7.0, 2.0), tier=None, s99=0.05):
    return {
        "connector": conn,
        "stores": {"long_kv_rate_GBps": 4.0, "decoders_kv_rate_GBps": 5.0,
                   "wait_for_save_max_ms_long": waits[0],
                   "wait_for_save_max_ms_decoders": waits[1], "store_GBps": store_gbps},
        "wait_for_save_max_ms_windows": waits[2],
        "itl_quiet": {"p50_s": 0.02, "p99_s": q99}, "itl_returns": {"p50_s": 0.021, "p99_s": r99},
        "itl_stores": {"p50_s": 0.025, "p99_s": s99},
        "itl_p99_ratio": round(r99 / q99, 3), "returns": {"n": 3, "ttft_p50_s": 0.3},
        "tier": tier,
    }  # fmt: skip


def test_a_row_takes_the_faster_prefill_rate_and_the_longest_wait():
    tier = {"stores_dropped_queue_full": 1, "store_errors": 0, "blocks_skipped": 2}
    r = itf.decode_row(_engine("kvzip", 0.03, 0.036, store_gbps=11.0, tier=tier))
    assert r["itl_p99_ratio"] == 1.2 and r["wait_for_save_max_ms"] == 7.0
    assert r["store_over_prefill_kv_rate"] == round(11.0 / 5.0, 3)  # the faster prefill
    assert r["stores_dropped"] == 3 and r["returns"] == 3 and r["error"] is None
    off = itf.decode_row(_engine("offload", 0.03, 0.09))
    assert off["store_over_prefill_kv_rate"] is None and off["stores_dropped"] is None
    failed = itf.decode_row({"connector": "offload", "error": "rc 1: boom"})
    assert failed["itl_p99_ratio"] is None and failed["error"] == "rc 1: boom"
    assert failed["itl_p99_stores_s"] is None


def test_a_row_has_the_decoders_itl_while_storing_and_the_flush_prompts_waits():
    e = _engine("kvzip", 0.03, 0.036, s99=0.08)
    e["stores"]["wait_for_save_max_ms_flush"] = 61.0
    r = itf.decode_row(e)
    assert r["itl_p99_stores_s"] == 0.08 and r["wait_for_save_max_ms"] == 61.0


def test_result_files_and_plot(tmp_path):
    engs = [_engine("kvzip", 0.03, 0.033, 12.0, tier={}), _engine("offload", 0.03, 0.06)]
    rows = [itf.decode_row(e) for e in engs]
    doc = output.header("tier-decode", "what returns cost the decoders", "CPU (test)")
    doc.update(model="m", rows=rows, engines=engs,
               workload={"long_prompts": 2, "long_context": 1024, "decoders": 2,
                         "decode_context": 512, "window_s": 4.0, "return_every_s": 1.5,
                         "cpu_bytes": 10**9, "kv_bytes_per_token": 23040})  # fmt: skip
    paths = output.write(tmp_path, "bench_tier_decode", doc, itf._markdown(doc),
                         lambda ax: itf._plot(ax, rows))  # fmt: skip
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    md = paths["md"].read_text()
    assert "| kvzip | 0.02 | 0.03 | 0.021 | 0.033 | 1.1 | 0.05 |" in md
    assert "ITL p99 storing s" in md and "stored one at a time" in md
    assert json.loads(paths["json"].read_text())["rows"][1]["itl_p99_ratio"] == 2.0


def test_help_says_what_it_measures_and_bad_input_is_refused():
    r = CliRunner().invoke(main, ["bench", "tier-decode", "--help"])
    assert r.exit_code == 0 and "inter-token latency" in r.output and "--decoders" in r.output
    r = CliRunner().invoke(main, ["bench", "tier-decode", "--connectors", "lmcache"])
    assert r.exit_code != 0 and "one of offload, kvzip, none" in r.output
    r = CliRunner().invoke(main, ["bench", "tier-decode", "--long-context", "1000"])
    assert r.exit_code != 0 and "multiples of 256" in r.output


def test_cpu_bytes_the_host_cannot_give_are_refused_before_any_engine(tmp_path):
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["bench", "tier-decode", "--cpu-bytes", str(10**16),
                                  "--out", str(out)])  # fmt: skip
    assert r.exit_code == 2 and r.exception is not None and "Traceback" not in r.output
    assert "--cpu-bytes 10000000000000000" in r.output and "available memory" in r.output
    assert not list(out.glob("*.log"))  # no engine started
