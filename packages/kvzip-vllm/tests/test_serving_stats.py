"""The serving benchmark's arithmetic on the CPU (``benchmarks/serving_stats.py``) and its
reports: medians and spreads of repeated runs, ratios beside fp8 run by run, the per-run
diagnostics (step times, GPU samples, CUDA-graph padding), a stage's log parsed into runs,
``bench_serving.write`` and ``merge_serving.merge`` over calls with their own fp8 runs."""

from __future__ import annotations

import json
import statistics
import sys
from argparse import Namespace
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_serving  # noqa: E402
import merge_serving  # noqa: E402
import serving_stats as st  # noqa: E402


def _run(fmt, ctx, rep, decode, sessions=10, prefill=None, ms=None, **extra):
    return {"format": fmt, "context": ctx, "rep": rep, "sessions": sessions,
            "decode_tok_s": decode, "prefill_tok_s": prefill,
            "ms_per_step": ms if ms is not None else round(1000 * sessions / decode, 2),
            "kv_tokens": 1000 * sessions, **extra}  # fmt: skip


def test_quantile_matches_linear_interpolation_and_refuses_bad_input():
    xs = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    for q, want in ((0.0, 1.0), (1.0, 9.0), (0.5, statistics.median(xs))):
        assert st.quantile(xs, q) == pytest.approx(want)
    # statistics.quantiles(method="inclusive") interpolates the same order statistics
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    assert st.quantile(xs, 0.25) == pytest.approx(q1) and st.quantile(xs, 0.75) == pytest.approx(q3)
    with pytest.raises(ValueError, match="no values"):
        st.quantile([], 0.5)
    with pytest.raises(ValueError, match=r"q must be in \[0, 1\]"):
        st.quantile([1.0], 1.5)


def test_spread_of_three_runs_is_their_median_range_and_iqr():
    sp = st.spread([392.0, 464.0, 450.0])  # the two 4bit runs and a third
    assert sp["n"] == 3 and sp["median"] == 450.0 and (sp["min"], sp["max"]) == (392.0, 464.0)
    assert sp["q1"] == 421.0 and sp["q3"] == 457.0
    assert sp["rel_range"] == pytest.approx(72 / 450, abs=1e-4)
    assert sp["rel_iqr"] == pytest.approx(36 / 450, abs=1e-4)
    assert st.spread([None, 5.0])["n"] == 1 and st.spread([None, None]) is None


def test_step_times_leave_out_the_fill_steps():
    steps = [2.0, 0.9] + [0.050] * 8 + [0.060, 0.100]  # seconds: fill, wait, 10 decode steps
    s = st.summarize_steps(steps)
    assert s["n"] == 10 and s["skipped"] == 2
    assert s["p50"] == 50.0 and s["max"] == 100.0
    assert s["p10"] == 50.0 and s["p90"] == pytest.approx(64.0)
    assert st.summarize_steps([1.0, 2.0]) is None


def test_gpu_samples_and_throttle_reasons():
    samples = [
        {"sm_mhz": 1980, "mem_mhz": 3201, "temp_c": 40, "power_w": 300.0, "throttle": 0},
        {"sm_mhz": 1755, "mem_mhz": 3201, "temp_c": 47, "power_w": 500.0, "throttle": 0x4},
        {"sm_mhz": None, "mem_mhz": None, "temp_c": None, "power_w": None, "throttle": 0x40},
    ]
    g = st.summarize_gpu(samples)
    assert (g["sm_mhz_min"], g["sm_mhz_max"], g["temp_c_max"]) == (1755, 1980, 47)
    assert g["power_w_mean"] == 400.0 and g["samples"] == 3
    assert g["throttle"] == ["sw_power_cap", "hw_thermal_slowdown"]
    assert st.throttle_names(0x1000 | 0x1) == ["gpu_idle", "0x1000"]
    assert st.summarize_gpu([]) is None


def test_a_decode_batch_pads_to_the_next_captured_graph_size():
    sizes = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128]
    assert st.padded_batch(25, sizes) == 32 and st.padded_batch(103, sizes) == 104
    assert st.padded_batch(8, sizes) == 8
    assert st.padded_batch(129, sizes) is None and st.padded_batch(3, []) is None


