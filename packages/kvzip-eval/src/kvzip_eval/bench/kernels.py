"""``kvzip bench kernels``: the paged decode attention of kvzip's formats beside the fp8 decode
kernels, one process, the same data, and the share of HBM bandwidth each reaches.

Per shape (``8b``: Llama-3.1-8B's 32 query / 8 KV heads; ``70b-tp8``: 70B per GPU under TP 8,
8 / 1; head dim 128; ``tiny``: 4 / 2, 64, for a check), batch and context, page size 16:

- ``kvzip-<backend>-<fmt>``: ``kvzip_kernels``' decode for each format, on the Triton kernels
  (``triton``) and the CUDA ones (``cuda``, built for this GPU first): planned once
  (``decode_plan.plan``), the plan's ``run`` timed, as the baselines are timed after their
  plans and workspaces are made (a server plans a step once and runs it per layer); with
  ``--cuda-variants`` naming more than the shipped choice (``auto``: each format's design,
  ``kvzip_kernels._cuda.SHIPPED``), the CUDA kernel is timed
  once per design (``DecodeConfig(cuda_variant=)``), keyed ``kvzip-cuda-<design>-<fmt>``
  (``kvzip-cuda-v6-4bit``, ``kvzip-cuda-v7-4bit``; the default keeps ``kvzip-cuda-<fmt>``);
- the fp8 baselines, on an fp8 e4m3 cache holding the same values as kvzip's fp8 cache (copied
  into their NHD layout), each where it can be imported: ``xqa`` (FlashInfer's XQA,
  TensorRT-LLM's fp8 decode), ``flashinfer-fp8`` (FlashInfer's tensor-core decode),
  ``vllm-fa3-fp8`` (vLLM's FlashAttention 3 with an fp8 cache, what vLLM serves fp8 with on
  Hopper). Without any of them, kvzip's own Triton fp8 decode is the baseline.

Each time is the median of ``--iters`` timings after ``--warmup`` calls (CUDA events; on the
CPU the wall clock). Reported: microseconds, GB/s of cache bytes read (batch x context x KV
heads x the format's K+V bytes per token and head), the share of the HBM peak (``--peak-tbps``;
default 4.3 TB/s on an H200, the rate XQA reaches there, 3.35 on an H100) and the speedup
against the fastest fp8 baseline; and the relative L2 distance of each output from kvzip's
Triton kernel's on the same data (fp8 for the baselines: a check that the kernels computed the
same attention).
"""

from __future__ import annotations

import functools
import statistics
import time
from pathlib import Path

from kvzip_eval.bench import output

SHAPES = {"8b": (32, 8, 128), "70b-tp8": (8, 1, 128), "tiny": (4, 2, 64)}
PEAK_TBPS = {"H200": 4.3, "H100": 3.35}
BASELINES = ("xqa", "flashinfer-fp8", "vllm-fa3-fp8")


def kernel_keys(backends, fname: str, cuda_variants=("auto",)) -> list[tuple[str, str, str]]:
    """(row key, backend, CUDA design) of each kvzip kernel timed for format ``fname``: one per
    backend, the CUDA one once per design in ``cuda_variants``; the design is named in the key
    (``kvzip-cuda-v7-4bit``) unless only the shipped choice, ``auto`` (each format's design,
    ``kvzip_kernels._cuda.SHIPPED``), is timed (``kvzip-cuda-4bit``)."""
    named = list(cuda_variants) != ["auto"]
    keys = []
    for backend in backends:
        if backend != "cuda":
            keys.append((f"kvzip-{backend}-{fname}", backend, "auto"))
            continue
        for v in cuda_variants:
            keys.append((f"kvzip-cuda-{v}-{fname}" if named else f"kvzip-cuda-{fname}", "cuda", v))
    return keys


