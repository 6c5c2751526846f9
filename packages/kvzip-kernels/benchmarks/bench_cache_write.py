#!/usr/bin/env python3
"""Cache-write cost against a prefill of the same tokens (issue 7 item 4), on the GPU.

For T new tokens of one Llama-3.1-8B layer (8 KV heads, d 128) the cache-write quantises and
scatters K and V (two kvzip_kernels.cache_write calls). The prefill of the same T tokens through
that layer (bf16, random weights: RMSNorm, QKV, causal GQA attention via SDPA, O, SwiGLU MLP)
is timed beside it; the ratio is the write's share of the prefill. Writes
bench_cache_write.json/.md to $OUT (or --out).
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
        default="split,fused",
        help="compact formats' write paths: split = sub + bmm + quantize/pack kernel (the "
        "package's cache_write), fused = one kernel (write_fused.py beside this script, a "
        "research variant; rows <fmt>-fused)",
    )
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--tag", default="", help="suffix of the output file names")
    a = p.parse_args()
    import torch
    import torch.nn.functional as F
    import triton
    from write_fused import codebook_write_fused

    from kvzip_formats import get_format
    from kvzip_formats.ops import PagedLayout, new_paged_cache
    from kvzip_kernels import cache_write
    from kvzip_kernels.cache_write import new_status
    from kvzip_kernels.testing import synthetic_calibration

    dev = torch.device("cuda")
    hid, hq, hkv, d, inter, ps = 4096, 32, 8, 128, 14336, 16
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
        slots = torch.randperm(nb * ps, device=dev, generator=g)[:T]
        for name in a.formats.split(","):
            cal = synthetic_calibration(hkv, d) if name[0].isdigit() else None
            fmt = get_format(name, calibration=cal)
            paths = a.write_paths.split(",") if name[0].isdigit() else ["split"]
            first = None
            for path in paths:
                kc = new_paged_cache(fmt, nb, hkv, ps, d, device=dev, kind="k")
                vc = new_paged_cache(fmt, nb, hkv, ps, d, device=dev, kind="v")

                def write(fmt=fmt, kc=kc, vc=vc, k=k, v=v, slots=slots):
                    cache_write(fmt, k, kc, slots, kind="k", block_size=ps, check_slots=False)
                    cache_write(fmt, v, vc, slots, kind="v", block_size=ps, check_slots=False)

                if path == "fused":
                    lays = {kd: PagedLayout.of(fmt, d, ps, kd) for kd in "kv"}
                    status = new_status(dev)

                    def write(fmt=fmt, kc=kc, vc=vc, k=k, v=v, slots=slots, lays=lays, st=status):
                        for kind, x, c in (("k", k, kc), ("v", v, vc)):
                            lay = lays[kind]
                            stride = hkv * lay.page_bytes
                            codebook_write_fused(fmt, x, c, slots, lay, kind, 0, stride, st)

                us = timeit(torch, write)
                moved = 2 * T * hkv * (d * 2 + fmt.token_head_bytes(d))
                row = dict(
                    tokens=T,
                    format=name if path == "split" else f"{name}-{path}",
                    write_us=round(us, 2),
                    prefill_layer_us=round(prefill_us, 1),
                    pct_of_prefill=round(100 * us / prefill_us, 3),
                    write_gbps=round(moved / us / 1e3, 1),
                )
                if first is None:
                    first = (kc, vc)
                else:  # bytes equal to the first path's (codes flip only where y's rounding does)
                    same = sum(int((x == y).sum()) for x, y in zip(first, (kc, vc), strict=True))
                    row["same_bytes_as_split"] = round(same / (kc.numel() + vc.numel()), 6)
                rows.append(row)
                print(row, flush=True)
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
        "| tokens | format | write (K+V) us | prefill layer us | % of prefill | write GB/s |",
        "|---|---|---|---|---|---|",
    ]
    md += [
        f"| {r['tokens']} | {r['format']} | {r['write_us']} | {r['prefill_layer_us']} | "
        f"{r['pct_of_prefill']} | {r['write_gbps']} |"
        for r in rows
    ]
    (out / f"bench_cache_write{tag}.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
