#!/usr/bin/env python3
"""Host work of one tier restore (``CudaTierPipeline.start_loads`` + ``wait_loads``), counted.

The question (issue 28, deliverable 2): is there a fixed host cost per restored chunk, or per
layer/kind blob, in the CUDA load path, large enough to explain the SmolLM2 returns being slower
than recomputing them on the H200? This runs the pipeline's own load path on the CPU device, with
kvzip-lossless's CUDA batched decoder's host side (``gpu_batch.prepare_decode`` with the
``cuda`` backend: descriptors, tables, flags) and its three launches stubbed (counted, not run),
for ``chunks`` chunks of 256 tokens (16 blocks of 16) at a model's shape, and counts per load:

* torch ops (``TorchDispatchMode``), split into views (no kernel), allocations (factory ops)
  and the rest (each a kernel launch on a GPU); the decoder's launches (stubs);
* host-to-device record copies (the pipeline's own counter ``last_copies``);
* host synchronisation points: ``.cpu()`` / ``.item()`` / ``.tolist()`` of tensors and
  ``torch.tensor(list, device=...)`` (a pageable copy: on CUDA the host waits for it);
* Python function calls (``sys.setprofile``), overall and in kvzip's code by function: the
  per-chunk and per-layer Python loops show up as call counts proportional to chunks or layers;
* the host CPU time of the load (``time.process_time``, median of ``--reps``): on the CPU the
  torch ops do their copies for real (the scatter moves every byte), so it bounds from above.

It also counts the benchmark's bit-exactness checker (``tier_vs_offload_verify.py``,
``CheckingKvzipConnector.get_block_ids_with_load_errors``: it runs inside every step of
``tier_vs_offload.py`` that restored blocks) for one returning prompt of ``chunks`` chunks,
when vLLM imports (its connector module needs it).

    OMP_WAIT_POLICY=PASSIVE uv run python packages/kvzip-vllm/benchmarks/restore_host_ops.py \
        --out results/vllm/fixed_cost
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # kvzip-lossless's kernels' path on the CPU

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import kvzip_lossless  # noqa: E402
from kvzip_lossless import _cuda, batch, gpu_batch  # noqa: E402
from kvzip_vllm.core.cuda_pipeline import CudaTierPipeline  # noqa: E402
from kvzip_vllm.core.store import BlockStore  # noqa: E402

#: (layers, kv_heads, head_size) of the two shapes of the H200 comparison
SHAPES = {"smollm2": (30, 3, 64), "llama8b": (32, 8, 128)}
#: a tiny shape for the test of this script (not in the default run)
TINY = {"tiny": (3, 2, 16)}
BLOCK_SIZE, BPC = 16, 16  # vLLM's block size, blocks per stored chunk (256-token chunks)

#: torch ops that only make views (no kernel, no copy on a GPU)
VIEWS = {"view", "_unsafe_view", "slice", "select", "as_strided", "expand", "unsqueeze",
         "squeeze", "permute", "transpose", "t", "alias", "detach", "reshape", "unbind",
         "split", "split_with_sizes", "narrow", "view_as", "lift_fresh",
         "_reshape_alias"}  # fmt: skip
#: factory ops: an allocation each (``zeros`` / ``full``: plus a fill kernel on a GPU)
ALLOCS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "zeros",
          "zeros_like", "new_zeros", "full", "ones", "arange", "scalar_tensor"}  # fmt: skip


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


LAUNCHES: collections.Counter[str] = collections.Counter()
SYNCS: collections.Counter[str] = collections.Counter()


def _stub_decoder() -> None:
    """The CUDA batched decoder's launches counted, not run (their outputs: zeros)."""
    for name in ("batch_check", "batch_decode", "batch_fold"):
        setattr(_cuda, name, lambda *a, _n=name, **k: LAUNCHES.update([_n]))

    orig = batch.prepare_decode_batch

    def prepare(data, offsets, plans, *, tables, out=None, out_offsets=None):
        # the public entry's checks (numpy), then the H200's host path: the CUDA backend
        orig(data, offsets, plans, tables=tables, out=out, out_offsets=out_offsets)
        plans = np.asarray(plans).astype(np.int64)
        sets = [] if tables is None else [tables]
        return gpu_batch.prepare_decode(
            data, np.asarray(offsets, np.int64).reshape(-1), plans, sets,
            batch._set_index(plans, sets), out, np.asarray(out_offsets, np.int64).reshape(-1),
            backend="cuda",
        )  # fmt: skip

    kvzip_lossless.prepare_decode_batch = prepare
    # the H200's CUDA decoder reads its descriptors from page-locked memory: copies go first
    kvzip_lossless.prepare_copies_nothing = lambda device: True


