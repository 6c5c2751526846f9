"""``kvzip bench restore``: how fast the lossless tier restores a returning prompt into a paged
bf16 cache, against a raw copy of the same bytes from pinned host memory, without vLLM.

Per context (``--contexts`` tokens, shape ``--shape``): a paged bf16 cache laid out as vLLM
hands it to a connector (one buffer, physical order ``[layers, blocks, tokens, kv_heads,
K|V channels]``, viewed per layer as ``[num_blocks, kv_heads, block_size, 2 * head_size]``),
with room for the prompt twice: its source blocks, filled with synthetic KV-like values (per
layer, per (head, channel) a scale and an offset, plus Gaussian noise; seeded), and as many
destination blocks. The tier's core (``kvzip_vllm.core``: a ``BlockStore`` and the
``CudaTierPipeline``, made as the connector makes them, its default chunk and table fit)
stores the prompt's chunks in prefill-sized steps (``store_s``: the first ``start_stores`` to
every chunk held in the store's arena); then, per repeat:

- the destination blocks are wiped, the whole prompt is restored into them (``start_loads``,
  ``wait_loads``, then a device synchronisation: ``restore_s``, end to end), and the restored
  blocks are compared bit for bit with the source blocks; a restore that fails a chunk or
  differs by one bit stops the command (no row is reported);
- the destination blocks are wiped again and the same bf16 bytes are copied into them from
  page-locked host memory, one contiguous copy per layer (``raw_copy_s``: the least a raw CPU
  tier's restore of that prompt takes), checked the same way.

One untimed restore and raw copy come first (kernels compiled, buffers made). Reported per
context: the bytes (raw bf16, stored blobs, the ratio), store time, restore and raw copy time
(median, min, max of ``--repeats``), their ratio and the restore's GB/s of bf16 delivered.
The data is synthetic: the compression ratio (and with it the restore's bytes copied) depends
on the data; a model's real KV cache compresses differently.

Imports of torch and kvzip-vllm are inside the functions (kvzip-eval does not require
kvzip-vllm; this command does, without vLLM).
"""

from __future__ import annotations

import hashlib
import os
import platform
import statistics
import time
from pathlib import Path

from kvzip_eval.bench import output

#: (layers, kv_heads, head_size)
SHAPES = {"8b": (32, 8, 128), "smollm2": (30, 3, 64), "tiny": (4, 2, 64)}
#: tokens per ``start_stores`` call: one prefill step of that many tokens
STORE_STEP_TOKENS = 8192
#: the connector's defaults (``kvzip_vllm.settings.ConnectorSettings``: fit_tokens,
#: switch_interval_s), kept here so that this command runs where pydantic is not installed
FIT_TOKENS = 1024
SWITCH_INTERVAL_S = 0.0002
#: the store's arena: the prompt's raw bytes times this, plus ARENA_SLACK (blobs stored raw
#: take their chunk's bytes and a header; nothing is spilled: the stores wait for the queue)
ARENA_FACTOR, ARENA_SLACK = 1.1, 64 << 20
#: GPU memory kept free beyond the estimate (allocator rounding, the coder's small buffers)
GPU_MARGIN = 512 << 20
NAME = "bench_restore"


class RestoreBenchError(RuntimeError):
    """A measurement that must not be reported: a chunk not stored or not restored, or
    restored blocks that differ from the source."""


#: operators (or kernels and copies) listed per profiled restore, the longest first
PROFILE_TOP = 8


def default_chunk_tokens() -> int:
    """The tier's default chunk (``KVZIP_TIER_CHUNK_TOKENS``'s default)."""
    from kvzip_formats import settings as table

    return int(table.TIER_CHUNK_TOKENS.default)


def prompt_bytes(shape: str, tokens: int) -> int:
    """bf16 bytes of ``tokens`` tokens' K and V over every layer."""
    layers, heads, head = SHAPES[shape]
    return tokens * layers * 2 * heads * head * 2


def check_context(ctx: int, block_size: int, chunk_tokens: int) -> str | None:
    """Why ``ctx`` cannot be measured, or None."""
    if ctx <= 0:
        return f"context {ctx}: a positive number of tokens"
    if ctx % block_size:
        return f"context {ctx} is not a multiple of the block size {block_size}"
    if ctx % chunk_tokens:
        return (
            f"context {ctx} is not a multiple of the tier's chunk ({chunk_tokens} tokens, "
            "whole chunks are stored and restored)"
        )
    return None


