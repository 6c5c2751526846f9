#!/usr/bin/env python3
"""kvzip inside vLLM on a GPU, end to end (run by ``tests/test_vllm_gpu.py`` on the H200).

    python gpu_e2e.py tier    --out DIR [--context 32768] [--block-size 16]
    python gpu_e2e.py compact --out DIR [--format 4bit]

Both take ``--tp N`` (vLLM's tensor_parallel_size; the tier's stats and the checker's counts
are then per rank, merged by ``_ranks``: the weakest rank's counts, every rank under
``ranks``).

``tier``: Llama-3.1-8B shape (dummy weights) with ``KvzipConnector`` (wrapped by
``kvzip_gpu_verify.VerifyingKvzipConnector``, which keeps a device copy of every stored
block and compares every restored block with it, bit for bit). A ``--context``-token prompt
is prefilled (timed: the recompute), the tier stores its blocks in the background (timed),
the same prompt runs again as a local prefix-cache hit (its output ids are the reference),
then the GPU prefix cache is reset and the prompt is restored from the tier (time to first
token timed, output ids compared).

``compact``: the compact backend (``KVZIP_KV_FORMAT``) on a small Llama with the 8B model's
head geometry (``--shape 8b`` for the whole 8B shape), with CUDA graphs:
generation from prompts of several lengths (prefill through the backend's kernel path,
decode through CUDA graphs), against the same run eager: every sequence generates, the
logprobs are finite, and the graphs' first tokens equal eager's.

Each writes ``DIR/gpu_e2e_<scenario>.json`` and prints ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from kvzip_eval.bench.engines import (  # noqa: E402
    ENV,
    LLAMA31_8B,
    plugin_path,
    prompts,
    synthetic_calibration_dir,
)

# A 4-layer Llama with Llama-3.1-8B's attention geometry per KV head (head 128, GQA 4): the
# compact scenario's engines start in seconds instead of a minute.
SMALL = dict(
    LLAMA31_8B,
    hidden_size=1024,
    intermediate_size=2048,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=32000,
    bos_token_id=1,
    eos_token_id=2,
)


def _model_dir(root: Path, cfg: dict = LLAMA31_8B) -> str:
    d = root / ("llama31-8b-shape" if cfg is LLAMA31_8B else "small-llama")
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return str(d)


def _sp(n: int, logprobs: int | None = None):
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=logprobs
    )


def _timed(llm, ps, n, **kw):
    import torch

    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(ps, _sp(n, **kw), use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t, outs


def _ids(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


#: set by main(): the tensor-parallel size (the tier's files are per rank above 1)
TP = 1


def _ranks(path: Path) -> dict:
    """A tier file (stats or the checker's counts) of every rank, merged: at TP = 1 the file
    itself; above, ``<name>.rank<r>.json`` of each rank under ``ranks``, with the counts the
    scenario waits on and asserts as the weakest rank's (``blocks_held``, ``tokens_restored``,
    ``checked``, ``equal``: min) or the sum (``differ``, ``load_errors``, bytes)."""
    if TP == 1:
        return _read(path)
    per = [_read(path.with_suffix(f".rank{r}{path.suffix}")) for r in range(TP)]
    out: dict = {"ranks": per}
    for key in ("blocks_held", "tokens_restored", "checked", "equal", "stored_copies"):
        out[key] = min((p.get(key, 0) for p in per), default=0)
    for key in ("differ", "load_errors", "raw_bytes_held", "bytes_held"):
        out[key] = sum(p.get(key, 0) for p in per)
    return out


def tier(args) -> dict:
    import torch
    import vllm
    from vllm import LLM

    root = Path(tempfile.mkdtemp(prefix="gpu-e2e-tier-"))
    stats = root / "tier-stats.json"
    verify = root / "verify.json"
    os.environ["KVZIP_VERIFY_PATH"] = str(verify)
    # the connector refuses model runner V2 (it does not rewind after a failed load:
    # kvzip_vllm.connector.require_rewinding_model_runner); the V1 runner in every process
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    ctx, bs = args.context, args.block_size
    t0 = time.perf_counter()
    llm = LLM(
        model=_model_dir(root),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        block_size=bs,
        max_model_len=ctx + 64,
        max_num_seqs=8,
        tensor_parallel_size=args.tp,
        gpu_memory_utilization=args.gpu_mem,
        enable_prefix_caching=True,
        enforce_eager=args.eager,
        async_scheduling=False,  # the connector refuses it (require_synchronous_scheduling)
        seed=0,
        kv_transfer_config={
            # --no-verify: the plain connector (times to first token without the checker,
            # which compares every restored block with its stored copy on the way)
            "kv_connector": "KvzipConnector" if args.no_verify else "VerifyingKvzipConnector",
            "kv_connector_module_path": (
                "kvzip_vllm.connector" if args.no_verify else "kvzip_gpu_verify"
            ),
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "budget_bytes": int(args.budget_gb * 1e9),
                "stats_path": str(stats),
                "fit_tokens": args.fit_tokens,
                "chunk_tokens": args.chunk_tokens,
            },
        },
    )
    init_s = time.perf_counter() - t0
    vocab = LLAMA31_8B["vocab_size"]
    p = prompts(1, ctx, seed=11, vocab=vocab)
    other = prompts(1, 64, seed=12, vocab=vocab)
    _timed(llm, other, 1)  # warm-up
    # a first prompt of this length warms its prefill path; the second is timed
    t_recompute_first, _ = _timed(llm, prompts(1, ctx, seed=13, vocab=vocab), 1)
    t_recompute, _ = _timed(llm, p, 1)
    # the tier's entries: whole chunks of both long prompts (the warm-up's and p's; the short
    # prompt holds none), so the wait below ends only once p's own chunks are held too
    want_blocks = 2 * (ctx // args.chunk_tokens)
    t = time.perf_counter()
    while time.perf_counter() - t < args.store_deadline_s:
        s = _ranks(stats)
        if s.get("blocks_held", 0) >= want_blocks:
            break
        _timed(llm, other, 1)  # steps carry the worker's store reports to the scheduler
        time.sleep(0.2)
    store_s = time.perf_counter() - t
    held = _ranks(stats).get("blocks_held", 0)
    _timed(llm, other, 1)  # one more step: the scheduler learns of the last stores
    _, local = _timed(llm, p, args.gen)  # local prefix-cache hit: the reference output
    restored_before = _ranks(stats).get("tokens_restored", 0)
    llm.reset_prefix_cache()
    t_restore_first, _ = _timed(llm, p, 1)  # the first restore also builds the decode path
    tokens_restored = _ranks(stats).get("tokens_restored", 0) - restored_before
    llm.reset_prefix_cache()
    t_restore, _ = _timed(llm, p, 1)
    llm.reset_prefix_cache()
    _, again = _timed(llm, p, args.gen)
    s = _ranks(stats)
    v = _ranks(verify)
    raw = s.get("raw_bytes_held", 0)
    res = {
        "scenario": "tier",
        "tensor_parallel_size": args.tp,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "context": ctx,
        "block_size": bs,
        "chunk_tokens": args.chunk_tokens,
        "cuda_graphs": not args.eager,
        "init_s": round(init_s, 1),
        "verified": not args.no_verify,
        "recompute_ttft_first_s": round(t_recompute_first, 3),
        "recompute_ttft_s": round(t_recompute, 3),
        "restore_ttft_s": round(t_restore, 3),
        "restore_ttft_first_s": round(t_restore_first, 3),
        "restore_over_recompute": round(t_restore / t_recompute, 3),
        "store_s": round(store_s, 1),
        "store_GBps": round(raw / store_s / 1e9, 3) if store_s > 0 else None,
        "blocks_expected": want_blocks,
        "blocks_held": held,
        "tokens_restored_first": tokens_restored,
        "output_equal_local_hit": _ids(again) == _ids(local),
        "verify": v,
        "bit_exact": None if args.no_verify else bool(v.get("checked")) and v.get("differ", 1) == 0,
        "tier_stats": s,
    }
    return res


def compact(args) -> dict:
    import math

    import torch
    import vllm
    from vllm import LLM

    root = Path(tempfile.mkdtemp(prefix="gpu-e2e-compact-"))
    os.environ["KVZIP_KV_FORMAT"] = args.format
    cfg = LLAMA31_8B if args.shape == "8b" else SMALL
    os.environ["KVZIP_CALIBRATION"] = synthetic_calibration_dir(root, cfg)
    lens = [int(x) for x in args.lengths.split(",")]
    vocab = cfg["vocab_size"]
    ps = [prompts(1, n, seed=20 + i, vocab=vocab)[0] for i, n in enumerate(lens)]
    out = {}
    for mode in ("eager", "graphs"):
        llm = LLM(
            model=_model_dir(root, cfg),
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype="bfloat16",
            attention_backend="CUSTOM",
            max_model_len=max(lens) + args.gen + 16,
            max_num_seqs=len(ps),
            tensor_parallel_size=args.tp,
            # vLLM 0.26's in-process engine keeps its memory after `del llm` (measured on the
            # H200: the second engine found 69.6 of 139.8 GiB free and refused 0.5), so the
            # two engines of this one process each take at most 0.4
            gpu_memory_utilization=0.4,
            enforce_eager=mode == "eager",
            seed=0,
        )
        dt, outs = _timed(llm, ps, args.gen, logprobs=1)
        lps = [
            next(iter(step.values())).logprob
            for o in outs
            for step in (o.outputs[0].logprobs or [])
        ]
        out[mode] = {
            "generate_s": round(dt, 3),
            "ids": _ids(outs),
            "n_out": [len(o.outputs[0].token_ids) for o in outs],
            "finite_logprobs": all(math.isfinite(x) for x in lps) and bool(lps),
            "num_gpu_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
        }
        del llm
        torch.cuda.empty_cache()
    first_equal = [
        a[0] == b[0] for a, b in zip(out["eager"]["ids"], out["graphs"]["ids"], strict=True)
    ]
    return {
        "scenario": "compact",
        "format": args.format,
        "tensor_parallel_size": args.tp,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "shape": args.shape,
        "lengths": lens,
        "gen": args.gen,
        "eager": {k: v for k, v in out["eager"].items() if k != "ids"},
        "graphs": {k: v for k, v in out["graphs"].items() if k != "ids"},
        "all_generated": all(n == args.gen for m in ("eager", "graphs") for n in out[m]["n_out"]),
        "first_token_equal": first_equal,
        "ids_equal": [
            a == b for a, b in zip(out["eager"]["ids"], out["graphs"]["ids"], strict=True)
        ],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("scenario", choices=("tier", "compact"))
    p.add_argument("--out", default=os.environ.get("KVZIP_RESULTS_DIR", "."))
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gen", type=int, default=16)
    p.add_argument("--gpu-mem", type=float, default=0.6)
    p.add_argument("--budget-gb", type=float, default=24.0)
    p.add_argument("--fit-tokens", type=int, default=1024)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--store-deadline-s", type=float, default=240)
    p.add_argument("--eager", action="store_true")
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="tier: the plain KvzipConnector, no block-by-block check (for its times)",
    )
    p.add_argument("--format", default="4bit")
    p.add_argument("--lengths", default="100,1000,5000,20000")
    p.add_argument("--shape", choices=("small", "8b"), default="small")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    args = p.parse_args()
    global TP
    TP = args.tp
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    root = Path(tempfile.mkdtemp(prefix="gpu-e2e-"))
    extra = plugin_path(root, (str(HERE),)).split(os.pathsep)
    sys.path[:0] = extra
    os.environ["PYTHONPATH"] = os.pathsep.join([*extra, os.environ.get("PYTHONPATH", "")])
    res = tier(args) if args.scenario == "tier" else compact(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.scenario if args.scenario == "tier" else f"compact_{args.format}"
    if args.scenario == "tier" and args.no_verify:
        name += "_unverified"
    (out / f"gpu_e2e_{name}.json").write_text(json.dumps(res, indent=1) + "\n")
    print("RESULT " + json.dumps(res), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
