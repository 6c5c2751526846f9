"""``kvzip bench tier-decode``: what a tier's restores and stores cost the
requests already decoding beside them.

One engine per connector (``kvzip``, ``offload``: the same CPU bytes; ``none``: returning
prompts recomputed), each in its own process, every vLLM default on. In each:

1. *Stores.* ``--decoders`` prompts of ``--decode-context`` tokens prefilled at once, then,
   while they decode (``ignore_eos``), ``--long-prompts`` long prompts (``--long-context``
   tokens) one at a time, then ``FLUSH`` prompts as long, which push the long prompts out of
   vLLM's own GPU prefix cache: the tier stores every chunk of them all, the long prompts and
   the flush prompts last (its LRU keeps them). Every call of the connector's
   ``wait_for_save`` (where a step hands its stores to the tier) is timed: the longest is what
   a step waited for the store path; the decoders' inter-token latency (ITL: the time between
   the steps that gave a decoder a token) while the long prompts are stored is what storing
   costs them. The tier's store throughput (bf16 bytes coded over the store thread's busy
   time) is set beside the prefill's KV rate (bf16 KV bytes of the prefilled tokens over the
   prefill's wall time).
2. *Decode, quiet.* Once the tier has coded every store, the decoders' ITL for
   ``--window-s`` seconds.
3. *Decode, with returns.* The same for another window while the long prompts return from the
   tier, one every ``--return-every-s`` seconds, each asking for one token: the decoders' ITL
   again, and each return's time to first token.

Reported per connector: ITL p50 / p99 quiet, while storing and with returns, the ratio of the
p99s with returns and quiet (the target: at most 1.25x), the returns' TTFT, the longest
``wait_for_save``, stores dropped, store throughput over the prefill's KV rate.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from kvzip_eval.bench import engines, output
from kvzip_eval.bench.connectors import file_label, parse_connector
from kvzip_eval.bench.stats import percentile

CHUNK = 256


#: at most this long, the decoders decoding, for the tier to code the stores still queued
#: when the prefills end (the quiet window is then quiet: ``drain_s`` says how long it took)
DRAIN_S = 120.0

#: prompts of a long prompt's length stored after the long prompts: they evict the long
#: prompts from vLLM's GPU cache (sized for one of them), so that the returns come from the tier
FLUSH = 2

#: the most of the host's available memory a tier's CPU bytes may take: each connector's engine
#: runs alone, but vLLM's own process memory and the OffloadingConnector's page-locked
#: allocation come on top (an H200 host of 125 GiB killed the OffloadingConnector's engine at
#: 105 GB of CPU bytes, an H100 host of 125 GiB at 76 GB on 2026-12-07)
HOST_FRACTION = 0.45


def available_memory() -> int:
    """Bytes of host memory available to a new allocation (``MemAvailable``)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cpu_bytes_for(o, bpt: int, available: int) -> int:
    """Each tier's CPU bytes: ``o.cpu_bytes``, else the raw pages of the long prompts and the
    flush prompts / 0.9 (the decoders' prompts, stored first, are the ones the tiers' LRU
    evicts; the returns, stored after them, stay held by both tiers). ValueError when that is
    more than ``HOST_FRACTION`` of ``available`` (bytes)."""
    long_n = o.long_context - CHUNK + 1
    cpu = o.cpu_bytes or int((o.long_prompts + FLUSH) * long_n * bpt / 0.9)
    if cpu > HOST_FRACTION * available:
        how = (
            f"--cpu-bytes {o.cpu_bytes}"
            if o.cpu_bytes
            else f"{o.long_prompts} long prompts + {FLUSH} flush prompts of {long_n} tokens x "
            f"{bpt} bytes per token / 0.9"
        )
        raise ValueError(
            f"CPU bytes {cpu / 1e9:.1f} GB ({how}) for each tier: more than {HOST_FRACTION} of "
            f"the host's available memory ({available / 1e9:.1f} GB; vLLM's own memory comes "
            f"on top). Ask for fewer --long-prompts, a shorter --long-context, or --cpu-bytes "
            f"of at most {int(HOST_FRACTION * available)}."
        )
    return cpu


#: device memory a CUDA engine takes besides its weights and its KV cache (activations, CUDA
#: graphs, the tier's staging and restore buffers)
GPU_OVERHEAD_BYTES = 6 << 30