def timer(torch, device, graph: bool = False):
    """``bench(fn, iters, warmup)`` -> median seconds. ``graph`` (CUDA): ``fn`` captured once
    in a CUDA graph and each replay timed: the device's time alone, without the host's per-call
    work (Python, launches), which otherwise shows through wherever it exceeds the kernels'
    (eager: each call timed as a server that runs it outside a graph sees it)."""

    def bench(fn, iters, warmup):
        for _ in range(warmup):
            fn()
        if device.type != "cuda":
            ts = []
            for _ in range(iters):
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
            return statistics.median(ts)
        call = fn
        if graph:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                fn()  # (a call on a side stream first, as torch.cuda.graphs asks)
            torch.cuda.current_stream(device).wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            call = g.replay
            call()
        torch.cuda.synchronize()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]  # fmt: skip
        for s, e in ev:
            s.record()
            call()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in ev) / 1e3

    return bench


def fill_pool(torch, fmt, lay, pool, gen) -> None:
    """Random codes; for formats with metadata, valid fp16 scale/zero (random bytes could be
    NaN/inf). The values do not change the work a decode kernel does."""
    flat = pool.view(-1)
    chunk = 1 << 28
    for i in range(0, flat.numel(), chunk):
        m = min(chunk, flat.numel() - i)
        if fmt.name == "fp8":
            tmp = torch.randn(m, device=pool.device, generator=gen, dtype=torch.bfloat16)
            flat[i : i + m].copy_(tmp.to(torch.float8_e4m3fn).view(torch.uint8))
        else:
            flat[i : i + m].copy_(torch.randint(0, 256, (m,), device=pool.device, generator=gen,
                                                dtype=torch.uint8))  # fmt: skip
    if fmt.name != "fp8" and lay.meta_bytes:
        meta = pool[..., lay.meta_offset :].view(torch.float16)  # [P, H, ps * meta_bytes / 2]
        per_tok = lay.meta_bytes // 2
        meta = meta.view(meta.shape[0], meta.shape[1], lay.block_size, per_tok)
        meta[..., 0].copy_(
            (torch.rand(meta.shape[:3], device=pool.device, generator=gen) * 0.3 + 0.05).half()
        )
        if per_tok > 1:
            meta[..., 1:].copy_((-7.5 * meta[..., :1].float()).half().expand_as(meta[..., 1:]))


def baseline_calls(torch, names, device, B, hq, hkv, d, ps, ctx, q, kv5, bt, sl, ws) -> dict:
    """name -> (callable, output) of the fp8 baselines that can be set up here; a baseline
    that cannot: name -> the reason (a string)."""
    out: dict = {}
    if device.type != "cuda":
        return dict.fromkeys(names, "not on a CUDA device")
    for name in names:
        try:
            if name == "xqa":
                from flashinfer.xqa import xqa

                o = torch.empty(B, 1, hq, d, dtype=torch.bfloat16, device=device)
                su = sl.view(B, 1).view(torch.uint32)
                fn = functools.partial(
                    xqa, q.view(B, 1, hq, d), kv5[:, 0], kv5[:, 1], bt, su, o, ws["xqa"],
                    ws["sem"], hkv, ps, q_scale=1.0, kv_scale=1.0,
                    sm_count=torch.cuda.get_device_properties(device).multi_processor_count,
                )  # fmt: skip
                out[name] = (fn, o.view(B, hq, d))
            elif name == "flashinfer-fp8":
                from flashinfer.decode import BatchDecodeWithPagedKVCacheWrapper

                w = BatchDecodeWithPagedKVCacheWrapper(ws["fi"], "NHD", use_tensor_cores=True)
                pps = ctx // ps
                w.plan(torch.arange(B + 1, dtype=torch.int32, device=device) * pps, bt.view(-1),
                       torch.full((B,), ps, dtype=torch.int32, device=device), hq, hkv, d, ps,
                       q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn,
                       o_data_type=torch.bfloat16)  # fmt: skip
                o = torch.empty(B, hq, d, dtype=torch.bfloat16, device=device)
                out[name] = (functools.partial(w.run, q, kv5, out=o), o)
            elif name == "vllm-fa3-fp8":
                from vllm.vllm_flash_attn import flash_attn_varlen_func

                one = torch.ones(B, hkv, dtype=torch.float32, device=device)
                o = torch.empty(B, hq, d, dtype=torch.bfloat16, device=device)
                fn = functools.partial(
                    flash_attn_varlen_func, q.to(torch.float8_e4m3fn), kv5[:, 0], kv5[:, 1],
                    max_seqlen_q=1, cu_seqlens_q=torch.arange(B + 1, dtype=torch.int32,
                                                              device=device),
                    max_seqlen_k=ctx, seqused_k=sl, block_table=bt, softmax_scale=d**-0.5,
                    causal=True, fa_version=3, q_descale=one, k_descale=one, v_descale=one, out=o,
                )  # fmt: skip
                fn()  # raises here where this vLLM cannot run it
                out[name] = (fn, o)
        except Exception as e:  # noqa: BLE001 - not installed, or not for this GPU: reported
            out[name] = f"{type(e).__name__}: {e}"[:300]
    return out


