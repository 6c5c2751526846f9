#!/usr/bin/env python3
"""Decode-attention speed on the H200: kvzip's formats vs fp8 baselines, one process, same data.

Times, per shape (Llama-3.1-8B: 32 q / 8 kv heads; 70B per GPU under TP8: 8 q / 1 kv; d 128),
batch (8/16/32/64) and context (32k/128k), page size 16:
  ours-<fmt>  kvzip_kernels.paged_decode for each kvzip format (int4, fp8, compact formats),
              Triton kernels (backend="triton")
  cuda-v6-<fmt>
              the same call with backend="cuda" (csrc/paged_decode.cu, design v6: int4,
              int4-rot, 4bit, 3.5bit, 3bit; the key names the design, as in the runs that
              timed the designs before it side by side: cuda-v4a-*, cuda-v5-*, cuda-v6s3-* in
              results/kernels/bench_paged_decode_v{5,6}.*), built first (build time and ptxas
              resources in the JSON), its output checked against ours-<fmt> of the same
              data (rel L2 in "checks") when the Triton backend is timed too
  xqa         FlashInfer's XQA (TensorRT-LLM's fp8 decode kernel), fp8 e4m3 cache
  fi_tc       FlashInfer's fp8 tensor-core decode (BatchDecodeWithPagedKVCacheWrapper)
The fp8 cache of xqa/fi_tc holds the same values as our fp8 kernel's cache (copied into their
NHD layout). Median of --iters CUDA-event timings after warm-up (bench_xqa.bench). Prints
us, GB/s of cache bytes read, % of 4.3 TB/s and the speedup against the best fp8 (the faster of
xqa and fi_tc); writes bench_paged_decode.json and .md to $OUT (or --out).

FlashInfer comes from the bundle of ../shared/tools/flashinfer-baseline (make_bundle.sh), whose
bench_xqa.py is imported at run time for its set-up and timing helpers:
    PYTHONPATH=packages/kvzip-formats/src:packages/kvzip-kernels/src \\
      python3 packages/kvzip-kernels/benchmarks/bench_paged_decode.py --bundle .carry/flashinfer
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.util
import json
import os
import platform
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

SHAPES = {"8b": (32, 8, 128), "70b-tp8": (8, 1, 128)}
PEAK = 4.3e12
#: the CUDA kernel's design, in its result keys (cuda-v6-<fmt>)
CUDA_DESIGN = "v6"


def parse():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--bundle", default=".carry/flashinfer", help="folder made by make_bundle.sh")
    p.add_argument("--shapes", default="8b,70b-tp8")
    p.add_argument("--batches", default="8,16,32,64")
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--formats", default="fp8,int4", help="kvzip formats timed with our kernels")
    p.add_argument("--baselines", default="xqa,fi_tc")
    p.add_argument(
        "--backends", default="triton,cuda", help="our backends: triton (ours-*), cuda (cuda-*)"
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument(
        "--sweep",
        default="",
        help="our configs to compare, e.g. 64/4/2,128/8/3 "
        "(block_n/num_warps/num_stages[/split_tokens]); the first is the default",
    )
    p.add_argument(
        "--recent",
        type=int,
        default=0,
        help="also time each compact format with its sink token (<fmt>+s) and with the sink "
        "and a residual window of this many bf16 tokens (<fmt>+rR; spec/residual_window.md)",
    )
    p.add_argument(
        "--legacy-splits",
        action="store_true",
        help="also time the CUDA kernel with the split count of the rule before split sizing by "
        "rounds (decode_plan._num_splits without the kernel's residency): keys "
        "cuda-v6-<fmt>@legacy-splits",
    )
    p.add_argument(
        "--graphs",
        action="store_true",
        help="also time each CUDA-kernel call replayed from a CUDA graph (no host work per "
        "call): keys cuda-v6-<fmt>@graph (and @legacy-splits-graph); a call that cannot be "
        "captured is reported and skipped. Against the eager fp8 baselines: a diagnostic of "
        "host-bound calls, not a like-for-like speedup",
    )
    p.add_argument("--time-budget-s", type=float, default=480)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--tag", default="", help="suffix of the output file names")
    a = p.parse_args()
    a.shapes = a.shapes.split(",")
    a.batches = [int(x) for x in a.batches.split(",")]
    a.contexts = [int(x) for x in a.contexts.split(",")]
    a.formats = [x for x in a.formats.split(",") if x]
    a.baselines = [x for x in a.baselines.split(",") if x]
    a.backends = [x for x in a.backends.split(",") if x]
    return a


def fmt_of(key: str) -> str:
    """The kvzip format of a result key: ours-<fmt>[@cfg], cuda-<design>-<fmt>[@cfg] (design
    v4a, v5, v6, v6s3, ...), or cuda-<fmt>[@cfg] (a key without the design)."""
    key = key.split("@")[0].split("+")[0]
    if key.startswith("ours-"):
        return key.removeprefix("ours-")
    if key.startswith("cuda-"):
        rest = key.removeprefix("cuda-")
        design, _, fmt = rest.partition("-")
        return fmt if re.fullmatch(r"v\d+[a-z0-9]*", design) and fmt else rest
    return key


def build_cuda(torch):
    """Build the CUDA decode kernel for this GPU; its build time and ptxas resource lines."""
    import subprocess

    from kvzip_kernels import _cuda

    cap = tuple(torch.cuda.get_device_capability())
    t0 = time.time()
    info = dict(capability=list(cap))
    try:
        info["so"] = str(_cuda.build(cap))
        info["build_s"] = round(time.time() - t0, 1)
        cmd = [_cuda.nvcc(), "-O3", *_cuda.arch_flags(cap), "-Xptxas", "-v", "-cubin"]
        r = subprocess.run(
            [*cmd, "-o", "/dev/null", str(_cuda._SRC)], capture_output=True, text=True
        )
        info["ptxas"] = [
            ln.strip() for ln in r.stderr.splitlines() if "Used" in ln or "spill" in ln
        ]
        info["failure"] = _cuda.failure(torch.device("cuda"))
    except Exception as ex:  # noqa: BLE001  (reported, the Triton rows still run)
        info["failure"] = f"{type(ex).__name__}: {ex}"
    return info


def load_bench_xqa(bundle: Path):
    spec = importlib.util.spec_from_file_location("bench_xqa", bundle / "bench_xqa.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def parse_configs(text, DecodeConfig):
    out = []
    for item in [x for x in text.split(",") if x]:
        v = [int(x) for x in item.split("/")]
        out.append(
            (
                item,
                DecodeConfig(
                    block_n=v[0],
                    num_warps=v[1],
                    num_stages=v[2],
                    split_tokens=v[3] if len(v) > 3 else 2048,
                ),
            )
        )
    return out or [("default", DecodeConfig())]


def graphed(torch, fn):
    """``fn`` captured into a CUDA graph (after one call on a side stream): its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g.replay