def test_rows_are_medians_and_ratios_are_beside_fp8_run_by_run():
    runs = [
        _run("fp8", 131072, 0, 266.0, sessions=13, prefill=30000),
        _run("fp8", 131072, 1, 270.0, sessions=13, prefill=30400),
        _run("fp8", 131072, 2, 250.0, sessions=13, prefill=29000),
        _run("4bit", 131072, 0, 392.0, sessions=25, prefill=26000),
        _run("4bit", 131072, 1, 464.0, sessions=25, prefill=26500),
        _run("4bit", 131072, 2, 450.0, sessions=25, prefill=25000),
        _run("3bit", 131072, 0, 360.0, sessions=34),
    ]
    rows = st.add_ratios(st.aggregate(runs))
    by = {r["format"]: r for r in rows}
    assert [r["format"] for r in rows] == ["fp8", "4bit", "3bit"]
    assert by["fp8"]["decode_tok_s"] == 266.0 and by["4bit"]["decode_tok_s"] == 450.0
    assert by["4bit"]["prefill_tok_s"] == 26000 and by["4bit"]["n_runs"] == 3
    assert by["4bit"]["complete"] and not by["3bit"]["complete"]
    assert by["4bit"]["decode_vs_fp8"] == round(450 / 266, 3)
    assert by["4bit"]["sessions_vs_fp8"] == round(25 / 13, 3)
    paired = by["4bit"]["decode_vs_fp8_paired"]  # 392/266, 464/270, 450/250
    assert paired["n"] == 3 and paired["median"] == pytest.approx(464 / 270, abs=1e-4)
    assert paired["min"] == pytest.approx(392 / 266) and paired["max"] == pytest.approx(1.8)
    assert by["3bit"]["decode_vs_fp8_paired"]["n"] == 1  # only repeat 0 has a pair
    assert [r["rep"] for r in by["4bit"]["runs"]] == [0, 1, 2]
    assert by["4bit"]["spread"]["decode_tok_s"]["rel_range"] == pytest.approx(72 / 450, abs=1e-4)
    assert "decode_vs_fp8_paired" not in by["fp8"] and by["fp8"]["decode_vs_fp8"] == 1.0


def test_step_figures_are_sessions_over_the_median_step_beside_fp8_per_user():
    # decode_tok_s subtracts two timed generates (each with its own fill): noisy; the step
    # figure is sessions over the median engine step of each run
    runs = [
        _run("fp8", 131072, i, d, sessions=13, decode_tok_s_at_p50_step=s)
        for i, (d, s) in enumerate([(262.9, 265.3), (283.6, 265.4), (284.5, 266.2)])
    ] + [
        _run("4bit", 131072, i, d, sessions=25, decode_tok_s_at_p50_step=s)
        for i, (d, s) in enumerate([(645.4, 550.7), (545.9, 548.4), (557.9, 550.3)])
    ]
    by = {r["format"]: r for r in st.add_ratios(st.aggregate(runs))}
    assert by["4bit"]["step_tok_s"] == 550.3 and by["fp8"]["step_tok_s"] == 265.4
    assert by["4bit"]["spread"]["step_tok_s"]["rel_range"] == pytest.approx(2.3 / 550.3, abs=1e-4)
    assert by["4bit"]["step_vs_fp8"] == round(550.3 / 265.4, 3)
    assert by["4bit"]["per_user_vs_fp8"] == round(round(550.3 / 265.4, 3) / round(25 / 13, 3), 3)
    # runs without step times: no step figure, no ratio
    bare = st.add_ratios(st.aggregate([_run("fp8", 8, 0, 1.0), _run("4bit", 8, 0, 2.0)]))
    assert all(r["step_tok_s"] is None and "step_vs_fp8" not in r for r in bare)


def test_runs_of_different_fills_are_not_one_figure():
    with pytest.raises(ValueError, match="different sessions"):
        st.aggregate([_run("4bit", 32768, 0, 1.0, sessions=103), _run("4bit", 32768, 1, 1.0)])
    with pytest.raises(ValueError, match="without 'decode_tok_s'"):
        st.aggregate([{"format": "fp8", "context": 1, "sessions": 1}])


def test_a_stage_log_becomes_runs_with_their_repeat_prefill(tmp_path):
    lines = ["noise", "INFO " + json.dumps({"format": "4bit", "init_s": 50.0})]
    for rep in range(2):
        for ctx in (32768, 131072):
            lines.append("RUN " + json.dumps(_run("4bit", ctx, rep, 100.0 + rep)))
        lines.append("PREFILL " + json.dumps(
            {"format": "4bit", "context": 32768, "rep": rep, "prefill_tok_s": 25000 + rep,
             "prefill_s": 1.3}))  # fmt: skip
    infos, runs = bench_serving.parse_log("\n".join(lines))
    assert infos == [{"format": "4bit", "init_s": 50.0}] and len(runs) == 4
    pre = {(r["context"], r["rep"]): r["prefill_tok_s"] for r in runs}
    assert pre == {(32768, 0): 25000, (32768, 1): 25001, (131072, 0): None, (131072, 1): None}


def test_a_second_engine_of_a_format_continues_its_repeats():
    first = [_run("fp8", c, i, 1.0) for i in range(3) for c in (32768, 131072)]
    later = [_run("fp8", c, i, 1.0) for i in range(2) for c in (32768, 131072)]
    other = [_run("4bit", 32768, 0, 1.0)]
    bench_serving.continue_reps(first + [_run("4bit", 32768, 0, 1.0)], later + other)
    assert [(r["context"], r["rep"]) for r in later] == [
        (32768, 3), (131072, 3), (32768, 4), (131072, 4)
    ]  # fmt: skip
    assert other[0]["rep"] == 1
    rows = st.add_ratios(st.aggregate(first + later))
    assert all(r["n_runs"] == 5 for r in rows)