def run(o) -> dict:
    """The whole call (options ``o`` as ``kvzip bench kernels`` takes them)."""
    import torch
    from tqdm import tqdm

    from kvzip_eval.bench.engines import device_name
    from kvzip_formats import FormatError, get_format
    from kvzip_formats.ops import PagedLayout
    from kvzip_kernels.decode_plan import DecodeConfig, plan
    from kvzip_kernels.testing import synthetic_calibration

    if o.flashinfer_bundle:  # FlashInfer carried as a bundle (make_bundle.sh): its own set-up
        import importlib.util
        from types import SimpleNamespace

        path = Path(o.flashinfer_bundle) / "bench_xqa.py"
        spec = importlib.util.spec_from_file_location("bench_xqa", path)
        bx = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bx)
        bx.setup_env(SimpleNamespace(run_dir="/tmp/fi_run", compile_only=False))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = device_name()
    peak = o.peak_tbps or next((v for k, v in PEAK_TBPS.items() if k in name), None)
    backends = o.backends or (["triton", "cuda"] if device.type == "cuda" else ["triton"])
    build = None
    if "cuda" in backends:
        from kvzip_kernels import _cuda

        try:
            _cuda.build(tuple(torch.cuda.get_device_capability()))
            build = _cuda.failure(device)
        except Exception as e:  # noqa: BLE001 - reported; the Triton rows still run
            build = f"{type(e).__name__}: {e}"[:300]
        if build:
            backends = [b for b in backends if b != "cuda"]
    cuda_variants = list(getattr(o, "cuda_variants", None) or ["auto"])
    graph = getattr(o, "timing", "eager") == "graph"
    if graph and device.type != "cuda":
        raise ValueError("--timing graph needs a CUDA device (CUDA graphs): this run has none")
    bench = timer(torch, device, graph)
    gen = torch.Generator(device=device).manual_seed(1234)
    ps = o.block_size
    ws = {}
    if device.type == "cuda":
        ws = {"xqa": torch.zeros(256 << 20, dtype=torch.uint8, device=device),
              "sem": torch.zeros(2 << 20, dtype=torch.int32, device=device).view(torch.uint32),
              "fi": torch.zeros(512 << 20, dtype=torch.uint8, device=device)}  # fmt: skip
    rows, skipped = [], {}
    started = time.monotonic()
    configs = [(s, c, b) for s in o.shapes for c in o.contexts for b in o.batches]
    bar = tqdm(total=len(configs), desc="bench kernels", unit="config")
    for shape, ctx in dict.fromkeys((s, c) for s, c, _ in configs):
        if time.monotonic() - started > o.time_budget_s:
            skipped.update({f"{shape}/{ctx}/{b}": "time budget reached" for b in o.batches})
            bar.update(len(o.batches))
            continue
        hq, hkv, d = SHAPES[shape]
        pps = ctx // ps
        P = max(o.batches) * pps
        pools = {}
        for fname in dict.fromkeys(["fp8", *o.formats]):
            cal = synthetic_calibration(hkv, d) if fname[0].isdigit() else None
            fmt = get_format(fname, calibration=cal)
            kv, lays = [], []
            for kind in ("k", "v"):
                lay = PagedLayout.of(fmt, d, ps, kind)
                pool = torch.empty(P, hkv, lay.page_bytes, dtype=torch.uint8, device=device)
                fill_pool(torch, fmt, lay, pool, gen)
                kv.append(pool)
                lays.append(lay)
            pools[fname] = (fmt, lays[0].token_head_bytes + lays[1].token_head_bytes, kv)
        # the baselines' NHD fp8 cache holds kvzip's fp8 values (V pages are channel-major)
        kp, vp = pools["fp8"][2]
        kv5 = torch.empty(P, 2, ps, hkv, d, dtype=torch.uint8, device=device)
        kv5[:, 0].copy_(kp.view(P, hkv, ps, d).permute(0, 2, 1, 3))
        kv5[:, 1].copy_(vp.view(P, hkv, d, ps).permute(0, 3, 1, 2))
        kv5 = kv5.view(torch.float8_e4m3fn)
        for B in o.batches:
            bar.set_postfix_str(f"{shape} ctx {ctx} batch {B}")
            if time.monotonic() - started > o.time_budget_s:
                skipped[f"{shape}/{ctx}/{B}"] = "time budget reached"
                bar.update(1)
                continue
            bt = torch.randperm(P, device=device, generator=gen)[: B * pps].view(B, pps).int()
            sl = torch.full((B,), ctx, dtype=torch.int32, device=device)
            q = torch.randn(B, hq, d, device=device, generator=gen, dtype=torch.bfloat16)
            res, outs, nbytes = {}, {}, {}
            for bname, got in baseline_calls(torch, o.baselines, device, B, hq, hkv, d, ps, ctx,
                                             q, kv5, bt, sl, ws).items():  # fmt: skip
                if isinstance(got, str):
                    skipped[bname] = got
                    continue
                try:
                    res[bname] = bench(got[0], o.iters, o.warmup)
                except RuntimeError as e:  # e.g. a kernel that cannot be captured in a graph
                    skipped[bname] = f"{type(e).__name__}: {e}"[:300]
                    continue
                outs[bname], nbytes[bname] = got[1], B * ctx * hkv * 2 * d
            for fname, (fmt, tok_bytes, (kp, vp)) in pools.items():
                if fname not in o.formats and res:
                    continue  # fp8 for the baselines' data only
                for key, backend, variant in kernel_keys(backends, fname, cuda_variants):
                    oo = torch.empty_like(q)
                    try:
                        # planned once, as a server plans a step and runs it per layer (and as
                        # the baselines' plans and workspaces are made before their timing)
                        p = plan(fmt, num_q_heads=hq, head_dim=d, block_table=bt, seq_lens=sl,
                                 k_cache=kp, v_cache=vp, block_size=ps, max_seq_len=ctx,
                                 backend=backend,
                                 config=DecodeConfig(cuda_variant=variant))  # fmt: skip
                        fn = functools.partial(p.run, q, kp, vp, out=oo)
                        res[key] = bench(fn, o.iters, o.warmup)
                    except (FormatError, RuntimeError) as e:  # a format without this kernel
                        skipped[key] = f"{type(e).__name__}: {e}"[:300]
                        continue
                    outs[key], nbytes[key] = oo, B * ctx * hkv * tok_bytes
            base = [k for k in BASELINES if k in res] or ["kvzip-triton-fp8"]
            best = min(res[k] for k in base if k in res)
            for key, sec in res.items():
                # the same data through another kernel: kvzip's Triton kernel of the format
                twin = "kvzip-triton-" + (key.rsplit("-", 1)[1] if key.startswith("kvzip-")
                                          else "fp8")  # fmt: skip
                err = None
                if twin != key and twin in outs:
                    a, b = outs[key].float(), outs[twin].float()
                    err = round(((a - b).norm() / b.norm()).item(), 5)
                gbps = nbytes[key] / sec / 1e9
                rows.append({
                    "shape": shape, "batch": B, "context": ctx, "kernel": key,
                    "baseline": key in base, "us": round(sec * 1e6, 2), "gbps": round(gbps, 3),
                    "pct_hbm": round(100 * gbps / (1000 * peak), 1) if peak else None,
                    "speedup_vs_best_fp8": round(best / sec, 3), "cache_bytes": nbytes[key],
                    "rel_l2_vs_triton": err,
                })  # fmt: skip
            bar.update(1)
        del pools, kv5
        if device.type == "cuda":
            torch.cuda.empty_cache()
    bar.close()
    doc = output.header("kernels", "Paged decode attention beside the fp8 decode kernels",
                        name)  # fmt: skip
    doc.update(
        settings={
            "shapes": {s: SHAPES[s] for s in o.shapes},
            "batches": o.batches,
            "contexts": o.contexts,
            "formats": o.formats,
            "backends": backends,
            "cuda_variants": cuda_variants,
            "baselines": o.baselines,
            "block_size": ps,
            "iters": o.iters,
            "warmup": o.warmup,
            "peak_tbps": peak,
            "timing": "graph" if graph else "eager",
        },  # fmt: skip
        cuda_build_failure=build,
        skipped=skipped,
        rows=rows,
    )
    output.write(Path(o.out), "bench_kernels", doc, _markdown(doc), lambda ax: _plot(ax, rows))
    return doc