def fill_pool(torch, fmt, lay, pool, gen):
    """Random codes; for formats with metadata, valid fp16 scale/zero (random bytes could be
    NaN/inf). The values do not change the work a decode kernel does."""
    flat = pool.view(-1)
    chunk = 1 << 28
    if fmt.name == "fp8":
        for i in range(0, flat.numel(), chunk):
            m = min(chunk, flat.numel() - i)
            tmp = torch.randn(m, device=pool.device, generator=gen, dtype=torch.bfloat16)
            flat[i : i + m].copy_(tmp.to(torch.float8_e4m3fn).view(torch.uint8))
        return
    for i in range(0, flat.numel(), chunk):
        m = min(chunk, flat.numel() - i)
        flat[i : i + m].copy_(
            torch.randint(0, 256, (m,), device=pool.device, generator=gen, dtype=torch.uint8)
        )
    if lay.meta_bytes:
        meta = pool[..., lay.meta_offset :].view(torch.float16)  # [P, H, ps * meta_bytes / 2]
        per_tok = lay.meta_bytes // 2
        meta = meta.view(meta.shape[0], meta.shape[1], lay.block_size, per_tok)
        meta[..., 0].copy_(
            (torch.rand(meta.shape[:3], device=pool.device, generator=gen) * 0.3 + 0.05).half()
        )
        if per_tok > 1:
            meta[..., 1:].copy_((-7.5 * meta[..., :1].float()).half().expand_as(meta[..., 1:]))