def memory_needs(shape: str, tokens: int, block_size: int, chunk_tokens: int) -> dict[str, int]:
    """Device and host bytes one context takes: the cache (the prompt twice), the restore
    ring (``cuda_pipeline.LOAD_RING`` record buffers and the decoded chunks of a group), a
    store step's staged copy and the coder's working memory (about 1.7x it), the fill's and the
    check's temporaries; on the host, the store's arena and the raw copy's pinned bytes."""
    from kvzip_vllm.core import cuda_pipeline

    layers = SHAPES[shape][0]
    raw = prompt_bytes(shape, tokens)
    chunk = prompt_bytes(shape, chunk_tokens)
    group = cuda_pipeline.BLOCKS_PER_GROUP
    ring = int(cuda_pipeline.LOAD_RING * group * chunk * cuda_pipeline.RECORD_SLACK) + group * chunk
    step = prompt_bytes(shape, min(tokens, STORE_STEP_TOKENS))
    need = {
        "cache": 2 * raw,
        "restore_ring": ring,
        "store_step": int(2.7 * step),
        "temporaries": 2 * raw // layers,
    }
    need["gpu_total"] = sum(need.values()) + GPU_MARGIN
    need["arena"] = arena_bytes(raw)
    need["host_total"] = need["arena"] + raw
    return need


def host_needs(need: dict[str, int], device) -> int:
    """Host bytes of one context: the arena and the raw copy's source; on the CPU also the
    device's share (the cache, the ring, the store steps)."""
    if device.type == "cuda":
        return need["host_total"]
    return need["host_total"] + need["gpu_total"] - GPU_MARGIN


def arena_bytes(raw: int) -> int:
    return int(raw * ARENA_FACTOR) + ARENA_SLACK