def _markdown(doc: dict) -> list[str]:
    s = doc["settings"]
    peak = f"{s['peak_tbps']} TB/s" if s["peak_tbps"] else "unknown (no share reported)"
    how = ("each call a CUDA graph's replay (the device's time)"
           if s.get("timing") == "graph" else "each call eager (the host's per-call work shows "
           "where it exceeds the kernels')")  # fmt: skip
    lines = [f"Page size {s['block_size']}; median of {s['iters']} timings after {s['warmup']} "
             f"warm-up calls, {how}; HBM peak {peak}. Baseline: the fastest fp8 kernel of "
             "each configuration (`baseline` column).", ""]  # fmt: skip
    lines += output.table(
        doc["rows"],
        [
            ("shape", "shape"),
            ("batch", "batch"),
            ("context", "context"),
            ("kernel", "kernel"),
            ("baseline", "baseline"),
            ("us", "us"),
            ("gbps", "GB/s"),
            ("pct_hbm", "% of HBM"),
            ("speedup_vs_best_fp8", "speedup vs best fp8"),
            ("rel_l2_vs_triton", "rel L2 vs kvzip's Triton on the same data"),
        ],
    )
    if doc["skipped"]:
        lines += ["", "Not run:", ""] + [f"- {k}: {v}" for k, v in doc["skipped"].items()]
    if doc["cuda_build_failure"]:
        lines += ["", f"CUDA kernels not built: {doc['cuda_build_failure']}"]
    return lines


def _plot(ax, rows: list[dict]) -> None:
    """Share of HBM bandwidth (GB/s where the peak is unknown) per configuration and kernel."""
    import numpy as np

    cfgs = list(dict.fromkeys((r["shape"], r["batch"], r["context"]) for r in rows))
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    share = all(r["pct_hbm"] is not None for r in rows)
    x = np.arange(len(cfgs))
    width = 0.8 / max(1, len(kernels))
    for i, k in enumerate(kernels):
        ys = [next((r["pct_hbm"] if share else r["gbps"] for r in rows
                    if (r["shape"], r["batch"], r["context"]) == c and r["kernel"] == k), 0)
              for c in cfgs]  # fmt: skip
        ax.bar(x + (i - (len(kernels) - 1) / 2) * width, ys, width, label=k)
    ax.set_xticks(x, [f"{s}\nB={b}\n{c // 1024}k" if c >= 1024 else f"{s}\nB={b}\n{c}"
                      for s, b, c in cfgs], fontsize=7)  # fmt: skip
    ax.set_ylabel("% of HBM bandwidth" if share else "GB/s of cache read")
    ax.set_title("Paged decode: cache bytes read per second")
    if kernels:
        ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
