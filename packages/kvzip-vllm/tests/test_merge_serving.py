"""``benchmarks/merge_serving.py``: rows kept as measured with their run, ratios against fp8
recomputed across runs, bad inputs refused."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "merge_serving.py"


def _module():
    spec = importlib.util.spec_from_file_location("merge_serving", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(fmt, ctx, sessions, decode, prefill=None, **extra):
    return {"format": fmt, "context": ctx, "sessions": sessions, "decode_tok_s": decode,
            "prefill_tok_s": prefill, "kv_tokens": 1000 * sessions, **extra}  # fmt: skip


def _run(date, rows, failures=(), device="GPU X"):
    return {"what": "w", "date": date, "command": f"bench {date}", "device": device,
            "versions": {"vllm": "v"}, "model": "m", "method": "x", "rows": rows,
            "failures": list(failures)}  # fmt: skip


def test_rows_keep_their_run_and_ratios_use_fp8_of_another_run():
    m = _module()
    a = _run("t0", [_row("fp8", 128, 10, 200.0, 1000, sessions_vs_fp8=1.0),
                    _row("int4", 128, 20, 300.0, 900)],
             failures=[{"format": "4bit", "rc": "timeout"}])  # fmt: skip
    b = _run("t1", [_row("4bit", 128, 19, 330.0, 850), _row("int4", 128, 99, 1.0, 1)])
    res = m.merge([a, b])
    by = {r["format"]: r for r in res["rows"]}
    assert [r["format"] for r in res["rows"]] == ["fp8", "int4", "4bit"]  # FORMATS order
    assert by["4bit"]["run"] == 1 and by["int4"]["run"] == 0  # int4: the first run's rows
    assert by["4bit"]["sessions_vs_fp8"] == 1.9 and by["4bit"]["decode_vs_fp8"] == 1.65
    assert by["4bit"]["prefill_vs_fp8"] == 0.85 and by["fp8"]["decode_vs_fp8"] == 1.0
    assert by["4bit"]["fp8_run"] == 0 and res["fp8_runs"] == [0]  # run 1 had no fp8
    assert [r["date"] for r in res["runs"]] == ["t0", "t1"]
    assert res["failures"] == []  # 4bit failed in run 0 but was measured in run 1
    md = m.markdown(res, "merge_serving.py x")
    assert "| 4bit | 1 | 0 | 128 |" in md and "(fewer than 3)" in md


def test_bad_inputs_are_refused(tmp_path):
    m = _module()
    with pytest.raises(ValueError, match="no runs"):
        m.merge([])
    with pytest.raises(ValueError, match="different devices"):
        m.merge([_run("t0", [_row("fp8", 1, 1, 1.0)]), _run("t1", [], device="GPU Y")])
    with pytest.raises(ValueError, match="no fp8 rows"):
        m.merge([_run("t0", [_row("int4", 1, 1, 1.0)])])
    p = tmp_path / "a.json"
    p.write_text(json.dumps(_run("t0", [_row("fp8", 1, 1, 1.0)])))
    import subprocess
    import sys

    out = tmp_path / "out"
    subprocess.run(
        [sys.executable, str(SCRIPT), str(p), "--out", str(out), "--name", "m"], check=True,
        capture_output=True,
    )  # fmt: skip
    res = json.loads((out / "m.json").read_text())
    assert res["rows"][0]["format"] == "fp8" and (out / "m.md").exists()
    assert res["command"].startswith("merge_serving.py --out")
