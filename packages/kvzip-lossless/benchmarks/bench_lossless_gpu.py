"""kvzip-lossless on the GPU, in one run: same bytes as the CPU, throughput, nvCOMP, restore.

Usage (H200, from the repository root, `.carry/kv` and `.carry/nvcomp` carried):
  PYTHONPATH=packages/kvzip-formats/src:packages/kvzip-lossless/src python3 \
      packages/kvzip-lossless/benchmarks/bench_lossless_gpu.py \
      --kv .carry/kv --nvcomp .carry/nvcomp --out $OUT
`--smoke` runs every step on tiny shapes on the CPU under TRITON_INTERPRET=1 (no timings).

Steps (each writes into the JSON even when a later one fails):
1. check: every real KV tensor of the sample (calibrated tables and embedded tables): GPU encode
   bytes == CPU encode bytes, GPU decode bit-exact, a flipped byte is caught.
2. throughput: one Llama-3.1-8B-shaped layer K / V ([131072, 8, 128] bf16, the real KV tiled:
   tokens repeated, the 192 SmolLM2 channels repeated across 1,024), encode and decode GB/s of
   bf16 (CUDA events, median).
3. nvCOMP 6.0 ANS float16 mode on the same real sample (ratio) and 1 GiB of it tiled (speed).
4. batch: the batched API (kvzip_lossless.encode_batch / decode_batch) on one 8B layer and on
   256-token 8B-shaped chunks (1, 16, 128 a call), GB/s, ratio, exact, damage flags.
5. restore (skipped by default): 32 layers x (K, V) of that shape = 17.18 GB, compressed into
   pinned host memory, streamed to the GPU in per-tensor chunks (copy of chunk i+1 overlaps
   decode of chunk i), checksums verified on the GPU, then every tensor compared; beside it
   the raw pinned copy.
6. HF transformers prefill (skipped by default) of a random-weight Llama-3.1-8B (bf16, sdpa)
   on 131,072 tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import json
import os
import platform
import sys
import time
import traceback
import zipfile
from unittest import mock

import numpy as np
import torch

p = argparse.ArgumentParser()
p.add_argument("--kv", default=".carry/kv")
p.add_argument("--nvcomp", default=".carry/nvcomp")
p.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_out"))
p.add_argument("--smoke", action="store_true")
p.add_argument("--name", default="lossless_gpu", help="output files: <out>/<name>.json / .md")
p.add_argument(
    "--skip",
    default="restore,prefill",
    help="comma list of steps to skip (default: the 17 GB restore and the HF prefill, measured in "
    "runs 1-2 and slow; --skip '' runs every step)",
)
p.add_argument("--backends", default="cuda,triton", help="GPU coders to check and time")
p.add_argument("--restore-modes", default="calibrated,embedded")
args = p.parse_args()
if args.smoke:
    os.environ["TRITON_INTERPRET"] = "1"
os.makedirs(args.out, exist_ok=True)

import kvzip_lossless as kl  # noqa: E402
from kvzip_lossless import _torch, batch, codec, gpu, gpu_batch, tiles  # noqa: E402
from kvzip_lossless import blob as B  # noqa: E402

DEV = torch.device("cpu" if args.smoke else "cuda")
R = {
    "command": " ".join(sys.argv),
    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "versions": {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "kvzip_lossless": kl.__version__,
        "format_version": kl.FORMAT_VERSION,
    },
    "device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(0),
    "smoke": args.smoke,
}
try:
    import triton

    R["versions"]["triton"] = triton.__version__
except ImportError:
    pass


def save():
    with open(os.path.join(args.out, args.name + ".json"), "w") as f:
        json.dump(R, f, indent=2)


def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def timeit(fn, iters=5):
    """Median seconds of fn() (CUDA events on the GPU)."""
    fn()
    sync()
    ts = []
    for _ in range(iters):
        if DEV.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def summary():
    """Per coder (the batched API on one 8B layer, K and V, default tiles) beside nvCOMP."""
    out = {}
    for key, t in R.get("batch", {}).get("layer", {}).items():
        be, _, rows_ = key.split("_")
        if rows_ != f"rows{RPT}":
            continue
        o = out.setdefault(be, {"bytes": 0, "enc_s": 0.0, "dec_s": 0.0, "blob_bytes": 0.0})
        o["bytes"] += t["bytes"]
        o["enc_s"] += t["encode_s"]
        o["dec_s"] += t["decode_s"]
        o["blob_bytes"] += t["bytes"] / t["ratio"]
    for o in out.values():
        o["encode_GBps"] = o["bytes"] / o["enc_s"] / 1e9
        o["decode_GBps"] = o["bytes"] / o["dec_s"] / 1e9
        o["ratio_8b_layer"] = o["bytes"] / o["blob_bytes"]
    if "check" in R:
        for o in out.values():
            o["ratio_real_sample_with_tables"] = R["check"]["ratio_calibrated_with_tables"]
    if isinstance(R.get("nvcomp"), dict):
        n = R["nvcomp"]
        out["nvcomp"] = {
            "encode_GBps": n["encode_GBps_1GiB"],
            "decode_GBps": n["decode_GBps_1GiB"],
            "ratio_real_sample": n["ratio_real_sample"],
        }
    R["summary"] = out
    R["targets"] = {"decode_GBps": 600, "encode_GBps": 300, "ratio": 1.55}


def report(echo=False):
    """The summary, the JSON and the markdown table as they stand (after every step, so a run
    stopped by a time limit still leaves both)."""
    summary()
    save()
    rows = [("item", "value")]
    for be, o in R.get("summary", {}).items():
        rows += [
            (
                f"SUMMARY {be}: enc GB/s / dec GB/s",
                f"{o['encode_GBps']:.0f} / {o['decode_GBps']:.0f}",
            )
        ]
    if "check" in R:
        c = R["check"]
        rows += [
            ("tensors checked", c["tensors"]),
            ("GPU encode == CPU bytes", c["gpu_encode_equal"]),
            ("GPU decode exact", c["gpu_decode_exact"]),
            ("corruption caught", c["corruption_caught"]),
            ("ratio real sample (calibrated, +tables)", f"{c['ratio_calibrated_with_tables']:.3f}"),
            ("ratio real sample (calibrated blobs only)", f"{c['ratio_calibrated_blobs']:.3f}"),
            ("ratio real sample (embedded tables)", f"{c['ratio_embedded']:.3f}"),
        ]
    for key, t in R.get("throughput", {}).items():
        rows += [
            (
                f"8B layer {key}: ratio / enc GB/s / dec GB/s",
                f"{t['ratio']:.3f} / {t['encode_GBps']:.0f} / {t['decode_GBps']:.0f}",
            )
        ]
    for key, t in R.get("batch", {}).get("layer", {}).items():
        rows += [
            (
                f"batched API, 8B layer {key}: ratio / enc GB/s / dec GB/s / exact",
                f"{t['ratio']:.3f} / {t['encode_GBps']:.0f} / {t['decode_GBps']:.0f} / "
                f"{t['exact']}",
            )
        ]
    for key, t in R.get("batch", {}).get("layer", {}).items():
        if "encode_steps_ms" in t:
            steps = ", ".join(f"{k} {v:.2f}" for k, v in t["encode_steps_ms"].items())
            rows += [(f"batched API, 8B layer {key}: encode call by step (ms)", steps)]
    for key, t in R.get("batch", {}).get("chunks256", {}).items():
        rows += [
            (
                f"batched API, 256-token 8B chunks, {key} ({t['blobs']} blobs): ratio / enc GB/s / "
                "dec GB/s / exact / damage flagged",
                f"{t['ratio']:.3f} / {t['encode_GBps']:.1f} / {t['decode_GBps']:.1f} / "
                f"{t['exact']} / {t['damage_flagged_only_there']}",
            )
        ]
    if isinstance(R.get("nvcomp"), dict):
        n = R["nvcomp"]
        rows += [
            (
                "nvCOMP ANS f16 ratio / enc GB/s / dec GB/s",
                f"{n['ratio_real_sample']:.3f} / {n['encode_GBps_1GiB']:.0f} / "
                f"{n['decode_GBps_1GiB']:.0f}",
            )
        ]
    for mode in ("calibrated", "embedded"):
        r = R.get("restore_" + mode)
        if r:
            rows += [
                (
                    f"restore 17.18 GB, {mode} (s) / ratio / exact",
                    f"{r['restore_s']:.3f} / {r['ratio']:.3f} / {r['every_tensor_exact']}",
                )
            ]
            if "raw_copy_s" in r:
                rows += [("raw pinned bf16 copy 17.18 GB (s)", f"{r['raw_copy_s']:.3f}")]
    if isinstance(R.get("prefill"), dict):
        rows += [("HF prefill 131k (s)", R["prefill"].get("prefill_131072_s"))]
    md = ["| " + a + " | " + str(b) + " |" for a, b in rows]
    md.insert(1, "|---|---|")
    text = (
        f"# kvzip-lossless GPU benchmark\n\ndevice: {R['device']}; date: {R['date']}; "
        f"versions: {R['versions']}\ncommand: `{R['command']}`\n\n" + "\n".join(md) + "\n"
    )
    if R.get("errors"):
        text += "\nerrors: " + json.dumps(R["errors"]) + "\n"
    with open(os.path.join(args.out, args.name + ".md"), "w") as f:
        f.write(text)
    if echo:
        print(text)


def step(name):
    def deco(fn):
        if name in args.skip.split(","):
            return fn
        t0 = time.time()
        try:
            fn()
            R.setdefault("steps_ok", []).append(name)
        except Exception as ex:  # keep going: later steps still report
            R.setdefault("errors", {})[name] = f"{type(ex).__name__}: {ex}"
            traceback.print_exc()
        R.setdefault("step_seconds", {})[name] = round(time.time() - t0, 1)
        report()
        return fn

    return deco


K = np.load(os.path.join(args.kv, "K.npy"))
V = np.load(os.path.join(args.kv, "V.npy"))
TS = kl.TableSet.load(os.path.join(args.kv, "tables.kvzt"))
if args.smoke:
    K, V = K[:2, :40], V[:2, :40]
L, T, H, D = K.shape
bf = lambda a: torch.from_numpy(np.ascontiguousarray(a).astype(np.int16)).view(torch.bfloat16)  # noqa: E731
RPT = 16 if args.smoke else codec.ROWS_PER_TILE
R["sample"] = {"layers": L, "tokens": T, "kv_heads": H, "head_dim": D, "bytes": 2 * (K.nbytes)}


BACKENDS = [b for b in args.backends.split(",") if b != "cuda" or DEV.type == "cuda"]
if "cuda" in BACKENDS:
    from kvzip_lossless import _cuda

    if not _cuda.available(DEV):
        R["cuda_backend_error"] = _cuda.failure(DEV)
        BACKENDS.remove("cuda")
R["backends"] = BACKENDS


def gpu_blob_bytes(x, tables, slot, backend):
    shape = tuple(x.shape)
    t = tiles.resolve_table(tables, slot, shape, x.numel())
    vals = _torch.as_u16(x) if t is None else None
    table, cols, tid, sl, emb = tiles.prepare_table(vals, shape, t, tables, slot)
    parts = gpu.encode_parts(x.to(DEV), table, cols, RPT, backend=backend)
    return gpu.assemble_host(x, parts, shape, cols, RPT, tid, sl, emb), table


@step("check")
def check():
    res = {
        "tensors": 0,
        "gpu_encode_equal": True,
        "gpu_decode_exact": True,
        "corruption_caught": True,
    }
    sizes = {"calibrated": [0, 0], "embedded": [0, 0]}
    for layer in range(L):
        for kind, arr in (("k", K), ("v", V)):
            x = bf(arr[layer])
            for mode, tables, slot in (
                ("calibrated", TS, kl.kv_slot(layer, kind)),
                ("embedded", None, None),
            ):
                cpu_b = kl.compress(x, tables=tables, slot=slot, rows_per_tile=RPT)
                h = B.parse_header(memoryview(cpu_b))
                for be in BACKENDS:
                    gpu_b, table = gpu_blob_bytes(x, tables, slot, be)
                    res["gpu_encode_equal"] &= cpu_b == gpu_b
                    res.setdefault(f"encode_equal_{be}", True)
                    res[f"encode_equal_{be}"] &= cpu_b == gpu_b
                    gb = gpu.GpuBlob(memoryview(cpu_b), h, table, DEV, backend=be)
                    dev_b = torch.frombuffer(bytearray(cpu_b), dtype=torch.uint8).to(DEV)
                    y = torch.empty_like(x, device=DEV)
                    gb.decode(dev_b, y, check=True)
                    ok = torch.equal(y.cpu().view(torch.int16), x.view(torch.int16))
                    res["gpu_decode_exact"] &= ok
                    res.setdefault(f"decode_exact_{be}", True)
                    res[f"decode_exact_{be}"] &= ok
                    bad = bytearray(cpu_b)
                    bad[-7] ^= 0x10
                    bb = bytes(bad)
                    try:
                        gbb = gpu.GpuBlob(
                            memoryview(bb), B.parse_header(memoryview(bb)), table, DEV, backend=be
                        )
                        gbb.decode(torch.frombuffer(bytearray(bb), dtype=torch.uint8).to(DEV), y)
                        res["corruption_caught"] = False
                    except kl.CorruptBlobError:
                        pass
                sizes[mode][0] += x.numel() * 2
                sizes[mode][1] += len(cpu_b)
                res["tensors"] += 1
    res["ratio_calibrated_blobs"] = sizes["calibrated"][0] / sizes["calibrated"][1]
    # the tables of the sample's layers only (tables.kvzt holds every layer of the model;
    # run 1-2 counted all 30 layers' tables against an 8-layer sample: 1.496x)
    sample_tables = kl.TableSet(TS.tables[: 2 * L])
    res["sample_tables_bytes"] = sample_tables.nbytes
    res["ratio_calibrated_with_tables"] = sizes["calibrated"][0] / (
        sizes["calibrated"][1] + sample_tables.nbytes
    )
    res["ratio_embedded"] = sizes["embedded"][0] / sizes["embedded"][1]
    R["check"] = res
    print("check", res, flush=True)


def big_layer(layer, kind, tokens, heads=8, dim=128):
    """An 8B-shaped [tokens, heads, dim] bf16 tensor on DEV: the real KV tiled (stated)."""
    src = torch.from_numpy((K if kind == "k" else V)[layer % L].reshape(T, -1).astype(np.int16))
    src = src.to(DEV)
    cols = heads * dim
    reps_c = -(-cols // src.shape[1])
    reps_t = -(-tokens // T)
    x = src.repeat(reps_t, reps_c)[:tokens, :cols]
    return x.view(torch.bfloat16).reshape(tokens, heads, dim).contiguous()


def embedded(x):
    """(table, cols, table id, slot, embedded bytes) as compress() without tables (GPU fit)."""
    import zlib

    cols = B.choose_columns(tuple(x.shape))
    table = gpu.fit_table_gpu(x, cols)
    return table, cols, table.table_id(), 0, zlib.compress(table.to_bytes(), 9)


def wide_tables(cols):
    """The sample's calibrated tables (fitted on other text: tokens 60000-62047) widened to the
    tiled 8B shape: column j of a tiled tensor is sample column j % 192, so it takes that
    column's table; layer l takes sample layer l % L."""
    out = []
    for layer in range(NL):
        for kind in ("k", "v"):
            t = TS.tables[kl.kv_slot(layer % L, kind)]
            j = np.arange(cols) % t.columns
            out.append(kl.Table(t.base[j].copy(), t.buckets, t.freq[j].copy()))
    return kl.TableSet(out)