def kernel_info():
    """Registers, spills, shared memory and a few PTX instruction counts of our compiled kernels."""
    from kvzip_kernels import _decode_codebook, _decode_kernels

    info = []
    for mod, kname in (
        (_decode_kernels, "_int4_split_kernel"),
        (_decode_kernels, "_fp8_split_kernel"),
        (_decode_codebook, "_codebook_split_kernel"),
    ):
        try:
            for cache in getattr(mod, kname).device_caches.values():
                for ck in cache[0].values():
                    ptx = ck.asm.get("ptx", "")
                    md = ck.metadata
                    info.append(
                        dict(
                            kernel=kname,
                            n_regs=ck.n_regs,
                            n_spills=ck.n_spills,
                            shared=md.shared,
                            num_warps=md.num_warps,
                            num_stages=md.num_stages,
                            ptx_counts={
                                k: ptx.count(k)
                                for k in (
                                    "mma.sync",
                                    "wgmma",
                                    "cp.async",
                                    "ld.global.v4",
                                    "ld.global.nc.v4",
                                    "ld.shared",
                                    "ldmatrix",
                                    "cvt.rn",
                                )
                            },
                        )
                    )
        except Exception as ex:  # noqa: BLE001  (diagnostics only)
            info.append(dict(kernel=kname, error=repr(ex)))
    return info


