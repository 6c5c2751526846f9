"""``kvzip bench serving`` without vLLM or a GPU: medians and spreads of runs, one user's speed,
ratios beside fp8 run by run, calls merged, the result files and the plot; and the help of
``kvzip bench``. The runs in vLLM: kvzip-vllm's tests/test_bench_vllm.py."""

from __future__ import annotations

import json
import statistics

import pytest
from click.testing import CliRunner

from kvzip_eval.bench import output, serving
from kvzip_eval.bench import stats as st
from kvzip_eval.cli import main


def _run(fmt, ctx, rep, decode, sessions=10, prefill=None, ms=None, **extra):
    return {"format": fmt, "context": ctx, "rep": rep, "sessions": sessions,
            "decode_tok_s": decode, "prefill_tok_s": prefill,
            "ms_per_step": ms if ms is not None else round(1000 * sessions / decode, 2),
            "kv_tokens": 1000 * sessions, **extra}  # fmt: skip


# ------------------------------------------------------------------ serving arithmetic
def test_quantile_matches_linear_interpolation_and_refuses_bad_input():
    xs = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    for q, want in ((0.0, 1.0), (1.0, 9.0), (0.5, statistics.median(xs))):
        assert st.quantile(xs, q) == pytest.approx(want)
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    assert st.quantile(xs, 0.25) == pytest.approx(q1) and st.quantile(xs, 0.75) == pytest.approx(q3)
    with pytest.raises(ValueError, match="no values"):
        st.quantile([], 0.5)
    with pytest.raises(ValueError, match=r"q must be in \[0, 1\]"):
        st.quantile([1.0], 1.5)
    np = pytest.importorskip("numpy")
    for q in (50, 90, 10):
        assert st.percentile([0.3, 0.1, 0.7, 0.2, 0.9], q) == pytest.approx(
            float(np.percentile([0.3, 0.1, 0.7, 0.2, 0.9], q)))  # fmt: skip
    assert st.percentile([], 50) is None


def test_spread_of_three_runs_is_their_median_range_and_iqr():
    sp = st.spread([392.0, 464.0, 450.0])
    assert sp["n"] == 3 and sp["median"] == 450.0 and (sp["min"], sp["max"]) == (392.0, 464.0)
    assert sp["q1"] == 421.0 and sp["q3"] == 457.0
    assert sp["rel_range"] == pytest.approx(72 / 450, abs=1e-4)
    assert sp["rel_iqr"] == pytest.approx(36 / 450, abs=1e-4)
    assert st.spread([None, 5.0])["n"] == 1 and st.spread([None, None]) is None
    assert st.fmt_spread(sp) == "392-464 (16.0%)" and st.fmt_spread(None) == ""


def test_step_times_gpu_samples_and_graph_padding():
    steps = [2.0, 0.9] + [0.050] * 8 + [0.060, 0.100]  # seconds: fill, wait, 10 decode steps
    s = st.summarize_steps(steps)
    assert s["n"] == 10 and s["skipped"] == 2 and s["p50"] == 50.0 and s["max"] == 100.0
    assert s["p10"] == 50.0 and s["p90"] == pytest.approx(64.0)
    assert st.summarize_steps([1.0, 2.0]) is None
    g = st.summarize_gpu([
        {"sm_mhz": 1980, "mem_mhz": 3201, "temp_c": 40, "power_w": 300.0, "throttle": 0},
        {"sm_mhz": 1755, "mem_mhz": 3201, "temp_c": 47, "power_w": 500.0, "throttle": 0x4},
        {"sm_mhz": None, "mem_mhz": None, "temp_c": None, "power_w": None, "throttle": 0x40},
    ])  # fmt: skip
    assert (g["sm_mhz_min"], g["sm_mhz_max"], g["temp_c_max"]) == (1755, 1980, 47)
    assert g["power_w_mean"] == 400.0 and g["throttle"] == ["sw_power_cap", "hw_thermal_slowdown"]
    assert st.throttle_names(0x1000 | 0x1) == ["gpu_idle", "0x1000"] and not st.summarize_gpu([])
    sizes = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert st.padded_batch(25, sizes) == 32 and st.padded_batch(8, sizes) == 8
    assert st.padded_batch(65, sizes) is None and st.padded_batch(3, []) is None


