#!/usr/bin/env python3
"""Merge ``bench_serving.py`` results of back-to-back calls on one machine into one table.

    python packages/kvzip-vllm/benchmarks/merge_serving.py --out results/vllm \
        --name bench_serving_h200_s8 CALL1/bench_serving.json CALL2/bench_serving.json

A GPU call is limited in time, so the formats of one serving benchmark are split over calls
on the same machine (one lease, minutes apart), each call with its own fp8 engine. A format's
row comes from the first call that measured it completely (every repeat), else from the first
that measured it at all; its ratios against fp8 use the fp8 runs of its own call (beside it),
or the first call's where its call had none (``fp8_run`` says which). fp8's row pools its runs
of every call (``fp8_by_run``: each call's median, the drift between calls). Results of the
older single-run format (rows without ``runs``) count as one run each. Writes ``NAME.json``
(``rows`` with ``format``, ``context``, ``sessions``, ``decode_tok_s``, ``prefill_tok_s``,
``runs``, ``spread``) and ``NAME.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_stats import MIN_RUNS, add_ratios, aggregate, fmt_spread  # noqa: E402

FORMATS = ("bf16", "fp8", "int4", "4bit", "3.5bit", "3bit")


def _order(fmt: str) -> tuple:
    base, _, recent = fmt.partition("+")
    return (FORMATS.index(base) if base in FORMATS else 99, recent, fmt)


def _runs_of(call: dict, i: int) -> list[dict]:
    """A call's per-run records, each tagged with the call (``run``); a row without ``runs``
    (the older single-run results) is its own run."""
    out = []
    for row in call["rows"]:
        for r in row.get("runs") or [dict(row, rep=0)]:
            rec = {k: v for k, v in r.items() if not k.endswith("_vs_fp8")}
            rec["run"] = i
            out.append(rec)
    return out


def merge(runs: list[dict]) -> dict:
    if not runs:
        raise ValueError("no runs given")
    devices = {r.get("device") for r in runs}
    if len(devices) != 1:
        raise ValueError(f"runs from different devices cannot be merged: {sorted(devices)}")
    uuids = [set(r["gpu_uuids"]) for r in runs if r.get("gpu_uuids")]
    same_gpu = len(set().union(*uuids)) == 1 if len(uuids) == len(runs) else None
    per_call = [aggregate(_runs_of(call, i)) for i, call in enumerate(runs)]
    fp8_calls = [i for i, rows in enumerate(per_call) if any(r["format"] == "fp8" for r in rows)]
    if not fp8_calls:
        raise ValueError("no fp8 rows: the ratios need the fp8 baseline")
    chosen: dict[tuple, dict] = {}
    for i, rows in enumerate(per_call):
        fp8_of = i if i in fp8_calls else fp8_calls[0]
        base = [r for r in per_call[fp8_of] if r["format"] == "fp8"]
        mine = [r for r in rows if r["format"] != "fp8"]
        add_ratios(mine + base)
        for r in mine:
            key = (r["format"], r["context"])
            held = chosen.get(key)
            if held is None or (not held["complete"] and r["complete"]):
                chosen[key] = dict(r, run=i, fp8_run=fp8_of)
    fp8_runs = [r for i in fp8_calls for r in _runs_of(runs[i], i) if r["format"] == "fp8"]
    fp8_rows = aggregate(fp8_runs)
    for r in fp8_rows:
        r["run"] = "all"
        r["fp8_by_run"] = {
            str(i): next(
                (x["decode_tok_s"] for x in per_call[i] if x["format"] == "fp8" and
                 x["context"] == r["context"]), None,
            )
            for i in fp8_calls
        }  # fmt: skip
        r["sessions_vs_fp8"] = r["decode_vs_fp8"] = 1.0
        if r.get("step_tok_s"):
            r["step_vs_fp8"] = r["per_user_vs_fp8"] = 1.0
    rows = fp8_rows + list(chosen.values())
    rows.sort(key=lambda r: (_order(r["format"]), r["context"]))
    measured = {r["format"] for r in rows}
    return {
        "what": runs[0].get("what"),
        "device": devices.pop(),
        "same_gpu": same_gpu,
        "gpu_uuids": sorted(set().union(*uuids)) if uuids else None,
        "versions": runs[0].get("versions"),
        "model": runs[0].get("model"),
        "method": runs[0].get("method"),
        "schedule": runs[0].get("schedule"),
        "runs": [
            {"run": i, "date": r.get("date"), "command": r.get("command")}
            for i, r in enumerate(runs)
        ],
        "fp8_runs": fp8_calls,
        "note": (
            "calls back to back on one machine (one lease, minutes apart): each row names its "
            "call (run) and the call whose fp8 runs its ratios use (fp8_run); fp8's row pools "
            "every call's fp8 runs, fp8_by_run gives each call's median"
        ),
        "rows": rows,
        "failures": [f for r in runs for f in r.get("failures", []) if f["format"] not in measured],
    }


def markdown(res: dict, command: str) -> str:
    gpu = {True: "the same GPU in every call", False: "DIFFERENT GPUs", None: "GPU not recorded"}
    lines = [
        "# vLLM serving on one GPU: sessions and aggregate decode per KV format",
        "",
        f"{res['device']} ({gpu[res.get('same_gpu')]}), {res['versions']}; {res['model']}. "
        f"Merged by `{command}` from:",
        "",
    ]
    lines += [f"- run {r['run']}: {r['date']}, `{r['command']}`" for r in res["runs"]]
    lines += ["", f"{res['note']}.", ""]
    if res.get("schedule"):
        lines += [f"Schedule of a call: {res['schedule']}.", ""]
    lines += [
        "| format | run | fp8 of run | context | KV tokens | sessions | vs fp8 | decode tok/s | "
        "runs (range %) | vs fp8 | paired vs fp8 | ms/step | at p50 step: tok/s | "
        "runs (range %) | vs fp8 | per user vs fp8 | prefill tok/s | vs fp8 | runs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        sp = r.get("spread") or {}
        n = r.get("n_runs", 1)
        lines.append(
            f"| {r['format']} | {r['run']} | {r.get('fp8_run', '')} | {r['context']} | "
            f"{r.get('kv_tokens', 0):,} | {r.get('sessions', '')} | "
            f"{r.get('sessions_vs_fp8', '')} | {r.get('decode_tok_s', '')} | "
            f"{fmt_spread(sp.get('decode_tok_s'))} | {r.get('decode_vs_fp8', '')} | "
            f"{fmt_spread(r.get('decode_vs_fp8_paired'))} | {r.get('ms_per_step', '')} | "
            f"{r.get('step_tok_s') or ''} | {fmt_spread(sp.get('step_tok_s'))} | "
            f"{r.get('step_vs_fp8', '')} | {r.get('per_user_vs_fp8', '')} | "
            f"{r.get('prefill_tok_s', '') or ''} | {r.get('prefill_vs_fp8', '')} | "
            f"{n}{'' if n >= MIN_RUNS else ' (fewer than 3)'} |"
        )
    lines += [
        "",
        "Two decode figures per run. `decode tok/s`: sessions x gen tokens over the time of a "
        "generate of gen + 1 tokens less that of a generate of 1 token; each generate fills its "
        "sessions again, so the fill's run-to-run variation (seconds, against a decode of about "
        "3 s) enters the difference. `at p50 step`: sessions over the median engine step of the "
        "decode (the fill and first token left out), the rate the sessions decode at; "
        "`per user vs fp8` is its ratio over the sessions ratio (1.0: a user decodes as fast "
        "as an fp8 user).",
    ]
    drift = [r for r in res["rows"] if r.get("fp8_by_run")]
    if drift:
        lines += ["", "fp8 decode tok/s, median per call (drift between calls):", ""]
        lines += [f"- {r['context']}: {r['fp8_by_run']}" for r in drift]
    if res["failures"]:
        lines += ["", "Not measured: " + ", ".join(f["format"] for f in res["failures"])]
    lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="bench_serving.json files, in run order")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--name", default="bench_serving_merged")
    args = ap.parse_args()
    res = merge([json.loads(p.read_text()) for p in args.runs])
    command = "merge_serving.py " + " ".join(
        [f"--out {args.out}", f"--name {args.name}", *map(str, args.runs)]
    )
    res["command"] = command
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(res, indent=1))
    (args.out / f"{args.name}.md").write_text(markdown(res, command))
    print(markdown(res, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