def test_bench_serving_writes_medians_runs_and_the_schedule(tmp_path):
    runs = []
    for rep, (f, k) in enumerate(((266.0, 392.0), (270.0, 464.0), (250.0, 450.0))):
        diag = {"step_ms": {"n": 62, "skipped": 2, "p10": 50.0, "p50": 51.0, "p90": 60.0,
                            "max": 70.0},
                "gpu": {"during": {"sm_mhz_min": 1755, "sm_mhz_max": 1980, "temp_c_max": 50,
                                   "power_w_mean": 450.0, "throttle": ["sw_power_cap"]}},
                "plans": [{"batch": 25, "splits": 64, "tokens_per_split": 2048,
                           "kernel": "cuda", "plans": 65}],
                "graphs": {"padded_batch": 32, "replays_per_step": 33.0},
                "fill": {"running_min": 25, "running_max": 25},
                "decode_calls": {"4bit:cuda": 2080}}  # fmt: skip
        runs.append(_run("fp8", 131072, rep, f, sessions=13, engine=0, order=rep))
        runs.append(_run("4bit", 131072, rep, k, sessions=25, engine=1, order=rep, **diag))
    args = Namespace(repeats=3, tiny=False)
    engines = [{"gpu": "NVIDIA H200", "gpu_uuid": "GPU-1", "vllm": "0.26.0", "torch": "2.11"}]
    bench_serving.write(tmp_path, runs, engines, [], args)
    doc = json.loads((tmp_path / "bench_serving.json").read_text())
    by = {r["format"]: r for r in doc["rows"]}
    assert by["4bit"]["decode_tok_s"] == 450.0 and by["4bit"]["decode_vs_fp8"] == 1.692
    assert len(by["4bit"]["runs"]) == 3 and by["4bit"]["spread"]["decode_tok_s"]["min"] == 392.0
    assert doc["gpu_uuids"] == ["GPU-1"] and "one engine at a time" in doc["schedule"]
    md = (tmp_path / "bench_serving.md").read_text()
    assert "| 4bit | 131072 | 25,000 | 25 | 1.923 | 450.0 | 392-464 (16.0%) | 1.692 |" in md
    assert "| 4bit | 131072 | 2 |" in md and "64x2048" in md and "1755-1980" in md


def _call(date, rows, uuid="GPU-1"):
    return {"what": "w", "date": date, "command": f"bench {date}", "device": "NVIDIA H200",
            "gpu_uuids": [uuid], "versions": {"vllm": "v"}, "model": "m", "method": "x",
            "schedule": "s", "rows": st.add_ratios(st.aggregate(rows)), "failures": []}  # fmt: skip


def test_merge_takes_ratios_beside_the_fp8_of_the_same_call_and_pools_fp8():
    c0 = _call(
        "t0",
        [_run("fp8", 1, i, d, sessions=13) for i, d in enumerate((260, 266, 270))]
        + [_run("4bit", 1, i, d, sessions=25) for i, d in enumerate((450, 460, 470))],
    )
    c1 = _call("t1", [_run("fp8", 1, i, d, sessions=13) for i, d in enumerate((230, 240, 250))]
               + [_run("3bit", 1, i, d, sessions=34) for i, d in enumerate((330, 340, 350))]
               + [_run("4bit", 1, 0, 999.0, sessions=25)])  # fmt: skip
    res = merge_serving.merge([c0, c1])
    by = {r["format"]: r for r in res["rows"]}
    assert [r["format"] for r in res["rows"]] == ["fp8", "4bit", "3bit"]
    assert by["3bit"]["fp8_run"] == 1 and by["3bit"]["decode_vs_fp8"] == round(340 / 240, 3)
    assert by["4bit"]["run"] == 0 and by["4bit"]["decode_vs_fp8"] == round(460 / 266, 3)
    assert by["fp8"]["n_runs"] == 6 and by["fp8"]["decode_tok_s"] == 255.0
    assert by["fp8"]["fp8_by_run"] == {"0": 266.0, "1": 240.0}
    assert res["same_gpu"] is True and res["fp8_runs"] == [0, 1]
    md = merge_serving.markdown(res, "merge x")
    assert "the same GPU in every call" in md and "{'0': 266.0, '1': 240.0}" in md
    res2 = merge_serving.merge([c0, _call("t1", c1["rows"][0]["runs"], uuid="GPU-2")])
    assert res2["same_gpu"] is False
    assert "DIFFERENT GPUs" in merge_serving.markdown(res2, "m")
