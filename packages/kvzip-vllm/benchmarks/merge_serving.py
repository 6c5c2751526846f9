#!/usr/bin/env python3
"""Merge ``bench_serving.py`` results of back-to-back runs on one machine into one table.

    python packages/kvzip-vllm/benchmarks/merge_serving.py --out results/vllm \
        --name bench_serving_h200_run2 RUN1/bench_serving.json RUN2/bench_serving.json

A GPU call is limited in time, so the formats of one serving benchmark may be split over two
calls on the same machine (the same lease, minutes apart). The rows are taken as measured;
each keeps the run it came from (``run``: its date and command), and the ratios against fp8
are recomputed from the fp8 rows (which run they come from is stated). A format measured in
more than one run keeps its first complete run's rows. Writes ``NAME.json`` (``rows`` with
``format``, ``context``, ``sessions``, ``decode_tok_s``, ``prefill_tok_s``) and ``NAME.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

FORMATS = ("bf16", "fp8", "int4", "4bit", "3.5bit", "3bit")


def merge(runs: list[dict]) -> dict:
    if not runs:
        raise ValueError("no runs given")
    devices = {r.get("device") for r in runs}
    if len(devices) != 1:
        raise ValueError(f"runs from different devices cannot be merged: {sorted(devices)}")
    rows, source = [], {}
    for i, run in enumerate(runs):
        for row in run["rows"]:
            fmt = row["format"]
            if source.setdefault(fmt, i) != i:
                continue  # measured in an earlier run
            rows.append({**{k: v for k, v in row.items() if not k.endswith("_vs_fp8")}, "run": i})
    fp8 = {r["context"]: r for r in rows if r["format"] == "fp8"}
    if not fp8:
        raise ValueError("no fp8 rows: the ratios need the fp8 baseline")
    for r in rows:
        base = fp8.get(r["context"])
        if base is None:
            continue
        for k, b in (
            ("sessions", "sessions"),
            ("decode_tok_s", "decode_tok_s"),
            ("prefill_tok_s", "prefill_tok_s"),
            ("kv_tokens", "kv_tokens"),
        ):
            if r.get(k) and base.get(b):
                name = "decode" if k == "decode_tok_s" else k.removesuffix("_tok_s")
                r[f"{name}_vs_fp8"] = round(r[k] / base[b], 3)
    order = {f: j for j, f in enumerate(FORMATS)}
    rows.sort(key=lambda r: (order.get(r["format"], 99), r["context"]))
    return {
        "what": runs[0].get("what"),
        "device": devices.pop(),
        "versions": runs[0].get("versions"),
        "model": runs[0].get("model"),
        "method": runs[0].get("method"),
        "runs": [
            {"run": i, "date": r.get("date"), "command": r.get("command")}
            for i, r in enumerate(runs)
        ],
        "fp8_from_run": fp8[next(iter(fp8))]["run"],
        "note": (
            "formats measured in back-to-back runs on the same machine (one lease, minutes "
            "apart): each row names its run; ratios against fp8 compare rows of different "
            "runs where the runs differ"
        ),
        "rows": rows,
        "failures": [f for r in runs for f in r.get("failures", []) if f["format"] not in source],
    }


def markdown(res: dict, command: str) -> str:
    lines = [
        "# vLLM serving on one GPU: sessions and aggregate decode per KV format",
        "",
        f"{res['device']}, {res['versions']}; {res['model']}. Merged by `{command}` from:",
        "",
    ]
    lines += [f"- run {r['run']}: {r['date']}, `{r['command']}`" for r in res["runs"]]
    lines += [
        "",
        f"Ratios against fp8 use the fp8 rows of run {res['fp8_from_run']}; {res['note']}.",
        "",
        "| format | run | context | KV tokens | sessions | vs fp8 | decode tok/s | vs fp8 | "
        "ms/step | prefill tok/s | vs fp8 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['format']} | {r['run']} | {r['context']} | {r.get('kv_tokens', 0):,} | "
            f"{r.get('sessions', '')} | {r.get('sessions_vs_fp8', '')} | "
            f"{r.get('decode_tok_s', '')} | {r.get('decode_vs_fp8', '')} | "
            f"{r.get('ms_per_step', '')} | {r.get('prefill_tok_s', '') or ''} | "
            f"{r.get('prefill_vs_fp8', '')} |"
        )
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