NL = 2 if args.smoke else 32
BIG_T = 48 if args.smoke else 131072
BIG_H, BIG_D = (2, 32) if args.smoke else (8, 128)


@step("throughput")
def throughput():
    res = {}
    wide = wide_tables(BIG_H * BIG_D)
    R["wide_tables_bytes"] = wide.nbytes
    cases = [
        (be, kind, mode, RPT)
        for be in BACKENDS
        for kind in ("k", "v")
        for mode in ("embedded", "calibrated")
    ]
    for be, kind, mode, rpt in cases:
        x = big_layer(1, kind, BIG_T, BIG_H, BIG_D)
        shape = tuple(x.shape)
        if mode == "embedded":
            table, cols, tid, sl, emb = embedded(x)
        else:
            sl = kl.kv_slot(1, kind)
            table, cols, tid, emb = wide.tables[sl], BIG_H * BIG_D, wide.table_id, None
        t_enc = timeit(
            lambda x=x, t=table, c=cols, r=rpt, b=be: gpu.encode_parts(x, t, c, r, backend=b)
        )
        parts = gpu.encode_parts(x, table, cols, rpt, backend=be)
        blob = gpu.assemble_host(x, parts, shape, cols, rpt, tid, sl, emb)
        h = B.parse_header(memoryview(blob))
        gb = gpu.GpuBlob(memoryview(blob), h, table, DEV, backend=be)
        dev_blob = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(DEV)
        out = torch.empty_like(x)
        t_dec = timeit(lambda g=gb, d=dev_blob, o=out: g.decode(d, o, check=False))
        gb.decode(dev_blob, out, check=True)
        exact = torch.equal(out.view(torch.int16), x.view(torch.int16))
        nbytes = x.numel() * 2
        key = f"{be}_{kind}_{mode}_rows{rpt}"
        res[key] = {
            "shape": list(shape),
            "bytes": nbytes,
            "ratio": nbytes / len(blob),
            "encode_s": t_enc,
            "decode_s": t_dec,
            "encode_GBps": nbytes / t_enc / 1e9,
            "decode_GBps": nbytes / t_dec / 1e9,
            "exact": exact,
        }
        print("throughput", key, res[key], flush=True)
        R["throughput"] = res
        save()
    R["throughput_scope"] = {
        "encode": "GPU kernels + word compaction + mantissa packing + checksums (device-resident "
        "parts; host blob assembly not timed)",
        "decode": "decode kernel + escape patch + checksum compare on device",
    }