def test_rows_are_medians_per_user_and_ratios_beside_fp8_run_by_run():
    runs = [
        _run("fp8", 131072, 0, 266.0, sessions=13, prefill=30000),
        _run("fp8", 131072, 1, 270.0, sessions=13, prefill=30400),
        _run("fp8", 131072, 2, 250.0, sessions=13, prefill=29000),
        _run("4bit", 131072, 0, 392.0, sessions=25, prefill=26000),
        _run("4bit", 131072, 1, 464.0, sessions=25, prefill=26500),
        _run("4bit", 131072, 2, 450.0, sessions=25, prefill=25000),
        _run("3bit", 131072, 0, 360.0, sessions=34),
    ]
    by = {r["format"]: r for r in st.add_ratios(st.aggregate(runs))}
    assert list(by) == ["fp8", "4bit", "3bit"]
    assert by["fp8"]["decode_tok_s"] == 266.0 and by["4bit"]["decode_tok_s"] == 450.0
    # one user's speed: each run's aggregate over its sessions, then the median of the runs
    assert by["4bit"]["per_user_tok_s"] == 18.0
    assert by["fp8"]["per_user_tok_s"] == pytest.approx(266 / 13, abs=1e-4)
    assert by["4bit"]["spread"]["per_user_tok_s"]["min"] == 392 / 25
    assert by["4bit"]["per_user_decode_vs_fp8"] == round(18.0 * 13 / 266, 3) == 0.88
    assert by["4bit"]["prefill_tok_s"] == 26000 and by["4bit"]["n_runs"] == 3
    assert by["4bit"]["complete"] and not by["3bit"]["complete"]
    assert by["4bit"]["decode_vs_fp8"] == round(450 / 266, 3)
    assert by["4bit"]["sessions_vs_fp8"] == round(25 / 13, 3)
    paired = by["4bit"]["decode_vs_fp8_paired"]  # 392/266, 464/270, 450/250
    assert paired["n"] == 3 and paired["median"] == pytest.approx(464 / 270, abs=1e-4)
    assert paired["min"] == pytest.approx(392 / 266) and paired["max"] == pytest.approx(1.8)
    assert by["3bit"]["decode_vs_fp8_paired"]["n"] == 1  # only run 0 has a pair
    assert "decode_vs_fp8_paired" not in by["fp8"] and by["fp8"]["decode_vs_fp8"] == 1.0


def test_step_figures_are_sessions_over_the_median_step_beside_fp8_per_user():
    runs = [
        _run("fp8", 131072, i, d, sessions=13, decode_tok_s_at_p50_step=s)
        for i, (d, s) in enumerate([(262.9, 265.3), (283.6, 265.4), (284.5, 266.2)])
    ] + [
        _run("4bit", 131072, i, d, sessions=25, decode_tok_s_at_p50_step=s)
        for i, (d, s) in enumerate([(645.4, 550.7), (545.9, 548.4), (557.9, 550.3)])
    ]
    by = {r["format"]: r for r in st.add_ratios(st.aggregate(runs))}
    assert by["4bit"]["step_tok_s"] == 550.3 and by["fp8"]["step_tok_s"] == 265.4
    assert by["4bit"]["step_vs_fp8"] == round(550.3 / 265.4, 3)
    assert by["4bit"]["per_user_vs_fp8"] == round(round(550.3 / 265.4, 3) / round(25 / 13, 3), 3)
    bare = st.add_ratios(st.aggregate([_run("fp8", 8, 0, 1.0), _run("4bit", 8, 0, 2.0)]))
    assert all(r["step_tok_s"] is None and "step_vs_fp8" not in r for r in bare)


def test_runs_of_different_fills_are_not_one_figure_and_repeats_continue():
    with pytest.raises(ValueError, match="different sessions"):
        st.aggregate([_run("4bit", 32768, 0, 1.0, sessions=103), _run("4bit", 32768, 1, 1.0)])
    with pytest.raises(ValueError, match="without 'decode_tok_s'"):
        st.aggregate([{"format": "fp8", "context": 1, "sessions": 1}])
    first = [_run("fp8", c, i, 1.0) for i in range(3) for c in (32768, 131072)]
    later = [_run("fp8", c, i, 1.0) for i in range(2) for c in (32768, 131072)]
    st.continue_reps(first, later)
    assert [(r["context"], r["rep"]) for r in later] == [
        (32768, 3), (131072, 3), (32768, 4), (131072, 4)]  # fmt: skip


def test_kvzip_layers_host_time_per_step():
    """A run's kvzip layer host time per engine step from the counters' difference; none for
    vLLM's formats (no counters) or a run without steps."""
    from collections import Counter

    d = Counter(attend_s=0.064, write_s=0.032, attend_calls=640, write_calls=640)
    assert serving.host_per_step(d, 20) == {"ms": 4.8, "attend_ms": 3.2, "calls": 64.0}
    assert serving.host_per_step(Counter(), 20) is None
    assert serving.host_per_step(d, 0) is None


def test_gc_pauses_count_collections_per_generation_since_a_mark():
    """The process's garbage collections since a mark: counts per generation, total and
    longest time; a collection before the mark is not counted."""
    import gc

    pauses = serving.GcPauses()
    try:
        gc.collect(2)
        mark = pauses.mark()
        gc.collect(0)
        gc.collect(2)
        got = pauses.since(mark)
        assert got["collections"][0] >= 1 and got["collections"][2] >= 1
        assert got["ms"] >= got["max_ms"] >= 0
        assert pauses.since(pauses.mark())["collections"] == [0, 0, 0]
    finally:
        gc.callbacks.remove(pauses._cb)