def host_available() -> int | None:
    """MemAvailable of /proc/meminfo, in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_memory(torch, device, shape: str, tokens: int, block_size: int, chunk_tokens: int):
    """Raise ValueError naming what context ``tokens`` needs and what is free, where it does
    not fit the device's free memory or the host's available memory."""
    need = memory_needs(shape, tokens, block_size, chunk_tokens)
    gb = 1e9
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if need["gpu_total"] > free:
            raise ValueError(
                f"context {tokens} ({shape}) needs {need['gpu_total'] / gb:.2f} GB of GPU memory "
                f"(the cache of the prompt twice {need['cache'] / gb:.2f} GB, the restore ring "
                f"{need['restore_ring'] / gb:.2f} GB, a store step and the coder "
                f"{need['store_step'] / gb:.2f} GB, temporaries {need['temporaries'] / gb:.2f} "
                f"GB, margin {GPU_MARGIN / gb:.2f} GB); {free / gb:.2f} GB of "
                f"{total / gb:.2f} GB is free on {device}: name shorter --contexts"
            )
    avail, host = host_available(), host_needs(need, device)
    if avail is not None and host > 0.9 * avail:
        on_cpu = "" if device.type == "cuda" else ", and the cache twice with the coder's buffers"
        raise ValueError(
            f"context {tokens} ({shape}) needs {host / gb:.2f} GB of host memory (the tier's "
            f"arena {need['arena'] / gb:.2f} GB, the raw copy's source "
            f"{(need['host_total'] - need['arena']) / gb:.2f} GB{on_cpu}); {avail / gb:.2f} GB "
            "is available (90% of it may be used): name shorter --contexts"
        )
    return need


def device_label(torch, device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def paged_cache(torch, shape: str, blocks: int, block_size: int, device):
    """One bf16 buffer ``[layers, blocks, block_size, kv_heads, 2 * head_size]`` (physical
    order) and its per-layer views ``[blocks, kv_heads, block_size, 2 * head_size]``, as vLLM
    gives a connector its layers (a block's tokens outermost, K then V of a (token, head))."""
    layers, heads, head = SHAPES[shape]
    phys = torch.zeros(layers, blocks, block_size, heads, 2 * head, dtype=torch.bfloat16,
                       device=device)  # fmt: skip
    return phys, [phys[layer].permute(0, 2, 1, 3) for layer in range(layers)]


def fill_kv(torch, phys, blocks: int, seed: int) -> None:
    """The first ``blocks`` blocks of every layer: KV-like bf16, per layer and per (head,
    channel) a scale in [0.05, 2.05) and an offset ~ N(0, 1.5) (keys carry constant offsets
    per channel), plus N(0, 1) noise times the scale; seeded per layer."""
    layers, _, n, heads, c = phys.shape
    for layer in range(layers):
        g = torch.Generator(device=phys.device).manual_seed(seed * 1000 + layer)
        scale = torch.rand(heads, c, generator=g, device=phys.device) * 2 + 0.05
        offset = torch.randn(heads, c, generator=g, device=phys.device) * 1.5
        x = torch.randn(blocks, n, heads, c, generator=g, device=phys.device)
        phys[layer, :blocks].copy_(x.mul_(scale).add_(offset))
        del x


def wipe(torch, phys, first: int) -> None:
    """Blocks ``first..`` of every layer set to 0xFFFF (a NaN no restored value has)."""
    phys[:, first:].view(torch.int16).fill_(-1)


def mismatches(torch, phys, src: slice, dst: slice) -> list[tuple[int, int]]:
    """``(layer, differing 16-bit values)`` of every layer whose blocks ``dst`` differ, bit for
    bit, from its blocks ``src`` (one layer's comparison at a time: bounded temporaries)."""
    counts = []
    for layer in range(phys.shape[0]):
        a, b = phys[layer, dst].view(torch.int16), phys[layer, src].view(torch.int16)
        if a.shape != b.shape:
            raise ValueError(f"blocks {dst} and {src} differ in number")
        counts.append((a != b).sum())
    counts = torch.stack(counts).tolist()  # one read of the device
    return [(layer, int(c)) for layer, c in enumerate(counts) if c]


def check_bit_exact(torch, phys, src: slice, dst: slice, what: str) -> None:
    """Raise :class:`RestoreBenchError` unless blocks ``dst`` equal blocks ``src`` bit for bit
    in every layer."""
    bad = mismatches(torch, phys, src, dst)
    if bad:
        per = phys[0, dst].numel()
        said = ", ".join(f"layer {layer}: {c} of {per}" for layer, c in bad[:6])
        raise RestoreBenchError(
            f"{what}: the destination blocks differ from the source blocks ({said} 16-bit "
            f"values{', ...' if len(bad) > 6 else ''}): not reported"
        )


def chunk_key(tokens: int, i: int) -> bytes:
    return hashlib.sha256(f"kvzip-bench-restore:{tokens}:{i}".encode()).digest()


def chunks(n_blocks: int, bpc: int, first: int = 0) -> list[tuple[int, ...]]:
    """The block ids of each chunk of ``bpc`` blocks, from block ``first``."""
    return [tuple(range(first + i, first + i + bpc)) for i in range(0, n_blocks, bpc)]


def make_tier(torch, caches, block_size: int, bpc: int, raw: int, fit_tokens: int):
    """The store and the pipeline, as the connector makes them on a bf16 cache (its default
    table fit, queue and switch interval), with an arena for the whole prompt and no spill
    (a step waits for the store queue instead, so no chunk is evicted by a spill)."""
    from kvzip_vllm.core.cuda_pipeline import CudaTierPipeline
    from kvzip_vllm.core.pages import Bf16Pages
    from kvzip_vllm.core.store import BlockStore

    store = BlockStore(arena_bytes(raw), tables=None, fit_tokens=fit_tokens)
    layout = Bf16Pages.of(caches[0])
    pipe = CudaTierPipeline(
        store, caches, layout.block_size, bpc, layout=layout, spill_bytes=0,
        switch_interval_s=SWITCH_INTERVAL_S,
    )  # fmt: skip
    return store, pipe


def store_prompt(pipe, store, keys: list[bytes], src_chunks, step_chunks: int) -> None:
    """Store the prompt's chunks in steps of ``step_chunks`` and wait until all are held;
    raise :class:`RestoreBenchError` if one was not stored."""
    pairs = list(zip(keys, src_chunks, strict=True))
    for i in range(0, len(pairs), step_chunks):
        pipe.start_stores(pairs[i : i + step_chunks])
    pipe.drain()
    stored, dropped = pipe.collect()
    missing = [k for k in keys if k not in store]
    if dropped or missing or sorted(stored) != sorted(keys):
        st = store.stats
        raise RestoreBenchError(
            f"the tier holds {len(keys) - len(missing)} of the prompt's {len(keys)} chunks "
            f"({len(dropped)} dropped; store errors {st.store_errors}, skipped "
            f"{st.blocks_skipped}, evictions {st.evictions}, dropped for a full queue "
            f"{st.stores_dropped_queue_full}): nothing reported"
        )


def restore_prompt(torch, pipe, loads) -> tuple[float, float]:
    """Restore ``loads`` end to end: (seconds from ``start_loads`` to the blocks written on the
    device, host seconds of ``start_loads``). Raise :class:`RestoreBenchError` naming the
    blocks that failed (missing or damaged chunks)."""
    sync(torch, pipe.device)
    t0 = time.perf_counter()
    pipe.start_loads(loads)
    failed = pipe.wait_loads()
    sync(torch, pipe.device)
    sec = time.perf_counter() - t0
    if failed:
        raise RestoreBenchError(
            f"the restore failed {len(failed)} blocks (a chunk missing or failing its "
            f"checksums, e.g. block {min(failed)}): not reported"
        )
    return sec, pipe.last_host_s.get("start_loads", 0.0)


def profile_restore(torch, pipe, loads, top: int = PROFILE_TOP) -> dict:
    """One more restore of ``loads`` under torch's profiler: where its time went. On CUDA the
    device time of each copy and kernel name (summed over its launches: copies and kernels on
    different streams overlap, so the sums can pass the wall time; a sum near the wall time
    says that part bounds the restore); on the CPU each operator's own CPU time. Seconds."""
    from torch.profiler import ProfilerActivity, profile

    cuda = pipe.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        wall, _ = restore_prompt(torch, pipe, loads)
    events = []
    for ev in prof.key_averages():
        us = ev.self_device_time_total if cuda else ev.self_cpu_time_total
        if us > 0:
            events.append({"name": ev.key, "count": ev.count, "s": round(us / 1e6, 6)})
    events.sort(key=lambda e: -e["s"])
    copies = sum(e["s"] for e in events if e["name"].startswith("Memcpy"))
    return {
        "clock": "device" if cuda else "cpu",
        "wall_s": round(wall, 6),
        "copies_s": round(copies, 6),
        "other_s": round(sum(e["s"] for e in events) - copies, 6),
        "top": events[:top],
    }


def raw_copy(torch, phys, host, first: int) -> float:
    """Copy ``host`` (``[layers, blocks, ...]``, pinned on CUDA) into blocks ``first..`` of
    every layer, one contiguous copy per layer; seconds to the bytes on the device."""
    sync(torch, phys.device)
    t0 = time.perf_counter()
    for layer in range(phys.shape[0]):
        phys[layer, first : first + host.shape[1]].copy_(host[layer], non_blocking=True)
    sync(torch, phys.device)
    return time.perf_counter() - t0


def sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _spread(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def measure_context(torch, o, device, tokens: int, bar) -> dict:
    """One context's row (see the module's docstring)."""
    bs, ct = o.block_size, o.chunk_tokens
    n, bpc = tokens // bs, ct // bs
    raw = prompt_bytes(o.shape, tokens)
    src, dst = slice(0, n), slice(n, 2 * n)
    phys, caches = paged_cache(torch, o.shape, 2 * n, bs, device)
    fill_kv(torch, phys, n, o.seed)
    store, pipe = make_tier(torch, caches, bs, bpc, raw, min(FIT_TOKENS, tokens))
    try:
        keys = [chunk_key(tokens, i) for i in range(n // bpc)]
        bar.set_postfix_str(f"{tokens} tokens: store")
        sync(torch, device)
        t0 = time.perf_counter()
        store_prompt(pipe, store, keys, chunks(n, bpc), max(1, STORE_STEP_TOKENS // ct))
        store_s = time.perf_counter() - t0
        bar.update(1)
        host = torch.empty(phys[:, src].shape, dtype=phys.dtype,
                           pin_memory=device.type == "cuda")  # fmt: skip
        for layer in range(phys.shape[0]):  # (per layer: contiguous, no device temporary)
            host[layer].copy_(phys[layer, src])
        loads = [("prompt", k, ids) for k, ids in zip(keys, chunks(n, bpc, n), strict=True)]
        restores, hosts, copies = [], [], []
        for rep in range(o.repeats + 1):  # the first: warm-up, checked, not timed
            bar.set_postfix_str(f"{tokens} tokens: " + (f"repeat {rep}" if rep else "warm-up"))
            wipe(torch, phys, n)
            sec, host_s = restore_prompt(torch, pipe, loads)
            check_bit_exact(torch, phys, src, dst, f"context {tokens}, restore {rep}")
            wipe(torch, phys, n)
            copy_s = raw_copy(torch, phys, host, n)
            check_bit_exact(torch, phys, src, dst, f"context {tokens}, raw copy {rep}")
            if rep:
                restores.append(sec)
                hosts.append(host_s)
                copies.append(copy_s)
            bar.update(1)
        prof = None
        if o.profile:  # one more restore, profiled, checked, not timed
            bar.set_postfix_str(f"{tokens} tokens: profile")
            wipe(torch, phys, n)
            prof = profile_restore(torch, pipe, loads)
            check_bit_exact(torch, phys, src, dst, f"context {tokens}, profiled restore")
            bar.update(1)
        st = store.stats
    finally:
        pipe.close()
        store.close()
    r50, rmin, rmax = _spread(restores)
    c50, cmin, cmax = _spread(copies)
    return {
        "shape": o.shape,
        "tokens": tokens,
        "chunks": len(keys),
        "raw_bytes": raw,
        "stored_bytes": st.bytes_stored,
        "held_bytes": st.bytes_held,
        "table_bytes": st.table_bytes,
        "ratio": round(raw / st.bytes_stored, 4),
        "store_s": round(store_s, 6),
        "store_gbps": round(raw / store_s / 1e9, 3),
        "restore_s_p50": round(r50, 6),
        "restore_s_min": round(rmin, 6),
        "restore_s_max": round(rmax, 6),
        "restore_host_s_p50": round(statistics.median(hosts), 6),
        "raw_copy_s_p50": round(c50, 6),
        "raw_copy_s_min": round(cmin, 6),
        "raw_copy_s_max": round(cmax, 6),
        "restore_vs_raw": round(r50 / c50, 4),
        "restore_gbps": round(raw / r50 / 1e9, 3),
        "raw_copy_gbps": round(raw / c50 / 1e9, 3),
        "bit_exact": True,
        **({"profile": prof} if prof is not None else {}),
    }


def resolve_device(torch, name: str | None):
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"--device {name}: supported are cuda and cpu")
    return device


def run(o) -> dict:
    """The whole call (options ``o`` as ``kvzip bench restore`` takes them); raises ValueError
    for options that cannot be run, :class:`RestoreBenchError` for a measurement that must not
    be reported (nothing is written then)."""
    try:
        import kvzip_vllm.core.cuda_pipeline  # noqa: F401
    except ImportError as e:
        raise ValueError(
            f"kvzip bench restore needs kvzip-vllm (its tier core; vLLM itself is not needed): {e}"
        ) from None
    import torch
    from tqdm import tqdm

    if o.shape not in SHAPES:
        raise ValueError(f"shape {o.shape!r}: supported are {', '.join(SHAPES)}")
    if not o.contexts:
        raise ValueError("no context to measure")
    chunk_tokens = getattr(o, "chunk_tokens", None) or default_chunk_tokens()
    o.chunk_tokens = chunk_tokens
    if chunk_tokens % o.block_size:
        raise ValueError(
            f"the tier's chunk of {chunk_tokens} tokens is not a multiple of the block size "
            f"{o.block_size}"
        )
    for ctx in o.contexts:
        why = check_context(ctx, o.block_size, chunk_tokens)
        if why:
            raise ValueError(why)
    device = resolve_device(torch, o.device)
    needs = {}
    for ctx in o.contexts:  # every context checked before the first is measured
        needs[ctx] = check_memory(torch, device, o.shape, ctx, o.block_size, chunk_tokens)
    rows = []
    o.profile = bool(getattr(o, "profile", False))  # (callers without the option: off)
    steps = o.repeats + 2 + o.profile
    bar = tqdm(total=len(o.contexts) * steps, desc="bench restore", unit="step")
    for ctx in o.contexts:
        rows.append(measure_context(torch, o, device, ctx, bar))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    bar.close()
    layers, heads, head = SHAPES[o.shape]
    from kvzip_vllm.core import cuda_pipeline

    doc = output.header("restore", "The lossless tier's restore beside a raw bf16 copy, "
                        "without vLLM", device_label(torch, device))  # fmt: skip
    doc.update(
        settings={
            "shape": o.shape,
            "layers": layers,
            "kv_heads": heads,
            "head_size": head,
            "contexts": o.contexts,
            "block_size": o.block_size,
            "chunk_tokens": chunk_tokens,
            "store_step_tokens": STORE_STEP_TOKENS,
            "fit_tokens": FIT_TOKENS,
            "load_group_chunks": cuda_pipeline.BLOCKS_PER_GROUP,
            "repeats": o.repeats,
            "profile": o.profile,
            "seed": o.seed,
            "device": str(device),
            "cache_layout": "[layers, blocks, block_size, kv_heads, 2 * head_size] bf16",
        },
        data=(
            "synthetic KV-like bf16 (per layer and (head, channel) a scale and an offset, "
            "Gaussian noise; seeded): the compression ratio depends on the data, and a model's "
            "KV cache compresses differently; the tables are fitted on the first stored step"
        ),
        baseline=(
            "raw_copy: the same bf16 blocks copied from host memory (page-locked on CUDA) into "
            "the destination blocks, one contiguous copy per layer (the least a raw CPU tier's "
            "restore of the prompt takes)"
        ),
        memory={str(c): n for c, n in needs.items()},
        rows=rows,
    )
    output.write(Path(o.out), NAME, doc, _markdown(doc), lambda ax: _plot(ax, rows))
    return doc


def _markdown(doc: dict) -> list[str]:
    s = doc["settings"]
    lines = [
        f"Shape {s['shape']} ({s['layers']} layers, {s['kv_heads']} KV heads, head size "
        f"{s['head_size']}), block size {s['block_size']}, chunks of {s['chunk_tokens']} tokens "
        f"stored in steps of {s['store_step_tokens']} tokens; times: median (min-max) of "
        f"{s['repeats']} repeats after one untimed, end to end (to the blocks on the device).",
        "",
        f"- data: {doc['data']}",
        f"- baseline: {doc['baseline']}",
        "- every restored block was compared bit for bit with its source (a row is reported "
        "only if all were equal)",
        "",
    ]
    rows = [
        {**r, "restore_s": f"{r['restore_s_p50']:.4g} ({r['restore_s_min']:.4g}-"
         f"{r['restore_s_max']:.4g})", "raw_copy_s": f"{r['raw_copy_s_p50']:.4g} "
         f"({r['raw_copy_s_min']:.4g}-{r['raw_copy_s_max']:.4g})"}
        for r in doc["rows"]
    ]  # fmt: skip
    lines += output.table(
        rows,
        [
            ("tokens", "tokens"),
            ("raw_bytes", "raw bytes"),
            ("stored_bytes", "stored bytes"),
            ("ratio", "ratio"),
            ("store_s", "store s"),
            ("restore_s", "restore s"),
            ("raw_copy_s", "raw copy s"),
            ("restore_vs_raw", "restore / raw copy"),
            ("restore_gbps", "restore GB/s (bf16)"),
            ("raw_copy_gbps", "raw copy GB/s"),
            ("bit_exact", "bit-exact"),
        ],
    )
    profiled = [r for r in doc["rows"] if "profile" in r]
    if profiled:
        clock = profiled[0]["profile"]["clock"]
        lines += [
            "",
            f"One more restore per context under torch's profiler ({clock} time, seconds, "
            "summed over launches: work on different streams overlaps, so a sum can pass the "
            "wall time; copies: CUDA's memory copies):",
            "",
        ]
        for r in profiled:
            p = r["profile"]
            top = "; ".join(f"{e['name'][:60]} x{e['count']}: {e['s']:.4g}" for e in p["top"])
            lines.append(
                f"- {r['tokens']} tokens: wall {p['wall_s']:.4g}, copies {p['copies_s']:.4g}, "
                f"the rest {p['other_s']:.4g}; largest: {top}"
            )
    return lines


def _plot(ax, rows: list[dict]) -> None:
    """Restore and raw copy time (median, min-max bars) per context."""
    xs = [r["tokens"] for r in rows]
    for key, label in (("restore_s", "kvzip tier restore"), ("raw_copy_s", "raw bf16 copy")):
        p50 = [r[f"{key}_p50"] for r in rows]
        err = [[r[f"{key}_p50"] - r[f"{key}_min"] for r in rows],
               [r[f"{key}_max"] - r[f"{key}_p50"] for r in rows]]  # fmt: skip
        ax.errorbar(xs, p50, yerr=err, marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("seconds to the blocks on the device")
    ax.set_title("Restoring a returning prompt")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