def weight_bytes(cfg: dict, dtype_bytes: int = 2) -> int:
    """A Llama config's weights (embeddings, attention, MLP, the head unless tied)."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = h * cfg["num_key_value_heads"] // cfg["num_attention_heads"]
    heads = 1 if cfg.get("tie_word_embeddings") else 2
    params = heads * cfg["vocab_size"] * h + layers * (2 * h * h + 2 * h * kv + 3 * h * inter)
    return params * dtype_bytes


def gpu_cache_tokens(o) -> int:
    """The GPU cache a CUDA engine is given (tokens): the decoders' prompts and decoded
    tokens, ONE long prompt and 4096 tokens of slack (see the engine's sizing)."""
    long_n, dec_n = o.long_context - CHUNK + 1, o.decode_context - CHUNK + 1
    return o.decoders * (dec_n + o.decode_tokens) + long_n + 4096


def check_gpu_fits(o, cfg: dict, bpt: int, total_bytes: int) -> None:
    """ValueError, before any engine starts, when the GPU cache the run needs
    (:func:`gpu_cache_tokens`) cannot fit a GPU of ``total_bytes`` at
    ``--gpu-memory-utilization`` beside the weights (vLLM would take the override and run out of
    device memory allocating it)."""
    need = gpu_cache_tokens(o) * bpt
    room = int(total_bytes * o.gpu_memory_utilization) - weight_bytes(cfg) - GPU_OVERHEAD_BYTES
    if need > room:
        per = (o.decode_context - CHUNK + 1 + o.decode_tokens) * bpt
        fit = max(0, (room - (o.long_context - CHUNK + 1 + 4096) * bpt) // per)
        raise ValueError(
            f"the GPU cache this run needs ({gpu_cache_tokens(o)} tokens, {need / 1e9:.1f} GB: "
            f"{o.decoders} decoders x (prompt + --decode-tokens), one long prompt, 4096 of "
            f"slack) does not fit this GPU ({total_bytes / 1e9:.1f} GB x "
            f"{o.gpu_memory_utilization} less {weight_bytes(cfg) / 1e9:.1f} GB of weights and "
            f"{GPU_OVERHEAD_BYTES / 1e9:.1f} GB for the rest: {max(room, 0) / 1e9:.1f} GB). "
            f"Ask for at most {fit} --decoders, or a shorter --decode-context or --long-context."
        )


def _itl(stamps: dict[str, list[float]]) -> list[float]:
    """Every gap between consecutive token times of each request."""
    gaps = []
    for ts in stamps.values():
        gaps += [b - a for a, b in zip(ts, ts[1:], strict=False)]
    return gaps


def itl_summary(stamps: dict[str, list[float]]) -> dict:
    """p50, p99, max and count of the gaps of ``stamps`` (seconds)."""
    gaps = _itl(stamps)
    if not gaps:
        return {"n": 0, "p50_s": None, "p99_s": None, "max_s": None}
    return {
        "n": len(gaps),
        "p50_s": round(percentile(gaps, 50), 5),
        "p99_s": round(percentile(gaps, 99), 5),
        "max_s": round(max(gaps), 5),
    }


def child(spec: dict) -> None:
    import torch
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    conn, extra = parse_connector(spec["connector"])
    root = Path(tempfile.mkdtemp(prefix=f"kvzip-bench-decode-{file_label(spec['connector'])}-"))
    stats_path = root / "tier-stats.json"
    kw: dict = dict(spec["engine_args"])
    if conn == "kvzip":
        kw["kv_transfer_config"] = {
            "kv_connector": "KvzipConnector",
            "kv_connector_module_path": "kvzip_vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "budget_bytes": spec["cpu_bytes"],
                "stats_path": str(stats_path),
                "chunk_tokens": CHUNK,
                **extra,
            },
        }
    elif conn == "offload":
        kw["kv_offloading_size"] = spec["cpu_bytes"] / (1 << 30)
        kw["kv_offloading_backend"] = "native"
    cuda = torch.cuda.is_available()
    if cuda:
        kw["gpu_memory_utilization"] = spec["gpu_memory_utilization"]
    else:
        kw["kv_cache_memory_bytes"] = spec["kv_cache_bytes"]
    long_n, dec_n = spec["long_context"] - CHUNK + 1, spec["decode_context"] - CHUNK + 1
    if cuda:
        # a GPU cache for the decoders (their prompts and --decode-tokens), ONE long prompt
        # and 4096 tokens of slack: vLLM evicts freed blocks least recently used first, so
        # the flush prompts, each a long prompt's length, take every free block (the first
        # all but at most the slack and the decoders' tokens not decoded yet, the second the
        # rest) while decoders * decode_tokens + 4096 <= long_n (the defaults: 126976 <=
        # 130817): no block of a long prompt is left in it for a return to hit
        need = spec["decoders"] * (dec_n + spec["decode_tokens"]) + long_n + 4096
        kw.setdefault("num_gpu_blocks_override", -(-need // 16))
    llm, res = engines.start_engine(
        spec,
        max_model_len=max(long_n, dec_n + spec["decode_tokens"]) + 16,
        max_num_seqs=max(spec["decoders"] + 4, 8),
        enable_prefix_caching=True,
        **kw,
    )
    eng = llm.llm_engine

    saves: list[float] = []  # every wait_for_save, seconds
    if conn != "none":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        group = get_kv_transfer_group()
        real_save = group.wait_for_save

        def timed_save(*a, **k):
            t = time.perf_counter()
            try:
                return real_save(*a, **k)
            finally:
                saves.append(time.perf_counter() - t)

        group.wait_for_save = timed_save

    def tier_stats() -> dict:
        try:
            return json.loads(stats_path.read_text()) if conn == "kvzip" else {}
        except (OSError, json.JSONDecodeError):
            return {}

    vocab = spec["vocab"]
    longs = [
        p["prompt_token_ids"] for p in engines.prompts(spec["long_prompts"], long_n, 11, vocab)
    ]
    decs = [p["prompt_token_ids"] for p in engines.prompts(spec["decoders"], dec_n, 12, vocab)]
    flushes = [p["prompt_token_ids"] for p in engines.prompts(FLUSH, long_n, 13, vocab)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    dec_sp = SamplingParams(
        max_tokens=spec["decode_tokens"],
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )
    stamps: dict[str, list[float]] = {}  # decoder -> the times it got its tokens
    finished: set[str] = set()
    ttft: dict[str, float] = {}
    added: dict[str, float] = {}

    def step() -> None:
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            if o.finished:
                finished.add(o.request_id)
            if o.request_id in stamps and o.outputs and o.outputs[0].token_ids:
                stamps[o.request_id] += [now] * len(o.outputs[0].token_ids)
            elif o.request_id in added and o.request_id not in ttft and o.outputs:
                if o.outputs[0].token_ids:
                    ttft[o.request_id] = now - added[o.request_id]

    def prefill(prompts: list[list[int]], name: str) -> tuple[float, float]:
        """``prompts`` one at a time beside the decoders: seconds, longest wait_for_save."""
        saves.clear()
        t = time.perf_counter()
        for i, p in enumerate(prompts):
            eng.add_request(f"{name}{i}", {"prompt_token_ids": p}, one)
            while f"{name}{i}" not in finished:
                step()
        return time.perf_counter() - t, max(saves, default=0.0)

    def restart_stamps() -> None:  # the next gaps from each decoder's last token on
        for ts in stamps.values():
            ts[:] = ts[-1:]

    bpt = spec["bpt"]
    # 1. stores: the decoders' prompts at once, then (the decoders decoding) the long prompts
    # and the flush prompts one at a time; the tiers' LRU evicts the decoders' prompts first
    engines.emit("phase", name="stores")
    for i, p in enumerate(decs):
        eng.add_request(f"dec{i}", {"prompt_token_ids": p}, dec_sp)
        stamps[f"dec{i}"] = []
    t = time.perf_counter()
    while not all(stamps.values()):
        step()
    dec_prefill_s = time.perf_counter() - t
    res["stores"] = {
        "decoders_prefill_s": round(dec_prefill_s, 3),
        "decoders_kv_rate_GBps": round(len(decs) * dec_n * bpt / dec_prefill_s / 1e9, 3),
        "wait_for_save_max_ms_decoders": round(1e3 * max(saves, default=0.0), 2),
    }
    restart_stamps()
    long_s, wait_long = prefill(longs, "long")
    res["itl_stores"] = itl_summary(stamps)
    _, wait_flush = prefill(flushes, "flush")
    res["stores"].update(
        long_prefill_s=round(long_s, 3),
        long_kv_rate_GBps=round(len(longs) * long_n * bpt / long_s / 1e9, 3),
        wait_for_save_max_ms_long=round(1e3 * wait_long, 2),
        wait_for_save_max_ms_flush=round(1e3 * wait_flush, 2),
    )
    saves.clear()
    s_stores = tier_stats()
    if conn == "kvzip":
        busy = s_stores.get("store_busy_seconds", 0.0)
        raw = s_stores.get("raw_bytes_stored", 0)
        res["stores"]["store_GBps"] = round(raw / busy / 1e9, 3) if busy else None

    if conn == "kvzip":  # the quiet window starts once the prompts' stores are coded
        t = time.perf_counter()
        while tier_stats().get("stores_in_flight", 0) and time.perf_counter() - t < DRAIN_S:
            step()
        res["stores"]["drain_s"] = round(time.perf_counter() - t, 3)

    # 2. quiet window
    engines.emit("phase", name="quiet")
    restart_stamps()
    t = time.perf_counter()
    while time.perf_counter() - t < spec["window_s"]:
        step()
    quiet = {r: list(ts) for r, ts in stamps.items()}

    # 3. returns: the long prompts from the tier (each once), one every return_every_s
    engines.emit("phase", name="returns")
    restart_stamps()
    t = time.perf_counter()
    nxt, k = t, 0
    while time.perf_counter() - t < spec["window_s"]:
        if time.perf_counter() >= nxt and k < len(longs):
            rid = f"ret{k}"
            added[rid] = time.perf_counter()
            eng.add_request(rid, {"prompt_token_ids": longs[k]}, one)
            k += 1
            nxt += spec["return_every_s"]
        step()
    busy_t = time.perf_counter()
    while any(r not in ttft for r in added) and time.perf_counter() - busy_t < 120:
        step()
    returns = {r: list(ts) for r, ts in stamps.items()}
    # --decode-tokens too few for the whole run: the last windows had fewer decoders
    res["decoders_finished_early"] = len(finished & set(stamps))
    s_end = tier_stats()
    res["itl_quiet"] = itl_summary(quiet)
    res["itl_returns"] = itl_summary(returns)
    q99, r99 = res["itl_quiet"]["p99_s"], res["itl_returns"]["p99_s"]
    res["itl_p99_ratio"] = round(r99 / q99, 3) if q99 and r99 else None
    ttfts = sorted(ttft.values())
    res["returns"] = {
        "n": len(added),
        "ttft_p50_s": round(percentile(ttfts, 50), 4) if ttfts else None,
        "ttft_max_s": round(max(ttfts), 4) if ttfts else None,
    }
    res["wait_for_save_max_ms_windows"] = round(1e3 * max(saves, default=0.0), 2)
    if conn == "kvzip":
        keys = ("stores_dropped_queue_full", "store_errors", "blocks_skipped", "load_errors",
                "stores_spilled_host", "stores_waited_queue_full", "store_wait_seconds",
                "stores_unspilled_ahead", "stores_stage_allocated", "step_waits_for_loads",
                "load_jobs_async",
                "tokens_restored", "ratio", "raw_bytes_stored", "store_busy_seconds",
                "store_encode_seconds", "store_copy_seconds", "spill_peak_bytes",
                "load_host_seconds", "load_async_seconds", "store_unspill_seconds",
                "store_sync_seconds", "store_fit_seconds", "store_code_seconds",
                "store_thread_cpu_seconds",
                "load_lookup_seconds", "load_alloc_seconds",
                "load_prepare_seconds", "load_launch_seconds", "cuda_alloc_retries",
                "arena_pinned", "store_queue_peak_bytes")  # fmt: skip
        res["tier"] = {k: s_end.get(k) for k in keys}
        if res["stores"].get("store_GBps") is None:  # (no job was done when the prefill ended)
            busy, raw = s_end.get("store_busy_seconds", 0.0), s_end.get("raw_bytes_stored", 0)
            res["stores"]["store_GBps"] = round(raw / busy / 1e9, 3) if busy else None
    for r in list(stamps):
        eng.abort_request([r])
    engines.emit("result", **res)


# ------------------------------------------------------------------ the call (parent)
def run(o) -> dict:
    """The whole call (options ``o`` as ``kvzip bench tier-decode`` takes them)."""
    from tqdm import tqdm

    out = Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="kvzip-bench-decode-"))
    cfg, folder, load_format = engines.model_folder(o.model, root)
    bpt = engines.kv_bytes_per_token(cfg)
    conns = list(o.connectors)
    # both tiers hold the returning prompts (stored after the decoders'): restores compared
    # with restores; refused here, before any engine, where the host cannot give the bytes
    cpu = cpu_bytes_for(o, bpt, available_memory()) if set(conns) - {"none"} else 0
    import torch

    if torch.cuda.is_available():
        check_gpu_fits(o, cfg, bpt, torch.cuda.get_device_properties(0).total_memory)
    bar = tqdm(total=len(conns) * 4, desc="bench tier decode", unit="phase")
    started, engs = time.monotonic(), []
    for conn in conns:
        left = o.deadline_s - (time.monotonic() - started)
        base = {"connector": conn, "cpu_bytes": cpu if conn != "none" else 0}
        if left < 30:
            engs.append({**base, "error": f"not started: {left:.0f} s left of the deadline"})
            continue
        spec = {
            **base, "model_dir": folder, "load_format": load_format, "vocab": cfg["vocab_size"],
            "bpt": bpt, "long_context": o.long_context, "long_prompts": o.long_prompts,
            "decode_context": o.decode_context, "decoders": o.decoders,
            "decode_tokens": o.decode_tokens, "window_s": o.window_s,
            "return_every_s": o.return_every_s,
            "gpu_memory_utilization": o.gpu_memory_utilization,
            "kv_cache_bytes": o.kv_cache_bytes, "engine_args": o.engine_args,
        }  # fmt: skip
        done = [0]

        def progress(recs, done=done):
            n = sum(r["kind"] in ("engine", "phase") for r in recs)
            if n > done[0]:
                bar.update(n - done[0])
                done[0] = n

        bar.set_postfix_str(conn)
        log = out / f"decode_{file_label(conn)}.log"
        rc, recs = engines.run_child("kvzip_eval.bench.interference", spec, log,
                                     engines.child_env(root), min(left, o.engine_timeout_s),
                                     progress)  # fmt: skip
        bar.update(4 - done[0])
        e = engines.engine_result(base, conn, rc, recs, log)
        engs.append(e)
    bar.close()
    rows = [decode_row(e) for e in engs]
    device = next((e["device"] for e in engs if e.get("device")), None)
    doc = output.header("tier-decode", "What a tier's restores and stores cost the requests "
                        "decoding beside them", device)  # fmt: skip
    doc.update(
        model=o.model or "Llama-3.1-8B's shape, dummy weights",
        workload={
            "long_prompts": o.long_prompts, "long_context": o.long_context,
            "decoders": o.decoders, "decode_context": o.decode_context,
            "window_s": o.window_s, "return_every_s": o.return_every_s, "cpu_bytes": cpu,
            "kv_bytes_per_token": bpt,
        },
        rows=rows,
        engines=engs,
    )  # fmt: skip
    output.write(out, "bench_tier_decode", doc, _markdown(doc), lambda ax: _plot(ax, rows))
    return doc


def decode_row(e: dict) -> dict:
    """One connector's row: ITL quiet, while storing and with returns, returns' TTFT, the store
    path."""
    st, q, r = e.get("stores") or {}, e.get("itl_quiet") or {}, e.get("itl_returns") or {}
    kv = max(st.get("long_kv_rate_GBps") or 0, st.get("decoders_kv_rate_GBps") or 0)
    waits = [st.get(f"wait_for_save_max_ms_{k}") for k in ("decoders", "long", "flush")]
    waits.append(e.get("wait_for_save_max_ms_windows"))
    tier = e.get("tier") or {}
    dropped = None
    if tier:
        dropped = sum(tier.get(k) or 0 for k in ("stores_dropped_queue_full", "store_errors",
                                                 "blocks_skipped"))  # fmt: skip
    return {
        "connector": e["connector"],
        "itl_p50_quiet_s": q.get("p50_s"),
        "itl_p99_quiet_s": q.get("p99_s"),
        "itl_p50_returns_s": r.get("p50_s"),
        "itl_p99_returns_s": r.get("p99_s"),
        "itl_p99_ratio": e.get("itl_p99_ratio"),
        "itl_p99_stores_s": (e.get("itl_stores") or {}).get("p99_s"),
        "returns": (e.get("returns") or {}).get("n"),
        "return_ttft_p50_s": (e.get("returns") or {}).get("ttft_p50_s"),
        "return_ttft_max_s": (e.get("returns") or {}).get("ttft_max_s"),
        "wait_for_save_max_ms": max((w for w in waits if w is not None), default=None),
        "store_GBps": st.get("store_GBps"),
        "store_over_prefill_kv_rate": round(st["store_GBps"] / kv, 3)
        if st.get("store_GBps") and kv
        else None,
        "stores_dropped": dropped,
        "stores_drain_s": st.get("drain_s"),
        "decoders_finished_early": e.get("decoders_finished_early"),
        "error": (e.get("error") or "")[-200:] or None,
    }


def _markdown(doc: dict) -> list[str]:
    w = doc["workload"]
    lines = [
        f"Model: {doc['model']}. {w['decoders']} requests decode at {w['decode_context']} "
        f"tokens; while they decode, {w['long_prompts']} prompts of {w['long_context']} tokens "
        f"are stored one at a time, then {FLUSH} more as long (they push the first out of "
        f"vLLM's GPU cache), then the first ones return one every {w['return_every_s']} s during a "
        f"{w['window_s']} s window (the quiet window before it is the baseline; it starts once "
        f"the tier has coded the prompts' stores). CPU bytes {w['cpu_bytes'] / 1e9:.1f} GB for "
        f"each tier (the returning prompts held by both).",
        "",
    ]
    lines += output.table(doc["rows"], [
        ("connector", "connector"), ("itl_p50_quiet_s", "ITL p50 quiet s"),
        ("itl_p99_quiet_s", "ITL p99 quiet s"), ("itl_p50_returns_s", "ITL p50 returns s"),
        ("itl_p99_returns_s", "ITL p99 returns s"), ("itl_p99_ratio", "p99 ratio"),
        ("itl_p99_stores_s", "ITL p99 storing s"),
        ("returns", "returns"), ("return_ttft_p50_s", "return TTFT p50 s"),
        ("return_ttft_max_s", "return TTFT max s"),
        ("wait_for_save_max_ms", "longest wait_for_save ms"), ("store_GBps", "store GB/s"),
        ("store_over_prefill_kv_rate", "store / prefill KV rate"),
        ("stores_dropped", "stores dropped"), ("stores_drain_s", "stores coded after prefill s"),
        ("decoders_finished_early", "decoders finished early"), ("error", "error")])  # fmt: skip
    lines += output.engines_md(doc["engines"])
    lines += [
        "",
        "ITL: the time between consecutive steps that gave a decoding request a token, over "
        "every decoder (storing: while the long prompts are stored). The targets: ITL p99 "
        "with returns at most 1.25x quiet; no step waits more than 50 ms in wait_for_save "
        "(where a step hands its stores to the tier); the tier's store throughput (bf16 bytes "
        "coded over its store thread's busy time) at least 2x the prefill's KV rate (bf16 KV "
        "bytes of the prefilled tokens over the prefill's wall time, the faster of the long "
        "prompts' and the decoders' prefill).",
    ]
    return lines


def _plot(ax, rows: list[dict]) -> None:
    import numpy as np

    x = np.arange(len(rows))
    q = [r["itl_p99_quiet_s"] or 0 for r in rows]
    r_ = [r["itl_p99_returns_s"] or 0 for r in rows]
    ax.bar(x - 0.2, [1e3 * v for v in q], 0.4, label="ITL p99, quiet")
    ax.bar(x + 0.2, [1e3 * v for v in r_], 0.4, label="ITL p99, with returns")
    ax.set_xticks(x, [r["connector"] for r in rows])
    ax.set_ylabel("inter-token latency p99, ms")
    ax.set_title("Decoders' ITL while long prompts return from the tier")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)


if __name__ == "__main__":
    spec = engines.child_spec()
    if spec is not None:
        child(spec)
        os._exit(0)  # vLLM's shutdown can hang; the result is out