def main():
    a = parse()
    t_start = time.time()
    bx = load_bench_xqa(Path(a.bundle).resolve()) if a.baselines else None
    if bx is not None:
        bx.setup_env(
            SimpleNamespace(run_dir=os.environ.get("FI_RUN_DIR", "/tmp/fi_run"), compile_only=False)
        )
    import torch
    import triton

    import kvzip_kernels
    from kvzip_formats import FormatError, get_format
    from kvzip_formats.ops import PagedLayout
    from kvzip_kernels import DecodeConfig, paged_decode
    from kvzip_kernels.testing import synthetic_calibration

    dev = torch.device("cuda")
    prop = torch.cuda.get_device_properties(dev)
    log = []

    def say(msg):
        print(msg, flush=True)
        log.append(msg)

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "kvzip_kernels": kvzip_kernels.__version__,
    }
    if bx is not None:
        import flashinfer
        from flashinfer.decode import BatchDecodeWithPagedKVCacheWrapper
        from flashinfer.xqa import xqa

        versions["flashinfer"] = flashinfer.__version__
        jit_args = SimpleNamespace(
            models=a.shapes, page_sizes=[a.block_size], backends=[b for b in a.baselines]
        )
        say(f"[jit] flashinfer modules built in {bx.build_all(bx.jit_specs(jit_args, torch)):.1f}s")
    say(f"[env] {prop.name}, {prop.multi_processor_count} SMs; {versions}")
    cuda_info = build_cuda(torch) if "cuda" in a.backends else None
    if cuda_info is not None:
        say(f"[cuda] {cuda_info}")
    configs = parse_configs(a.sweep, DecodeConfig)
    from kvzip_kernels._cuda import FORMATS as cuda_formats

    gen = torch.Generator(device=dev)
    gen.manual_seed(1234)
    ps = a.block_size
    rows, checks = [], []
    bench = bx.bench if bx is not None else None
    if bench is None:
        import statistics

        def bench(torch_, fn, iters, warmup):
            for _ in range(warmup):
                fn()
            torch.cuda.synchronize()
            ev = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(iters)
            ]
            for s, e in ev:
                s.record()
                fn()
                e.record()
            torch.cuda.synchronize()
            ts = sorted(s.elapsed_time(e) * 1e3 for s, e in ev)
            return statistics.median(ts), ts[0], ts[-1]

    xqa_scratch = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    xqa_sem = torch.zeros(2 << 20, dtype=torch.int32, device=dev).view(torch.uint32)
    fi_ws = (
        torch.zeros(512 << 20, dtype=torch.uint8, device=dev) if "fi_tc" in a.baselines else None
    )
    stop = False
    for shape in a.shapes:
        hq, hkv, d = SHAPES[shape]
        for ctx in a.contexts:
            pps = ctx // ps
            P = max(a.batches) * pps
            pools = {}
            for name in a.formats:
                # compact formats: a synthetic calibration (random d x d transforms); the work
                # of the kernel does not depend on the statistics
                cal = synthetic_calibration(hkv, d) if name[0].isdigit() else None
                fmt = get_format(name, calibration=cal)
                kv, lays = [], []
                for kind in ("k", "v"):
                    lay = PagedLayout.of(fmt, d, ps, kind)
                    pool = torch.empty(P, hkv, lay.page_bytes, dtype=torch.uint8, device=dev)
                    fill_pool(torch, fmt, lay, pool, gen)
                    kv.append(pool)
                    lays.append(lay)
                # bytes per token and KV head, K and V together
                pools[name] = (fmt, lays[0].token_head_bytes + lays[1].token_head_bytes, kv)
            kv5 = None
            if a.baselines:
                if "fp8" not in pools:
                    raise SystemExit("baselines need the fp8 format in --formats (same data)")
                _, _, (kp, vp) = pools["fp8"]
                kv5 = torch.empty(P, 2, ps, hkv, d, dtype=torch.uint8, device=dev)
                kv5[:, 0].copy_(kp.view(P, hkv, ps, d).permute(0, 2, 1, 3))
                # our V pages are channel-major ([d, ps] per page and head; spec/paged_layout.md)
                kv5[:, 1].copy_(vp.view(P, hkv, d, ps).permute(0, 3, 1, 2))
                kv5 = kv5.view(torch.float8_e4m3fn)
            torch.cuda.synchronize()
            for B in a.batches:
                if time.time() - t_start > a.time_budget_s:
                    say(f"!! time budget reached, skipping {shape} ctx {ctx} B {B}")
                    stop = True
                    break
                bt = (
                    torch.randperm(P, device=dev, generator=gen)[: B * pps]
                    .view(B, pps)
                    .to(torch.int32)
                )
                sl = torch.full((B,), ctx, dtype=torch.int32, device=dev)
                q = torch.randn(B, hq, d, device=dev, generator=gen, dtype=torch.bfloat16)
                res = {}
                outs = {}
                if "xqa" in a.baselines:
                    o = torch.empty(B, 1, hq, d, dtype=torch.bfloat16, device=dev)
                    su = sl.view(B, 1).view(torch.uint32)
                    fn = functools.partial(
                        xqa,
                        q.view(B, 1, hq, d),
                        kv5[:, 0],
                        kv5[:, 1],
                        bt,
                        su,
                        o,
                        xqa_scratch,
                        xqa_sem,
                        hkv,
                        ps,
                        q_scale=1.0,
                        kv_scale=1.0,
                        sm_count=prop.multi_processor_count,
                    )
                    res["xqa"] = bench(torch, fn, a.iters, a.warmup)[0]
                    outs["xqa"] = o.view(B, hq, d)
                if "fi_tc" in a.baselines:
                    w = BatchDecodeWithPagedKVCacheWrapper(fi_ws, "NHD", use_tensor_cores=True)
                    indptr = torch.arange(B + 1, dtype=torch.int32, device=dev) * pps
                    last = torch.full((B,), ps, dtype=torch.int32, device=dev)
                    w.plan(
                        indptr,
                        bt.view(-1),
                        last,
                        hq,
                        hkv,
                        d,
                        ps,
                        q_data_type=torch.bfloat16,
                        kv_data_type=torch.float8_e4m3fn,
                        o_data_type=torch.bfloat16,
                    )
                    o = torch.empty(B, hq, d, dtype=torch.bfloat16, device=dev)
                    fn = functools.partial(w.run, q, kv5, out=o)
                    res["fi_tc"] = bench(torch, fn, a.iters, a.warmup)[0]
                    outs["fi_tc"] = o
                runs = [(b_, c_) for b_ in a.backends for c_ in configs]
                if a.legacy_splits and "cuda" in a.backends:
                    from kvzip_kernels.decode_plan import _num_splits

                    for _, c_ in configs:
                        n = c_.num_splits or _num_splits(B, hkv, ctx, c_, dev)
                        legacy = dataclasses.replace(c_, num_splits=n)
                        runs.append(("cuda", ("legacy-splits", legacy)))
                # with --recent, the compact formats also with their sink (+s) and with the
                # sink and a residual window (+rR): the window's cost is +rR against +s
                bf = functools.partial(torch.randn, device=dev, generator=gen, dtype=torch.bfloat16)
                sink = (bf(B, 1, hkv, d), bf(B, 1, hkv, d))
                extras = [("", {})]
                if a.recent:
                    win = (bf(B, a.recent, hkv, d), bf(B, a.recent, hkv, d))
                    extras += [
                        ("+s", dict(sinks=sink)),
                        (f"+r{a.recent}", dict(sinks=sink, recent=win)),
                    ]
                for name, (fmt, _, (kp, vp)) in pools.items():
                    for (backend, (label, cfg)), (tail, ex_kw) in (
                        (r, e) for r in runs for e in extras
                    ):
                        if tail and not name[0].isdigit():
                            continue  # sinks and windows: the compact formats only
                        o = torch.empty_like(q)
                        fn = functools.partial(
                            paged_decode,
                            fmt,
                            q,
                            kp,
                            vp,
                            bt,
                            sl,
                            block_size=ps,
                            max_seq_len=ctx,
                            out=o,
                            config=cfg,
                            backend=backend,
                            **ex_kw,
                        )
                        prefix = "ours" if backend == "triton" else f"cuda-{CUDA_DESIGN}"
                        named = len(configs) > 1 or label == "legacy-splits"
                        key = f"{prefix}-{name}{tail}" + (f"@{label}" if named else "")
                        try:
                            res[key] = bench(torch, fn, a.iters, a.warmup)[0]
                        except FormatError as ex:  # a format without a (CUDA) decode kernel
                            if backend == "triton" or name in cuda_formats:
                                say(f"!! {key}: {ex}")
                            continue
                        except RuntimeError as ex:  # a failed CUDA launch: the others still run
                            if backend == "triton":
                                raise
                            say(f"!! {key}: {type(ex).__name__}: {ex}")
                            continue
                        outs[key] = o
                        if a.graphs and backend == "cuda":
                            gkey = f"{key}-graph" if "@" in key else f"{key}@graph"
                            try:
                                res[gkey] = bench(torch, graphed(torch, fn), a.iters, a.warmup)[0]
                                outs[gkey] = o
                            except Exception as ex:  # noqa: BLE001 - a call that cannot be captured
                                say(f"!! {gkey}: not captured: {type(ex).__name__}: {ex}")
                                torch.cuda.synchronize()
                        twins = ["ours" + key.removeprefix(prefix)]
                        if key.endswith("@legacy-splits"):  # the same kernel, other splits
                            twins.append(key.removesuffix("@legacy-splits"))
                        for twin in twins:
                            if backend == "triton" or twin not in outs:
                                continue
                            o1, o2 = o.float(), outs[twin].float()
                            e = ((o1 - o2).norm() / o2.norm()).item()
                            checks.append(
                                dict(shape=shape, batch=B, context=ctx, pair=f"{key}~{twin}",
                                     rel_l2=e)
                            )  # fmt: skip
                            say(f"[check] rel L2 {key} vs {twin}: {e:.5f}")
                best = min([res[k] for k in ("xqa", "fi_tc") if k in res], default=float("nan"))
                for key, us in res.items():
                    name = fmt_of(key)
                    kv_bytes = pools[name][1] if name in pools else 2 * d
                    nbytes = B * ctx * hkv * kv_bytes
                    gbps = nbytes / (us * 1e-6) / 1e9
                    row = dict(
                        shape=shape,
                        batch=B,
                        context=ctx,
                        format=key,
                        us=round(us, 2),
                        gbps=round(gbps, 1),
                        pct_hbm=round(100 * gbps * 1e9 / PEAK, 1),
                        speedup_vs_best_fp8=round(best / us, 3),
                        cache_bytes=nbytes,
                    )
                    rows.append(row)
                    finite = bool(torch.isfinite(outs[key]).all())
                    say(
                        f"{shape:8s} B={B:3d} ctx={ctx:6d} {key:22s} {us:9.1f} us {gbps:7.0f} GB/s "
                        f"{row['pct_hbm']:5.1f}%  x{row['speedup_vs_best_fp8']:.2f} vs best fp8"
                        + ("" if finite else "  NON-FINITE OUTPUT")
                    )
                fp8_ours = [k for k in outs if k.startswith("ours-fp8")]
                for base in ("xqa", "fi_tc"):
                    if base in outs and fp8_ours:
                        o1, o2 = outs[fp8_ours[0]].float(), outs[base].float()
                        e = ((o1 - o2).norm() / o2.norm()).item()
                        checks.append(
                            dict(
                                shape=shape,
                                batch=B,
                                context=ctx,
                                pair=f"{fp8_ours[0]}~{base}",
                                rel_l2=e,
                            )
                        )
                        say(f"[check] rel L2 {fp8_ours[0]} vs {base}: {e:.4f}")
            pools = kv5 = None  # free the pools before the next context
            torch.cuda.empty_cache()
            if stop:
                break
        if stop:
            break

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(
        kernels=kernel_info(),
        cuda=cuda_info,
        device=prop.name,
        sms=prop.multi_processor_count,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        versions=versions,
        command=" ".join([Path(sys.executable).name] + sys.argv),
        iters=a.iters,
        warmup=a.warmup,
        block_size=ps,
        peak_bytes_per_s=PEAK,
        configs={k: vars(c) if hasattr(c, "__dict__") else str(c) for k, c in configs},
        elapsed_s=round(time.time() - t_start, 1),
    )
    tag = f"_{a.tag}" if a.tag else ""
    (out / f"bench_paged_decode{tag}.json").write_text(
        json.dumps(dict(meta, rows=rows, checks=checks), indent=1, default=str)
    )
    md = [
        f"# Paged decode attention, {prop.name}",
        "",
        f"{meta['date']}; {versions}; page size {ps}; median of {a.iters} CUDA-event timings.",
        f"Command: `{meta['command']}`",
        "",
        "| shape | batch | context | format | us | GB/s | % of 4.3 TB/s | speedup vs best fp8 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        md.append(
            f"| {r['shape']} | {r['batch']} | {r['context']} | {r['format']} | {r['us']} | "
            f"{r['gbps']} | {r['pct_hbm']} | {r['speedup_vs_best_fp8']} |"
        )
    keys = list(dict.fromkeys(r["format"] for r in rows if r["format"] not in ("xqa", "fi_tc")))
    md += [
        "",
        "Speedup against the best fp8 (the faster of xqa and fi_tc) per configuration:",
        "",
        "| shape | batch | context | best fp8 us | " + " | ".join(keys) + " |",
        "|---|---|---|---|" + "---|" * len(keys),
    ]
    by = {}
    for r in rows:
        by.setdefault((r["shape"], r["batch"], r["context"]), {})[r["format"]] = r
    for (shape_, b_, c_), rs in by.items():
        best_ = min((rs[k]["us"] for k in ("xqa", "fi_tc") if k in rs), default=float("nan"))
        cells = [
            f"{rs[k]['speedup_vs_best_fp8']:.2f}x" if k in rs else "-" for k in keys
        ]  # fmt: skip
        md.append(f"| {shape_} | {b_} | {c_} | {best_} | " + " | ".join(cells) + " |")
    (out / f"bench_paged_decode{tag}.md").write_text("\n".join(md) + "\n")
    say(f"wrote {out}/bench_paged_decode{tag}.json/.md in {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
