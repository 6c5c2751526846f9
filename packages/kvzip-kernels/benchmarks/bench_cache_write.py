#!/usr/bin/env python3
"""Cache-write cost against a prefill of the same tokens (issue 7 item 4), on the GPU.

For T new tokens of one Llama-3.1-8B layer (8 KV heads, d 128) the cache-write quantises and
scatters K and V (two kvzip_kernels.cache_write calls). The prefill of the same T tokens through
that layer (bf16, random weights: RMSNorm, QKV, causal GQA attention via SDPA, O, SwiGLU MLP)
is timed beside it in the same run; the ratio is the write's share of the prefill (issue 27
item 5: under 2%). Write paths of the compact formats: ``shipped`` (the package's
``cache_write`` as kvzip-vllm's backend calls it: since 2026-12-02 the one-kernel write of
``_write_compact.py``, the transform as exact bfloat16 pieces on the tensor cores, in its
default configuration), ``compact`` (that kernel called directly, one row per
``--compact-configs`` entry) and ``fused`` (write_fused.py beside this script: the earlier
one-kernel write with a float32 FMA transform, a research variant). The split path (torch
``sub`` + float32 ``bmm`` + a quantize/pack kernel), timed as ``<fmt>`` with ``path`` "split"
in the runs up to ``bench_cache_write_cwrite.json``, left the package (NOTES.md). Slots:
``blocks`` = as vLLM writes a prompt (consecutive tokens fill a block, the blocks in random
order), ``tokens`` = every token at a random slot (the pattern of the earlier runs). Writes
bench_cache_write[_tag].json/.md to $OUT (or --out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path


def timeit(torch, fn, iters=20, warmup=3):
    """Median GPU time (us). A sleep kernel queued first lets the host enqueue every call
    ahead of the GPU, so host launch overhead (which vLLM hides behind earlier layers) is not
    timed (as bench_xqa.bench)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)
    ev = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(iters)
    ]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in ev)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", default="2048,8192,32768")
    p.add_argument("--formats", default="fp8,int4,4bit,3.5bit,3bit")
    p.add_argument(
        "--write-paths",
        default="shipped",
        help="compact formats' write paths: shipped = the package's cache_write (the "
        "one-kernel write of kvzip_kernels._write_compact), compact = that kernel called "
        "directly per --compact-configs entry, fused = the earlier one-kernel write "
        "(write_fused.py beside this script, a research variant)",
    )
    p.add_argument(
        "--compact-configs",
        default="128/8/2/-1,64/4/2/-1,128/8/1/0",
        help="BT/num_warps/num_stages/programs per KV head (-1: SMs / heads, 0: one per tile)",
    )
    p.add_argument("--slots", default="blocks,tokens", help="slot patterns: blocks, tokens")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--tag", default="", help="suffix of the output file names")
    a = p.parse_args()
    import torch
    import torch.nn.functional as F
    import triton

    dev = torch.device("cuda")
    # the 8B config of the benchmarks' one helper (kvzip-eval's source, in this checkout)
    sys.path.append(str(Path(__file__).resolve().parents[2] / "kvzip-eval" / "src"))
    from kvzip_eval.bench.engines import LLAMA31_8B as c

    hid, hq, hkv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    inter, d, ps = c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"], 16
    g = torch.Generator(device=dev).manual_seed(0)

    def w(*shape):
        return torch.randn(*shape, device=dev, generator=g, dtype=torch.bfloat16) * 0.02

    wq, wk, wv, wo = w(hq * d, hid), w(hkv * d, hid), w(hkv * d, hid), w(hid, hq * d)
    wg, wu, wd = w(inter, hid), w(inter, hid), w(hid, inter)
    ln1, ln2 = (
        torch.ones(hid, device=dev, dtype=torch.bfloat16),
        torch.ones(hid, device=dev, dtype=torch.bfloat16),
    )

    def layer(x):
        t = x.shape[0]
        h = F.rms_norm(x, (hid,), ln1)
        q = (h @ wq.T).view(t, hq, d).transpose(0, 1)
        k = (h @ wk.T).view(t, hkv, d).transpose(0, 1)
        v = (h @ wv.T).view(t, hkv, d).transpose(0, 1)
        o = F.scaled_dot_product_attention(
            q[None], k[None], v[None], is_causal=True, enable_gqa=True
        )
        x = x + o[0].transpose(0, 1).reshape(t, hq * d) @ wo.T
        h = F.rms_norm(x, (hid,), ln2)
        return x + (F.silu(h @ wg.T) * (h @ wu.T)) @ wd.T

    rows = []
    for T in [int(x) for x in a.tokens.split(",")]:
        x = torch.randn(T, hid, device=dev, generator=g, dtype=torch.bfloat16)
        prefill_us = timeit(torch, lambda x=x: layer(x), iters=10)
        k = torch.randn(T, hkv, d, device=dev, generator=g, dtype=torch.bfloat16)
        v = torch.randn(T, hkv, d, device=dev, generator=g, dtype=torch.bfloat16)
        nb = T // ps + 8
        for pattern in a.slots.split(","):
            if pattern == "tokens":
                slots = torch.randperm(nb * ps, device=dev, generator=g)[:T]
            else:  # consecutive tokens fill a block; the blocks in random order
                blocks = torch.randperm(nb, device=dev, generator=g)[: -(-T // ps)]
                slots = (blocks[:, None] * ps + torch.arange(ps, device=dev)).flatten()[:T]
            for name in a.formats.split(","):
                rows += _format_rows(a, torch, name, T, pattern, slots, k, v, nb, prefill_us)
    prop = torch.cuda.get_device_properties(dev)
    meta = dict(
        device=prop.name,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        versions=dict(
            python=platform.python_version(),
            torch=torch.__version__,
            triton=triton.__version__,
            cuda=torch.version.cuda,
        ),
        command=" ".join([Path(sys.executable).name] + sys.argv),
        note="per layer of Llama-3.1-8B: K and V write vs one decoder layer's prefill (bf16)",
    )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"_{a.tag}" if a.tag else ""
    (out / f"bench_cache_write{tag}.json").write_text(json.dumps(dict(meta, rows=rows), indent=1))
    md = [
        f"# Cache-write cost vs prefill, {prop.name}",
        "",
        f"{meta['date']}; {meta['versions']}",
        f"Command: `{meta['command']}`",
        "",
        meta["note"],
        "",
        "| tokens | slots | format | config | write (K+V) us | prefill layer us | % of prefill "
        "| write GB/s | bytes = shipped |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    md += [
        f"| {r['tokens']} | {r['slots']} | {r['format']} | {r['config']} | {r['us']} | "
        f"{r['prefill_us']} | {r['pct_of_prefill']} | {r['write_gbps']} | "
        f"{r.get('same_bytes_as_shipped', '')} |"
        for r in rows
    ]
    (out / f"bench_cache_write{tag}.md").write_text("\n".join(md) + "\n")


def _variants(a, name):
    """(path, config) pairs timed for one format."""
    if not name[0].isdigit():
        return [("shipped", "")]
    out = []
    for path in a.write_paths.split(","):
        if path == "compact":
            out += [("compact", c) for c in a.compact_configs.split(",")]
        else:
            out.append((path, ""))
    return out


def _format_rows(a, torch, name, T, pattern, slots, k, v, nb, prefill_us):
    from kvzip_formats import get_format
    from kvzip_formats.ops import PagedLayout, new_paged_cache
    from kvzip_kernels import cache_write
    from kvzip_kernels._write_compact import compact_write
    from kvzip_kernels.cache_write import new_status
    from kvzip_kernels.testing import synthetic_calibration

    dev, hkv, d, ps = k.device, k.shape[1], k.shape[2], 16
    cal = synthetic_calibration(hkv, d) if name[0].isdigit() else None
    fmt = get_format(name, calibration=cal)
    lays = {kd: PagedLayout.of(fmt, d, ps, kd) for kd in "kv"}
    status = new_status(dev)
    rows, first = [], None
    for path, cfg in _variants(a, name):
        kc = new_paged_cache(fmt, nb, hkv, ps, d, device=dev, kind="k")
        vc = new_paged_cache(fmt, nb, hkv, ps, d, device=dev, kind="v")
        if path == "shipped":
            # as kvzip-vllm's backend calls it: no host read of the slots or of the verdict
            # (the runs before 2026-12-02 checked the values: a device sync in every call)
            def write(kc=kc, vc=vc, kinds="kv"):
                args = dict(block_size=ps, check_slots=False, check_values=False, status=status)
                for kind, x, c in (("k", k, kc), ("v", v, vc)):
                    if kind in kinds:
                        cache_write(fmt, x, c, slots, kind=kind, **args)

        else:
            if path == "fused":
                from write_fused import codebook_write_fused as kern
            else:
                kern = compact_write
            kw = {}
            if path == "compact":
                bt, nw, ns, pr = map(int, cfg.split("/"))
                kw = dict(block_t=bt, num_warps=nw, num_stages=ns, programs=pr)

            def write(kc=kc, vc=vc, kern=kern, kw=kw, kinds="kv"):
                for kind, x, c in (("k", k, kc), ("v", v, vc)):
                    if kind in kinds:
                        lay = lays[kind]
                        kern(fmt, x, c, slots, lay, kind, 0, hkv * lay.page_bytes, status, **kw)

        us = timeit(torch, write)
        apart = {}
        if path == "shipped" and name[0].isdigit():  # K and V apart
            apart = {
                f"us_{kd}": round(timeit(torch, lambda kd=kd: write(kinds=kd)), 2) for kd in "kv"
            }
        moved = 2 * T * hkv * (d * 2 + fmt.token_head_bytes(d))
        label = name if path == "shipped" else f"{name}-{path}"
        row = dict(
            tokens=T,
            slots=pattern,
            format=label,
            path=path,
            config=cfg,
            us=round(us, 2),
            prefill_us=round(prefill_us, 1),
            pct_of_prefill=round(100 * us / prefill_us, 3),
            write_gbps=round(moved / us / 1e3, 1),
            **apart,
        )
        if path == "shipped":
            first = (kc, vc)
        elif first is not None:  # bytes = the shipped path's (codes move where y's rounding does)
            same = sum(int((x == y).sum()) for x, y in zip(first, (kc, vc), strict=True))
            row["same_bytes_as_shipped"] = round(same / (kc.numel() + vc.numel()), 7)
        rows.append(row)
        print(row, flush=True)
    assert not status.any(), "a write rejected random normal rows"
    return rows


if __name__ == "__main__":
    main()