def _count_syncs() -> None:
    """Count the host's synchronisation points (no-ops on the CPU; each waits on CUDA)."""
    for name in ("cpu", "item", "tolist"):
        f = getattr(torch.Tensor, name)

        def wrapped(self, *a, _f=f, _n=name, **k):
            SYNCS[f"Tensor.{_n}()"] += 1
            return _f(self, *a, **k)

        setattr(torch.Tensor, name, wrapped)
    tensor = torch.tensor

    def tensor_on(data, *a, **k):
        if "device" in k:
            SYNCS["torch.tensor(list, device=...) (pageable copy)"] += 1
        return tensor(data, *a, **k)

    torch.tensor = tensor_on


def paged_caches(layers, heads, head_size, blocks):
    """One backing buffer viewed per layer as ``[num_blocks, kv_heads, block_size,
    2 * head_size]`` bf16, token-major within a block (vLLM's NHD: its default)."""
    buf = torch.empty((layers, blocks, BLOCK_SIZE, heads, 2 * head_size), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    for layer in range(layers):  # KV-like: a scale and an offset per channel, noise
        scale = torch.rand(heads, 2 * head_size, generator=g) * 2 + 0.05
        offset = torch.randn(heads, 2 * head_size, generator=g) * 1.5
        x = torch.randn(blocks, BLOCK_SIZE, heads, 2 * head_size, generator=g)
        buf[layer] = (x * scale + offset).to(torch.bfloat16)
    return [buf[layer].permute(0, 2, 1, 3) for layer in range(layers)]


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def build(shape: str, chunks: int):
    layers, heads, d = {**SHAPES, **TINY}[shape]
    caches = paged_caches(layers, heads, d, chunks * BPC)
    window = [
        (c[:BPC].permute(0, 2, 1, 3).reshape(-1, heads, 2 * d)[..., :d].contiguous(),
         c[:BPC].permute(0, 2, 1, 3).reshape(-1, heads, 2 * d)[..., d:].contiguous())
        for c in caches
    ]  # fmt: skip
    tables = kvzip_lossless.build_kv_tables([window])
    store = BlockStore(4 << 30, tables=tables, fit_tokens=0)
    pipe = CudaTierPipeline(store, caches, BLOCK_SIZE, BPC, queue_bytes=1 << 30)
    # one chunk coded by the pipeline's store path, held under `chunks` keys (back to back in
    # the arena, as a prefix stored in order lies): the load path sees `chunks` entries
    pipe.start_stores([(_key(0), list(range(BPC)))])
    pipe.drain()
    stored, dropped = pipe.collect()
    if stored != [_key(0)]:
        raise RuntimeError(f"the chunk was not stored (dropped {len(dropped)})")
    blobs, _, _ = store.get_entry(_key(0))
    raw = 2 * layers * BPC * BLOCK_SIZE * heads * d * 2
    for i in range(1, chunks):
        store.put_blobs(_key(i), tuple(bytes(b) for b in blobs), raw)
    coded = sum(len(b) for b in blobs)
    return pipe, store, {"layers": layers, "kv_heads": heads, "head_size": d,
                         "chunk_tokens": BPC * BLOCK_SIZE, "chunk_raw_bytes": raw,
                         "chunk_coded_bytes": coded, "blobs_per_chunk": 2 * layers}  # fmt: skip


def _loads(chunks: int):
    # every chunk restored into other blocks (the reverse order), as a returning prompt is
    n = chunks * BPC
    return [("r", _key(i), list(range(n - (i + 1) * BPC, n - i * BPC)), 0) for i in range(chunks)]


def count_load(pipe, chunks: int, reps: int) -> dict:
    loads = _loads(chunks)
    with _Ops():  # warm: the tables' bank, the allocator, the dispatch mode's imports
        pipe.start_loads(loads)
        if pipe.wait_loads():
            raise RuntimeError("the warm-up load failed")
    LAUNCHES.clear()
    SYNCS.clear()
    calls: collections.Counter[str] = collections.Counter()
    c_calls = [0]

    def prof(frame, event, arg):
        if event == "call":
            co = frame.f_code
            calls[f"{Path(co.co_filename).name}:{co.co_name}"] += 1
        elif event == "c_call":
            c_calls[0] += 1

    ops = _Ops()
    sys.setprofile(prof)
    try:
        with ops:
            pipe.start_loads(loads)
            failed = pipe.wait_loads()
    finally:
        sys.setprofile(None)
    if failed:
        raise RuntimeError(f"the counted load failed: {len(failed)} blocks")
    copies, launches, syncs = pipe.last_copies, dict(LAUNCHES), dict(SYNCS)
    times = []
    for _ in range(reps):
        t0 = time.process_time()
        pipe.start_loads(loads)
        pipe.wait_loads()
        times.append(time.process_time() - t0)
    views = sum(v for k, v in ops.ops.items() if k in VIEWS)
    allocs = sum(v for k, v in ops.ops.items() if k in ALLOCS)
    kernels = sum(v for k, v in ops.ops.items() if k not in VIEWS and k not in ALLOCS)
    fills = sum(v for k, v in ops.ops.items() if k in {"zeros", "new_zeros", "zeros_like",
                                                       "full", "ones", "arange"})  # fmt: skip
    kvzip_calls = {k: v for k, v in calls.items() if _ours(k)}
    return {
        "chunks": chunks,
        "torch_ops": dict(sorted(ops.ops.items(), key=lambda kv: -kv[1])),
        "torch_ops_total": sum(ops.ops.values()),
        "view_ops": views,
        "allocations": allocs,
        "fill_launches": fills,
        "torch_kernel_ops": kernels,
        "decoder_launches": launches,
        "launches_total": kernels + fills + sum(launches.values()),
        "h2d_record_copies": copies,
        "host_syncs": syncs,
        "host_syncs_total": sum(syncs.values()),
        "python_calls": sum(calls.values()),
        "python_c_calls": c_calls[0],
        "kvzip_calls_top": dict(sorted(kvzip_calls.items(), key=lambda kv: -kv[1])[:25]),
        "host_cpu_ms_median": round(1e3 * statistics.median(times), 2),
        "host_cpu_ms_all": [round(1e3 * t, 2) for t in times],
    }


def _ours(name: str) -> bool:
    return any(
        name.startswith(p)
        for p in (
            "cuda_pipeline.py",
            "store.py",
            "pages.py",
            "blocks.py",
            "gpu_batch.py",
            "batch.py",
            "tables.py",
            "_prepared.py",
        )  # fmt: skip
    )


# ----------------------------------------------------------------- the benchmark's checker
def count_checker(shape: str, chunks: int, reps: int) -> dict:
    """``CheckingKvzipConnector.get_block_ids_with_load_errors`` for one returning prompt of
    ``chunks`` chunks (its blocks after a store of the same chunks), with the tier's own part
    (``KvzipConnector.get_block_ids_with_load_errors``) replaced by "no errors"."""
    sys.path.insert(0, str(Path(__file__).parent))
    from types import SimpleNamespace

    from tier_vs_offload_verify import CheckingKvzipConnector

    from kvzip_vllm import connector

    layers, heads, d = SHAPES[shape]
    caches = paged_caches(layers, heads, d, 2 * chunks * BPC)
    chk = object.__new__(CheckingKvzipConnector)
    chk._c_init()
    chk._c_caches = caches
    chk._c_differ = torch.zeros((), dtype=torch.int64)
    stores = [SimpleNamespace(key=_key(i), ids=list(range(i * BPC, (i + 1) * BPC)))
              for i in range(chunks)]  # fmt: skip
    n = chunks * BPC
    loads = [SimpleNamespace(key=_key(i), ids=list(range(n + i * BPC, n + (i + 1) * BPC)), skip=0)
             for i in range(chunks)]  # fmt: skip
    meta = SimpleNamespace(stores=stores, loads=loads)
    orig = connector.KvzipConnector.get_block_ids_with_load_errors
    connector.KvzipConnector.get_block_ids_with_load_errors = lambda self: set()
    chk.has_connector_metadata = lambda: True
    chk._get_connector_metadata = lambda: meta
    try:
        # the store side (wait_for_save's copies of the chunks), then the counted load side
        first = chk._append([b for st in stores for b in st.ids])
        for j, st in enumerate(stores):
            chk._c_refs[st.key] = first + j * BPC
        SYNCS.clear()
        ops = _Ops()
        with ops:
            chk.get_block_ids_with_load_errors()
        syncs = dict(SYNCS)
        times = []
        for _ in range(reps):
            t0 = time.process_time()
            chk.get_block_ids_with_load_errors()
            times.append(time.process_time() - t0)
    finally:
        connector.KvzipConnector.get_block_ids_with_load_errors = orig
    views = sum(v for k, v in ops.ops.items() if k in VIEWS)
    return {
        "chunks": chunks,
        "blocks": n,
        "torch_ops": dict(sorted(ops.ops.items(), key=lambda kv: -kv[1])),
        "torch_ops_total": sum(ops.ops.values()),
        "view_ops": views,
        "torch_kernel_ops": sum(ops.ops.values()) - views,
        "host_syncs": syncs,
        "host_cpu_ms_median": round(1e3 * statistics.median(times), 2),
        "host_cpu_ms_all": [round(1e3 * t, 2) for t in times],
    }


# ----------------------------------------------------------------------------- reporting
def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def markdown(doc: dict) -> str:
    lines = [
        "# Host work of one tier restore, counted on the CPU",
        "",
        f"{doc['date']}, device {doc['device']}, {doc['versions']}, commit {doc['commit']}.",
        f"Command: `{doc['command']}`",
        "",
        "Per load (`start_loads` + `wait_loads`) of N chunks of 256 tokens, every layer's K and V",
        "(the H200's host path: kvzip-lossless's CUDA batched decoder, its launches stubbed).",
        "Launches = torch ops that are not views or allocations, fills, and the decoder's",
        "launches; syncs = host synchronisation points (no-ops on the CPU, each a wait on CUDA);",
        "CPU ms = this process's CPU time of the load on the CPU device (the scatter's copies",
        "are done for real: an upper bound of the host work).",
        "",
        "| shape | N | blobs | launches | of which decoder | allocations | views | H2D copies "
        "| syncs | Python calls | CPU ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["loads"]:
        lines.append(
            f"| {r['shape']} | {r['chunks']} | {r['chunks'] * r['blobs_per_chunk']} | "
            f"{r['launches_total']} | {sum(r['decoder_launches'].values())} | "
            f"{r['allocations']} | {r['view_ops']} | {r['h2d_record_copies']} | "
            f"{r['host_syncs_total']} | {r['python_calls']} | {r['host_cpu_ms_median']} |"
        )
    if doc.get("checker"):
        lines += [
            "",
            "The benchmark's bit-exactness checker (`tier_vs_offload_verify.py`), per returning",
            "prompt, in the same step:",
            "",
            "| shape | blocks | torch ops | of which views | kernels | syncs | CPU ms |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in doc["checker"]:
            lines.append(
                f"| {r['shape']} | {r['blocks']} | {r['torch_ops_total']} | {r['view_ops']} | "
                f"{r['torch_kernel_ops']} | {sum(r['host_syncs'].values())} | "
                f"{r['host_cpu_ms_median']} |"
            )
    elif doc.get("checker_error"):
        lines += ["", f"Checker not counted: {doc['checker_error']}"]
    lines += ["", "Torch ops per load (largest first):", ""]
    for r in doc["loads"]:
        top = ", ".join(f"{k} {v}" for k, v in list(r["torch_ops"].items())[:12])
        lines.append(f"- {r['shape']} N={r['chunks']}: {top}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=[*SHAPES, *TINY])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-checker", action="store_true", help="skip the checker (imports vLLM)")
    ap.add_argument("--out", type=Path, default=None, help="folder for the JSON and md")
    ap.add_argument("--name", default="restore_host_ops_cpu")
    args = ap.parse_args(argv)
    if any(c < 1 for c in args.chunks):
        raise SystemExit(f"--chunks must be >= 1, got {args.chunks}")
    torch.set_num_threads(1)
    _stub_decoder()
    _count_syncs()
    rows = []
    for shape in args.shapes:
        pipe, _, info = build(shape, max(args.chunks))
        try:
            for n in sorted(args.chunks):
                r = {"shape": shape, **info, **count_load(pipe, n, args.reps)}
                rows.append(r)
                print(
                    f"{shape} N={n}: launches {r['launches_total']}, syncs "
                    f"{r['host_syncs_total']}, copies {r['h2d_record_copies']}, Python calls "
                    f"{r['python_calls']}, CPU {r['host_cpu_ms_median']} ms",
                    flush=True,
                )
        finally:
            pipe.close()
    doc = {
        "device": "cpu (the CUDA decoder's host path, launches stubbed)",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": np.__version__,
        },  # fmt: skip
        "commit": _commit(),
        "command": " ".join(["python", *sys.argv]),
        "host": platform.processor() or platform.machine(),
        "loads": rows,
    }
    if not args.no_checker:
        try:
            doc["checker"] = []
            for shape in args.shapes:
                r = {"shape": shape, **count_checker(shape, 31, args.reps)}
                doc["checker"].append(r)
                print(f"checker {shape} {r['blocks']} blocks: torch ops {r['torch_ops_total']}"
                      f", CPU {r['host_cpu_ms_median']} ms", flush=True)  # fmt: skip
        except ImportError as e:
            doc.pop("checker", None)
            doc["checker_error"] = f"vLLM not importable: {e}"
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.name}.json").write_text(json.dumps(doc, indent=1) + "\n")
        (args.out / f"{args.name}.md").write_text(markdown(doc))
    return doc


if __name__ == "__main__":
    main()
