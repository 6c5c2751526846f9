"""Scenarios the end-to-end tests run, each in a fresh process (one vLLM per process).

python vllm_scenarios.py backend  --out result.json   # KVZIP_KV_FORMAT decides the cache
python vllm_scenarios.py eviction --out result.json --budget-bytes N
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

KV_MEMORY_BYTES = 64 << 20


def _llm(**kwargs):
    from vllm import LLM

    from kvzip_eval.model import hf_folder

    return LLM(
        model=str(hf_folder()),
        dtype="bfloat16",
        max_model_len=2048,
        enforce_eager=True,
        kv_cache_memory_bytes=KV_MEMORY_BYTES,
        max_num_seqs=4,
        seed=0,
        **kwargs,
    )


def _prompts(tok, n: int, length: int, offset: int = 0) -> list[list[int]]:
    from kvzip_eval.corpus import load_text

    ids = tok(load_text())["input_ids"]
    return [ids[offset + i * length : offset + (i + 1) * length] for i in range(n)]


def eval_prompts(tok, n: int, passage_tokens: int) -> list[list[int]]:
    """The chat prompts ``kvzip eval`` scores words changed on (instruction + held-out text)."""
    from kvzip_eval.quality.words import corpus_prompts, prompt_ids

    return prompt_ids(tok, corpus_prompts(tok, n, passage_tokens))


def backend(args) -> dict:
    """KV capacity in tokens and greedy generations, for whatever cache the env selects."""
    from vllm import SamplingParams

    t0 = time.perf_counter()
    llm = _llm(enable_prefix_caching=False)
    start_s = time.perf_counter() - t0
    cc = llm.llm_engine.vllm_config.cache_config
    tok = llm.get_tokenizer()
    prompts = eval_prompts(tok, args.num_prompts, args.prompt_tokens)
    t = time.perf_counter()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=args.max_tokens, temperature=0.0),
        use_tqdm=False,
    )
    return {
        "kv_format": os.environ.get("KVZIP_KV_FORMAT", "bf16 (vLLM default)"),
        "kv_cache_memory_bytes": KV_MEMORY_BYTES,
        "block_size": cc.block_size,
        "num_blocks": cc.num_gpu_blocks,
        "capacity_tokens": cc.num_gpu_blocks * cc.block_size,
        "start_s": round(start_s, 2),
        "generate_s": round(time.perf_counter() - t, 2),
        "texts": [o.outputs[0].text for o in outs],
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
    }


def eviction(args) -> dict:
    """A small tier: prompts sharing a first part and not the rest; evictions never corrupt."""
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig

    stats_path = Path(tempfile.mkdtemp(prefix="kvzip-")) / "stats.json"
    llm = _llm(
        enable_prefix_caching=True,
        block_size=32,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvzipConnector",
            kv_connector_module_path="kvzip_vllm.connector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "budget_bytes": args.budget_bytes,
                "stats_path": str(stats_path),
            },
        ),
    )
    tok = llm.get_tokenizer()
    shared = _prompts(tok, 1, 96)[0]  # 3 blocks of 32 shared by every prompt
    tails = _prompts(tok, 4, 96, offset=1000)
    prompts = [shared + t for t in tails]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)

    def gen(p):
        llm.reset_prefix_cache()  # every run starts from the tier alone
        return list(
            llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)[0].outputs[0].token_ids
        )

    first = [gen(p) for p in prompts]  # fills the tier; the small budget evicts
    again = [gen(p) for p in prompts]  # restores what is still held, recomputes the rest
    return {
        "budget_bytes": args.budget_bytes,
        "first": first,
        "again": again,
        "stats": json.loads(stats_path.read_text()),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=["backend", "eviction"])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--budget-bytes", type=int, default=4 << 20)
    args = ap.parse_args()
    result = {"backend": backend, "eviction": eviction}[args.scenario](args)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
