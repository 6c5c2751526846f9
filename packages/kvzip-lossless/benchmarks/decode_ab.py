#!/usr/bin/env python3
"""The CUDA C decoders of two versions of csrc/kvzl.cu on the same GPU, the same blobs, back to
back: the one-blob decoder (``kvzl_decode``, its kernel alone, CUDA events) and the batched
decoders (``l1`` and ``smem``: a whole ``decode_batch`` call), with the outputs of both
versions compared (the same values, sums and flags; and every value equal to the input).

The old version's one-blob decoder takes the packed ``cum << 16 | freq`` table, the new one the
16-bit cumulative frequencies (``--old-abi packed``, the default for sources before f47b258;
``cum16`` for later ones). Data: 8B-shaped layers ([tokens, 8, 128] bf16) of KV-like values (a
per-channel Gaussian with per-channel scale and offset, rounded to bf16; stated in the JSON),
coded with an embedded table (fitted on the GPU) and rows_per_tile 1,024.

    git show 90d8419:packages/kvzip-lossless/src/kvzip_lossless/csrc/kvzl.cu > kvzl_old.cu
    PYTHONPATH=packages/kvzip-formats/src:packages/kvzip-lossless/src python3 \\
        packages/kvzip-lossless/benchmarks/decode_ab.py --old kvzl_old.cu --out $OUT

Writes ``<out>/decode_ab.json`` and ``.md``. About a minute on the H200 (two nvcc builds of
~10 s, then 2 x 2 layers x 3 decoders x 20 timed calls).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import platform
import statistics
from pathlib import Path
from unittest import mock

import numpy as np
import torch

import kvzip_lossless as kl
from kvzip_formats import nvcc
from kvzip_lossless import _cuda, _torch, batch, gpu, gpu_batch
from kvzip_lossless import blob as B


def kv_like(tokens: int, heads: int, dim: int, law: int, draw: int) -> torch.Tensor:
    """KV-like bf16: per-channel N(offset, scale), the channels' law from seed ``law``, the
    values from seed ``draw``."""
    g = torch.Generator(device="cuda").manual_seed(law)
    shape = (1, heads, dim)
    scale = torch.rand(shape, generator=g, device="cuda") * 3 + 0.05
    offset = torch.randn(shape, generator=g, device="cuda") * 2
    g.manual_seed(draw)
    x = torch.randn(tokens, heads, dim, generator=g, device="cuda") * scale + offset
    return x.bfloat16()


def load(src: Path) -> ctypes.CDLL:
    cap = torch.cuda.get_device_capability()
    so = nvcc.build(src, _cuda.arch_flags(cap), prefix="kvzl-ab", capability=cap)
    L = ctypes.CDLL(str(so))
    _cuda._declare(L)
    return L


def events_median(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def single(L, abi: str, x: torch.Tensor, iters: int) -> dict:
    """kvzl_decode alone on one blob of ``x``; its raw outputs for the comparison."""
    cols = B.choose_columns(tuple(x.shape))
    table = gpu.fit_table_gpu(x, cols)
    parts = gpu.encode_parts(x, table, cols, 1024, backend="cuda")
    import zlib

    emb = zlib.compress(table.to_bytes(), 9)
    blob = gpu.assemble_host(x, parts, tuple(x.shape), cols, 1024, table.table_id(), 0, emb)
    h = B.parse_header(memoryview(blob))
    gb = gpu.GpuBlob(memoryview(blob), h, table, x.device, backend="cuda")
    dev_blob = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(x.device)
    tab, bmap, base = _torch.table_tensors(table, x.device)
    t = tab if abi == "packed" else _torch.cum_tensor(table, x.device)
    o16 = torch.empty(x.numel(), dtype=torch.int16, device=x.device)
    sums = torch.zeros(h.n_tiles, dtype=torch.int32, device=x.device)
    err = torch.zeros(max(gb.n_chunks, 1), dtype=torch.int32, device=x.device)
    P = ctypes.c_void_p

    def run():
        sums.zero_()
        rc = L.kvzl_decode_launch(
            P(dev_blob.data_ptr()), P(gb.desc.data_ptr()), gb.n_chunks, P(t.data_ptr()),
            P(bmap.data_ptr()), P(base.data_ptr()), cols, table.n_buckets, P(o16.data_ptr()),
            P(sums.data_ptr()), P(err.data_ptr()), P(torch.cuda.current_stream().cuda_stream),
        )  # fmt: skip
        assert rc == 0, rc

    s = events_median(run, iters)
    run()
    torch.cuda.synchronize()
    full = o16.clone()
    if gb.eidx.numel():
        full[gb.eidx] = gb.evals
    exact = torch.equal(full, x.reshape(-1).view(torch.int16))
    flags_clear = int(err.sum()) == 0 and torch.equal(sums, gb.expect)
    return dict(
        s=s, GBps=x.numel() * 2 / s / 1e9, ratio=x.numel() * 2 / len(blob), exact=exact,
        flags_clear=bool(flags_clear), out=(o16.clone(), sums.clone(), err.clone()),
    )  # fmt: skip


def batched(L, design: str, xs: list[torch.Tensor], ts, iters: int) -> dict:
    """A whole decode_batch call over ``xs`` (one blob each, coded with the table set ``ts``,
    slots 0 and 1 alternating)."""
    with mock.patch.object(_cuda, "lib", lambda device=None: L):
        eb = kl.encode_batch(xs, tables=ts, slots=[0, 1] * (len(xs) // 2), rows_per_tile=1024)
        out = torch.empty(sum(x.numel() for x in xs), dtype=torch.bfloat16, device="cuda")
        oo = np.concatenate([[0], np.cumsum([x.numel() for x in xs])[:-1]])
        si = batch._set_index(eb.plans, [ts])

        def run():
            return gpu_batch.decode_batch(
                eb.data, eb.offsets, eb.plans, [ts], si, out, oo, backend="cuda", decoder=design
            )

        s = events_median(run, iters)
        _, bad = run()
        torch.cuda.synchronize()
    ref = torch.cat([x.reshape(-1) for x in xs]).view(torch.int16)
    nbytes = sum(x.numel() for x in xs) * 2
    return dict(
        s=s, GBps=nbytes / s / 1e9, ratio=nbytes / int(eb.lengths.sum()),
        exact=torch.equal(out.view(torch.int16), ref),
        flags_clear=int(bad.sum()) == 0, out=(out.view(torch.int16).clone(), bad.clone()),
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--old", required=True, help="the old csrc/kvzl.cu (a file)")
    p.add_argument("--old-abi", default="packed", choices=("packed", "cum16"))
    p.add_argument("--old-name", default="90d8419")
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="/tmp/res/decode_ab")
    args = p.parse_args()
    libs = {args.old_name: (load(Path(args.old)), args.old_abi), "new": (load(_cuda._SRC), "cum16")}
    rows, outs = [], {}
    for seed in (1, 2):  # two layers (two channel laws)
        x = kv_like(args.tokens, 8, 128, seed, seed + 10)
        for name, (L, abi) in libs.items():
            r = single(L, abi, x, args.iters)
            outs[(seed, name, "one-blob")] = r.pop("out")
            rows.append(dict(layer=seed, version=name, decoder="one-blob kvzl_decode", **r))
        xs = list(kv_like(64 * 256, 8, 128, seed, seed + 20).split(256))
        fit = kv_like(4096, 8, 128, seed, seed + 30)  # the tables: another draw of the law
        ts = kl.build_kv_tables([[(fit, fit)]])
        for design in gpu_batch.CUDA_DECODERS:
            for name, (L, _) in libs.items():
                r = batched(L, design, xs, ts, args.iters)
                outs[(seed, name, design)] = r.pop("out")
                rows.append(dict(layer=seed, version=name, decoder=f"batched {design}", **r))
    names = list(libs)
    same = {
        f"{seed}/{dec}": all(
            torch.equal(a, b)
            for a, b in zip(outs[(seed, names[0], dec)], outs[(seed, names[1], dec)], strict=True)
        )
        for seed, _, dec in outs
    }
    meta = dict(
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        device=torch.cuda.get_device_name(0),
        versions=dict(
            python=platform.python_version(), torch=torch.__version__, kvzip_lossless=kl.__version__
        ),  # fmt: skip
        command="decode_ab.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        data="KV-like: per-channel N(offset, scale) with scale U(0.05, 3.05), offset N(0, 2), "
        "bf16; one-blob: [tokens, 8, 128] with its embedded table; batched: 64 blobs of "
        "[256, 8, 128] (as a 256-token chunk of 32 layers' K and V), a table set fitted on "
        "another draw of the same law",
        same_outputs_old_vs_new=same,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_ab.json").write_text(json.dumps(dict(**meta, rows=rows), indent=1) + "\n")
    lines = [
        "# CUDA C decoders: old vs new csrc/kvzl.cu, same GPU, same blobs",
        "",
        f"{meta['date']}; {meta['device']}; torch {torch.__version__}; `{meta['command']}`. "
        f"Outputs of both versions identical: {all(same.values())}.",
        "",
        "| layer | decoder | version | time (ms) | GB/s of bf16 | ratio | exact | flags clear |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layer']} | {r['decoder']} | {r['version']} | {r['s'] * 1e3:.3f} | "
            f"{r['GBps']:.1f} | {r['ratio']:.3f} | {r['exact']} | {r['flags_clear']} |"
        )
    (out / "decode_ab.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