def test_calls_merge_with_their_own_fp8_and_fp8_pools_every_call():
    c0 = {
        "runs": [_run("fp8", 1, i, d, sessions=13) for i, d in enumerate((260, 266, 270))]
        + [_run("4bit", 1, i, d, sessions=25) for i, d in enumerate((450, 460, 470))]
    }
    c1 = {"runs": [_run("fp8", 1, i, d, sessions=13) for i, d in enumerate((230, 240, 250))]
          + [_run("3bit", 1, i, d, sessions=34) for i, d in enumerate((330, 340, 350))]
          + [_run("4bit", 1, 0, 999.0, sessions=25)]}  # fmt: skip
    by = {r["format"]: r for r in st.merge_calls([c0, c1])}
    assert list(by) == ["fp8", "4bit", "3bit"]
    assert by["3bit"]["fp8_call"] == 1 and by["3bit"]["decode_vs_fp8"] == round(340 / 240, 3)
    assert by["4bit"]["call"] == 0 and by["4bit"]["decode_vs_fp8"] == round(460 / 266, 3)
    assert by["fp8"]["n_runs"] == 6 and by["fp8"]["decode_tok_s"] == 255.0
    assert by["fp8"]["fp8_by_call"] == {"0": 266.0, "1": 240.0}
    with pytest.raises(ValueError, match="no fp8 runs"):
        st.merge_calls([{"runs": [_run("int4", 1, 0, 1.0)]}])


def _serving_doc(tmp_path):
    runs = []
    for rep, (f, k) in enumerate(((266.0, 392.0), (270.0, 464.0), (250.0, 450.0))):
        step = {"step_ms": {"n": 62, "skipped": 2, "p10": 50.0, "p50": 51.0, "p90": 60.0},
                "decode_calls": {"4bit:cuda": 2080}, "fill": {"running_min": 25,
                                                               "running_max": 25},
                "kvzip_host_per_step": {"ms": 3.25, "attend_ms": 2.0, "calls": 64.0},
                "gc": {"collections": [40, 3, 1], "ms": 12.5, "max_ms": 9.0}}  # fmt: skip
        runs.append(_run("fp8", 131072, rep, f, sessions=13))
        runs.append(_run("4bit", 131072, rep, k, sessions=25, **step))
    rows = st.add_ratios(st.aggregate(runs))
    for r in rows:
        r.pop("runs")
    doc = output.header("serving", "serving", "NVIDIA H200")
    doc.update(model="m", method=serving.METHOD, rows=rows, runs=runs, failures=[],
               engines=[{"name": "fp8", "settings": {"vllm": "0.26.0", "async_scheduling": True,
                                                    "block_size": 16}}])  # fmt: skip
    return doc


def test_serving_result_files_name_the_rows_the_engines_and_the_plot(tmp_path):
    doc = _serving_doc(tmp_path)
    paths = output.write(tmp_path, "bench_serving", doc, serving._markdown(doc),
                         lambda ax: serving._plot(ax, doc["rows"]))  # fmt: skip
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    back = json.loads(paths["json"].read_text())
    for key in ("device", "date", "versions", "command", "engines", "rows", "plot"):
        assert back[key], key
    md = paths["md"].read_text()
    # per user: 450 / 25 = 18 (runs 15.68-18.56), 1.761x fp8's 266 / 13
    assert "| 4bit | 131,072 | 25,000 | 25 | 1.923 | 18 | 15.68-18.56 (16.0%) | 0.88 | 450 |" in md
    assert ("| 4bit | 131,072 | - | 2 | 450 | 55.56 | 50.0/51.0/60.0 | 3.25 | 12.5 (1, max 9.0) "
            "| 25-25 |") in md  # fmt: skip
    assert "| fp8 | 131,072 | - | 2 | 250 | 52 | - | - | - | - |" in md
    assert "| 1.692 | 1.47368-1.8 (19.0%) | 55.56 |" in md and "| cuda | 3 |" in md
    assert "- fp8: vLLM 0.26.0, async_scheduling True, block_size 16" in md


# ------------------------------------------------------------------ the command
def test_bench_serving_help_says_what_it_measures():
    res = CliRunner().invoke(main, ["bench", "--help"])
    assert res.exit_code == 0 and "  serving " in res.output
    res = CliRunner().invoke(main, ["bench", "serving", "--help"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    for words in (
        "Sessions per GPU and decode tokens/s per user, per KV format, against fp8",
        "median of --runs runs",
        "--model",
        "dummy weights",
        "--out DIRECTORY",
    ):
        assert words in text, words