@step("nvcomp")
def nvcomp_step():
    if args.smoke:
        R["nvcomp"] = "skipped in smoke"
        return
    site = "/tmp/nvc_site"
    os.makedirs(site, exist_ok=True)
    for w in glob.glob(os.path.join(args.nvcomp, "*.whl")):
        zipfile.ZipFile(w).extractall(site)
    sys.path.insert(0, site)
    import ctypes

    for d in glob.glob(os.path.join(site, "nvidia", "**", "lib*"), recursive=True):
        for so in sorted(glob.glob(os.path.join(d, "libnvcomp*.so*"))):
            try:
                ctypes.CDLL(so, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                pass
    import cupy as cp
    from nvidia import nvcomp

    raw = np.concatenate([K.ravel(), V.ravel()])
    small = cp.asarray(raw)
    big = cp.asarray(np.resize(raw, (1 << 30) // 2))
    codec_ = nvcomp.Codec(algorithm="ANS", data_type="<f2")
    comp = codec_.encode(nvcomp.as_array(small))
    dec = cp.asarray(codec_.decode(comp)).view(cp.uint16).ravel()
    exact = bool(dec.size == small.size and cp.all(dec == small))

    def ev(fn, iters=5):
        fn()
        cp.cuda.runtime.deviceSynchronize()
        ts = []
        for _ in range(iters):
            s, e = cp.cuda.Event(), cp.cuda.Event()
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(cp.cuda.get_elapsed_time(s, e) / 1e3)
        return sorted(ts)[len(ts) // 2]

    cbig = codec_.encode(nvcomp.as_array(big))
    t_enc = ev(lambda: codec_.encode(nvcomp.as_array(big)))
    t_dec = ev(lambda: codec_.decode(cbig))
    R["nvcomp"] = {
        "version": nvcomp.__version__,
        "codec": "ANS data_type <f2",
        "ratio_real_sample": small.nbytes / comp.buffer_size,
        "exact": exact,
        "encode_GBps_1GiB": big.nbytes / t_enc / 1e9,
        "decode_GBps_1GiB": big.nbytes / t_dec / 1e9,
    }
    print("nvcomp", R["nvcomp"], flush=True)


def encode_steps(enc, iters=3) -> dict:
    """Milliseconds between consecutive step marks of ``gpu_batch.encode_batch`` (median of
    ``iters`` calls): setup, encode kernel, host layout (after the one sync), buffer and
    headers, assembly kernel, mantissa kernel, escapes.

    The marks are CUDA events recorded around the module's step functions, which this wraps
    for the calls (the shipped module has no profiling hook): before and after the encode
    launch (``_launch_encode``, its first call: a rerun for a long escape list counts in the
    host layout), after the second descriptor upload (``_upload``: the host layout's), before
    and after the assembly launch, after the mantissa launch, and at the call's ends."""
    marks: list = []

    def mark(name: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append((name, event))

    def around(fn, before=None, after=None, nth=None):
        calls = [0]

        @functools.wraps(fn)
        def wrapped(*a, **k):
            calls[0] += 1
            hit = nth is None or calls[0] == nth
            if hit and before:
                mark(before)
            r = fn(*a, **k)
            if hit and after:
                mark(after)
            return r

        return wrapped

    per: dict[str, list[float]] = {}
    for _ in range(iters):
        marks.clear()
        wraps = {
            "_launch_encode": around(gpu_batch._launch_encode, "setup", "encode kernel", 1),
            "_upload": around(gpu_batch._upload, after="host layout", nth=2),
            "_launch_assemble": around(
                gpu_batch._launch_assemble, "buffer + headers", "assembly kernel"
            ),
            "_launch_mant": around(gpu_batch._launch_mant, after="mantissa kernel"),
        }
        with contextlib.ExitStack() as stack:
            for name, fn in wraps.items():
                stack.enter_context(mock.patch.object(gpu_batch, name, fn))
            mark("start")
            enc()
            mark("escapes")
        sync()
        for (_, a), (name, b) in zip(marks[:-1], marks[1:], strict=True):
            per.setdefault(name, []).append(a.elapsed_time(b))
    return {k: float(np.median(v)) for k, v in per.items()}


@step("batch")
def batch_step():
    """The batched API (kvzip_lossless.encode_batch / decode_batch, spec/blob.md section 9).

    1. The codec alone: one 8B-shaped layer K / V ([131072, 8, 128], one blob) encoded and
       decoded through the batched kernels, rows_per_tile 1,024 (the default) and 256.
    2. 256-token chunks of the 8B shape (32 layers x K, V = 64 blobs a chunk), N chunks per
       call: encode (the whole call: kernels, the one device-to-host read, host layout,
       assembly) and decode (the whole call from one device buffer, damage flags on the device).
    Times: CUDA events around the whole call (median of 5 after a warm-up)."""
    res = {"tables": "the sample's calibrated tables widened to 1,024 columns (wide_tables)"}
    R["batch"] = res  # filled as it runs: a failing case keeps the ones before it
    wide = wide_tables(BIG_H * BIG_D)
    # "cuda-smem": the second CUDA encoder and decoder designs (tables staged in shared
    # memory; the encoder's division by a float reciprocal), beside "cuda" (the first: table
    # rows read through L1), on the same data
    for be in BACKENDS + (["cuda-smem"] if "cuda" in BACKENDS else []):
        cb, dec_name = ("cuda", "smem") if be == "cuda-smem" else (be, "l1")
        for kind in ("k", "v"):
            x = big_layer(1, kind, BIG_T, BIG_H, BIG_D)
            slot = kl.kv_slot(1, kind)
            nbytes = x.numel() * 2
            for rpt in (RPT, 256 if not args.smoke else 8):
                enc = functools.partial(
                    gpu_batch.encode_batch, [x], wide, [slot], rpt, backend=cb, encoder=dec_name
                )
                t_enc = timeit(enc)
                data, offs, lens, plans = enc()
                si = batch._set_index(plans, [wide])
                out = torch.empty(x.numel(), dtype=torch.bfloat16, device=DEV)
                oo = np.zeros(1, np.int64)
                dec = functools.partial(
                    gpu_batch.decode_batch, data, offs, plans, [wide], si, out, oo,
                    backend=cb, decoder=dec_name,
                )  # fmt: skip
                t_dec = timeit(dec)
                _, bad = dec()
                exact = bool(torch.equal(out.view(torch.int16), x.view(-1).view(torch.int16)))
                row = {
                    "bytes": nbytes,
                    "ratio": nbytes / int(lens.sum()),
                    "encode_s": t_enc,
                    "decode_s": t_dec,
                    "encode_GBps": nbytes / t_enc / 1e9,
                    "decode_GBps": nbytes / t_dec / 1e9,
                    "exact": exact,
                    "flags_clear": int(bad.sum()) == 0,
                }
                if rpt == RPT and kind == "k":  # bytes == the single-blob GPU coder's
                    ref, _ = gpu_blob_bytes(x, wide, slot, cb)
                    row["bytes_equal_single_blob_coder"] = ref == bytes(
                        data.cpu().numpy().tobytes()
                    )
                if cb == "cuda":  # where the encode call's time goes (CUDA events per step)
                    row["encode_steps_ms"] = encode_steps(enc)
                key = f"{be}_{kind}_rows{rpt}"
                res.setdefault("layer", {})[key] = row
                print("batch layer", key, row, flush=True)
                del data, out
        # 256-token chunks
        tok = 256 if not args.smoke else 8
        n_max = 128 if not args.smoke else 2
        big = {
            (layer, kind): big_layer(layer, kind, tok * n_max, BIG_H, BIG_D)
            for layer in range(NL)
            for kind in ("k", "v")
        }
        keys = list(big)
        # the Triton fallback is timed on 1 and 16 chunks only (its 128-chunk call is slow)
        counts = (1, 16, n_max) if cb == "cuda" else (1, 16)
        for n_chunks in counts if not args.smoke else (1, n_max):
            xs = [big[k][c * tok : (c + 1) * tok] for c in range(n_chunks) for k in keys]
            slots = [kl.kv_slot(layer, kind) for _c in range(n_chunks) for layer, kind in keys]
            nbytes = sum(x.numel() * 2 for x in xs)
            enc = functools.partial(
                gpu_batch.encode_batch, xs, wide, slots, RPT, backend=cb, encoder=dec_name
            )
            t_enc = timeit(enc)
            data, offs, lens, plans = enc()
            si = batch._set_index(plans, [wide])
            out = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=DEV)
            oo = np.arange(len(xs), dtype=np.int64) * xs[0].numel()
            dec = functools.partial(
                gpu_batch.decode_batch, data, offs, plans, [wide], si, out, oo,
                backend=cb, decoder=dec_name,
            )  # fmt: skip
            t_dec = timeit(dec)
            _, bad = dec()
            exact = all(
                torch.equal(out[oo[i] : oo[i] + x.numel()].view(torch.int16),
                            x.reshape(-1).view(torch.int16))
                for i, x in enumerate(xs)
            )  # fmt: skip
            dmg = data.clone()
            dmg[int(offs[len(xs) // 2]) + int(lens[len(xs) // 2]) // 2] ^= 0x10
            _, bad2 = gpu_batch.decode_batch(
                dmg, offs, plans, [wide], si, out, oo, backend=cb, decoder=dec_name
            )
            flags = (bad2 != 0).cpu().numpy()
            row = {
                "chunks": n_chunks,
                "tokens": n_chunks * tok,
                "blobs": len(xs),
                "bytes": nbytes,
                "ratio": nbytes / int(lens.sum()),
                "ratio_with_tables": nbytes / (int(lens.sum()) + wide.nbytes),
                "encode_s": t_enc,
                "decode_s": t_dec,
                "encode_GBps": nbytes / t_enc / 1e9,
                "decode_GBps": nbytes / t_dec / 1e9,
                "exact": exact,
                "flags_clear": int(bad.sum()) == 0,
                "damage_flagged_only_there": bool(flags[len(xs) // 2] and flags.sum() == 1),
            }
            if n_chunks == 1:  # the bytes equal the CPU coder's (compress of each tensor)
                row["bytes_equal_cpu"] = all(
                    bytes(data[int(offs[i]) : int(offs[i] + lens[i])].cpu().numpy().tobytes())
                    == kl.compress(x.cpu(), tables=wide, slot=slots[i], rows_per_tile=RPT)
                    for i, x in enumerate(xs[:8])
                )
            key = f"{be}_chunks{n_chunks}"
            res.setdefault("chunks256", {})[key] = row
            print("batch chunks", key, row, flush=True)
            del data, out, dmg
        big.clear()
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
    R["batch"] = res


def restore_mode(mode, res):
    t0 = time.time()
    distinct = {}
    wide = wide_tables(BIG_H * BIG_D)
    res["tables"] = (
        f"calibrated on other text (sample tables widened), table set of {wide.nbytes} bytes "
        "counted once"
        if mode == "calibrated"
        else "embedded per blob (no calibration), counted in the blob bytes"
    )
    for layer in range(min(NL, L)):
        for kind in ("k", "v"):
            x = big_layer(layer, kind, BIG_T, BIG_H, BIG_D)
            shape = tuple(x.shape)
            if mode == "embedded":
                table, cols, tid, sl, emb = embedded(x)
            else:
                sl = kl.kv_slot(layer, kind)
                table, cols, tid, emb = wide.tables[sl], BIG_H * BIG_D, wide.table_id, None
            parts = gpu.encode_parts(x, table, cols, RPT)
            blob = gpu.assemble_host(x, parts, shape, cols, RPT, tid, sl, emb)
            h = B.parse_header(memoryview(blob))
            distinct[(layer, kind)] = (blob, gpu.GpuBlob(memoryview(blob), h, table, DEV))
    res["compress_distinct_s"] = time.time() - t0
    order = [(layer, kind) for layer in range(NL) for kind in ("k", "v")]
    sizes = [len(distinct[(l_ % L, k)][0]) for l_, k in order]
    total_c = sum(sizes)
    pin = DEV.type == "cuda"
    host = torch.empty(total_c, dtype=torch.uint8, pin_memory=pin)
    offs = np.concatenate([[0], np.cumsum(sizes)])
    for i, (l_, k) in enumerate(order):
        host[offs[i] : offs[i + 1]] = torch.frombuffer(
            bytearray(distinct[(l_ % L, k)][0]), dtype=torch.uint8
        )
    outs = [torch.empty((BIG_T, BIG_H, BIG_D), dtype=torch.bfloat16, device=DEV) for _ in order]
    raw_bytes = sum(o.numel() * 2 for o in outs)
    maxc = max(sizes)
    stage = [torch.empty(maxc + 16, dtype=torch.uint8, device=DEV) for _ in range(2)]

    def run_pipeline():
        if DEV.type != "cuda":
            flags = []
            for i, (l_, k) in enumerate(order):
                stage[0][: sizes[i]].copy_(host[offs[i] : offs[i + 1]])
                flags.append(
                    distinct[(l_ % L, k)][1].decode(stage[0][: sizes[i]], outs[i], check=False)
                )
            return torch.stack(flags).sum()
        cs, ds = torch.cuda.Stream(), torch.cuda.Stream()
        copied = [torch.cuda.Event() for _ in order]
        freed = [torch.cuda.Event() for _ in order]
        flags = []
        for i, (l_, k) in enumerate(order):
            buf = stage[i % 2]
            with torch.cuda.stream(cs):
                if i >= 2:
                    cs.wait_event(freed[i - 2])
                buf[: sizes[i]].copy_(host[offs[i] : offs[i + 1]], non_blocking=True)
                copied[i].record(cs)
            with torch.cuda.stream(ds):
                ds.wait_event(copied[i])
                flags.append(distinct[(l_ % L, k)][1].decode(buf[: sizes[i]], outs[i], check=False))
                freed[i].record(ds)
        torch.cuda.current_stream().wait_stream(ds)
        bad = int(torch.stack(flags).sum())  # one sync: every tile's checksum verified
        if bad:
            raise kl.CorruptBlobError("restore: checksum failure")
        return bad

    run_pipeline()  # warm-up (JIT, allocator)
    ts = []
    for _ in range(1 if args.smoke else 3):
        sync()
        t1 = time.perf_counter()
        run_pipeline()
        sync()
        ts.append(time.perf_counter() - t1)
    res["restore_s_runs"] = ts
    res["restore_s"] = sorted(ts)[len(ts) // 2]
    ok = True
    for i, (l_, k) in enumerate(order):
        ok &= torch.equal(
            outs[i].view(torch.int16), big_layer(l_, k, BIG_T, BIG_H, BIG_D).view(torch.int16)
        )
    res["every_tensor_exact"] = ok
    res["raw_bf16_bytes"] = raw_bytes
    res["compressed_bytes"] = total_c
    res["ratio"] = raw_bytes / (total_c + (wide.nbytes if mode == "calibrated" else 0))
    res["effective_GBps"] = raw_bytes / res["restore_s"] / 1e9
    stage.clear()
    # raw pinned bf16 copy of the same bytes, one tensor at a time (what a bf16 tier does)
    if DEV.type == "cuda":
        per = outs[0].numel() * 2
        rawhost = torch.empty(per, dtype=torch.uint8, pin_memory=True)
        rawhost.copy_(outs[0].view(-1).view(torch.uint8).cpu())

        def raw_copy():
            for o in outs:
                o.view(-1).view(torch.uint8).copy_(rawhost, non_blocking=True)

        t_raw = timeit(raw_copy, iters=3)
        res["raw_copy_s"] = t_raw
        res["raw_copy_note"] = (
            "17.18 GB H2D from one pinned 268 MB buffer reused per tensor "
            "(same bytes moved as a pinned 17 GB source)"
        )
    print(
        "restore",
        mode,
        {k: v for k, v in res.items() if k not in ("data", "paged_cache")},
        flush=True,
    )
    outs.clear()
    distinct.clear()
    if DEV.type == "cuda":
        torch.cuda.empty_cache()
    return res


@step("restore")
def restore():
    res = {
        "layers": NL,
        "tokens": BIG_T,
        "kv_heads": BIG_H,
        "head_dim": BIG_D,
        "data": "SmolLM2-135M real KV (layers 0-7, 2,048 tokens) tiled: layer l uses sample "
        "layer l % 8, tokens repeated, channels repeated across heads x dim",
        "tables": "embedded per blob (no calibration), counted in the blob bytes",
        "paged_cache": "one contiguous [tokens, kv_heads, head_dim] tensor per layer and K/V "
        "(vLLM's [blocks, block_size, heads, dim] with blocks in order)",
    }
    for mode in args.restore_modes.split(","):
        res["backend"] = gpu.default_backend(DEV)
        R["restore_" + mode] = restore_mode(mode, dict(res))
        save()


@step("prefill")
def prefill():
    if args.smoke:
        R["prefill"] = "skipped in smoke"
        return
    from transformers import LlamaConfig, LlamaForCausalLM

    # the 8B config of the benchmarks' one helper (kvzip-eval's source, in this checkout)
    sys.path.append(os.path.join(os.path.dirname(__file__), "..", "..", "kvzip-eval", "src"))
    from kvzip_eval.bench.engines import LLAMA31_8B

    keys = "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads"
    keys += " num_key_value_heads max_position_embeddings rope_theta"
    cfg = LlamaConfig(
        **{k: LLAMA31_8B[k] for k in keys.split()},
        attn_implementation="sdpa",
        torch_dtype=torch.bfloat16,
    )
    torch.manual_seed(0)
    torch.cuda.empty_cache()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    res = {
        "model": "random-weight Llama-3.1-8B shape (LlamaConfig), bf16, sdpa, logits of the "
        "last token only, median-free single timed run after a 4,096-token warm-up"
    }
    for n in (131072, 65536):
        if f"prefill_{n * 2}_s" in res:
            break
        ids = torch.randint(0, cfg.vocab_size, (1, n), device="cuda")
        try:
            with torch.no_grad():
                model(ids[:, :4096], use_cache=True, logits_to_keep=1)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                model(ids, use_cache=True, logits_to_keep=1)
                torch.cuda.synchronize()
                res[f"prefill_{n}_s"] = time.perf_counter() - t0
        except torch.OutOfMemoryError as ex:
            res[f"prefill_{n}_error"] = str(ex)[:200]
            torch.cuda.empty_cache()
    res["peak_mem_GB"] = torch.cuda.max_memory_allocated() / 1e9
    R["prefill"] = res
    print("prefill", res, flush=True)


report(echo=True)
