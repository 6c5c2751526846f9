#!/usr/bin/env python3
"""Host-side work of the backend's decode: torch ops and Triton launches per layer call.

vLLM runs kvzip's attention between its CUDA graphs (PIECEWISE), so every torch op and kernel
launch of a layer's call is host time in every decode step, and on the H200 it can exceed the
GPU time of the call (``results/vllm/h200_run10/README.md``: the residual window's profile).
This counts them on the CPU, for one decode step of ``batch`` sequences, through the path
vLLM's CUDA steps take (the kvzip-kernels decode, the window's ring reads and writes), with
the Triton launches stubbed. The counts do not depend on the device. Host time: the median
CPU time of this process (``time.process_time``, one torch thread: robust to other processes
sharing the cores, unlike wall time) of the decode's attention call (``attend_us``) and of the
whole layer call (write + attend, ``layer_us``) with the launches stubbed; the torch ops still
do their work on the CPU (the write's float32 ``bmm`` dominates ``layer_us``), so it bounds the
Python and dispatch time a GPU host pays from above.

    uv run python packages/kvzip-vllm/benchmarks/host_ops.py --out results/vllm
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernels' path on the CPU (stubbed below)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

#: torch ops that only make views (no kernel, no copy on a GPU)
VIEWS = {"view", "_unsafe_view", "slice", "select", "as_strided", "expand", "unsqueeze",
         "squeeze", "permute", "transpose", "t", "alias", "detach", "reshape", "unbind",
         "split", "narrow", "view_as", "lift_fresh"}  # fmt: skip


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


LAUNCHES: collections.Counter[str] = collections.Counter()


class _Stub:
    """Stands in for a @triton.jit kernel: ``kernel[grid](...)`` counts and does nothing."""

    def __init__(self, name):
        self.name = name

    def __getitem__(self, grid):
        def launch(*a, **k):
            LAUNCHES[self.name] += 1

        return launch


def _stub_kernels():
    import importlib

    for name in ("paged_decode", "decode_plan", "cache_write", "_device_consts", "_merge_extra",
                 "_write_codebook", "_write_compact"):  # fmt: skip
        try:
            mod = importlib.import_module(f"kvzip_kernels.{name}")
        except ImportError:
            continue
        for attr in dir(mod):
            if attr.endswith("_kernel") and hasattr(getattr(mod, attr), "run"):
                setattr(mod, attr, _Stub(attr))


def _median_us(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return round(statistics.median(times) * 1e6, 1)


def one(fmt_name: str, batch: int, ctx: int, repeat: int = 200) -> dict:
    import kvzip_formats
    from kvzip_formats.window import split_name
    from kvzip_kernels.testing import synthetic_calibration
    from kvzip_vllm.paged import PagedAttention, plan_step, sink_plan  # both trees have these
    from kvzip_vllm.window import plan_window

    hq, hkv, d, bs = 32, 8, 128, 16  # Llama-3.1-8B's attention
    name, recent = split_name(fmt_name)
    fmt = kvzip_formats.get_format(name, calibration=synthetic_calibration(hkv, d))
    p = PagedAttention(
        fmt, num_heads=hq, num_kv_heads=hkv, head_size=d, block_size=bs, scale=d**-0.5,
        kernels=True, prefill="workspace", recent=recent, window_slot_tokens=4096,
    )  # fmt: skip
    per_seq = -(-(ctx + 1) // bs)
    nblocks = max(batch * per_seq, p.window_blocks_per_slot * batch if recent else 0) + 1
    cache = p.new_cache(nblocks)
    sinks, windows = p.new_pool(cache), p.new_window_pool(cache)
    bt = torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq)
    lens = [ctx + 1] * batch
    qsl = list(range(batch + 1))
    g = torch.Generator().manual_seed(0)
    key = torch.randn(batch, hkv, d, generator=g).bfloat16()
    value = torch.randn(batch, hkv, d, generator=g).bfloat16()
    query = torch.randn(batch, hq * d, generator=g).bfloat16()
    out = torch.empty_like(query)
    slots = torch.tensor([int(bt[i, ctx // bs]) * bs + ctx % bs for i in range(batch)])
    # the step's plans (once per step in vLLM, shared by the layers: not counted)
    fresh, rows = sink_plan(qsl, lens, p.sink_tokens)
    st = plan_step(sinks, bt[:, 0], fresh, rows)
    win = plan_window(windows, recent, qsl, lens, bt, bs) if recent else None
    step = dict(
        query_start_loc_cpu=torch.tensor(qsl), seq_lens_cpu=torch.tensor(lens),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=bt,
    )  # fmt: skip
    # the step's attention plan: made by the step's first layer in vLLM (the backend's _plan);
    # a tree from before plan/run (issue 27) has none: each layer call planned for itself
    plan = p.step_plan(cache, sinks=st, window=win, **step) if hasattr(p, "step_plan") else None

    def attend():
        p.attend(
            query, cache, layer=0, out=out, sinks=st, window=win,
            key=key if recent else None, value=value if recent else None, **step,
            **({"plan": plan} if plan is not None else {}),
        )  # fmt: skip

    def layer():
        p.write(key, value, cache, slots, layer=0, sinks=st)
        attend()

    layer()  # first use: constants to the device, caches
    LAUNCHES.clear()
    with _Count() as c:
        layer()
    launches = dict(LAUNCHES)
    work = {k: v for k, v in c.ops.items() if k not in VIEWS}
    LAUNCHES.clear()
    with _Count() as a:
        attend()
    attend_launches = sum(LAUNCHES.values())
    attend_work = {k: v for k, v in a.ops.items() if k not in VIEWS}
    attend_us, layer_us = _median_us(attend, repeat), _median_us(layer, repeat)
    return {
        "format": fmt_name,
        "batch": batch,
        "context": ctx,
        "torch_ops": sum(c.ops.values()),
        "torch_ops_not_views": sum(work.values()),
        "triton_launches": sum(launches.values()),
        "ops": dict(sorted(work.items())),
        "launches": launches,
        "attend_torch_ops": sum(a.ops.values()),
        "attend_torch_ops_not_views": sum(attend_work.values()),
        "attend_triton_launches": attend_launches,
        "attend_ops": dict(sorted(attend_work.items())),
        "attend_us": attend_us,
        "layer_us": layer_us,
        "repeat": repeat,
    }


def _commit() -> str | None:
    import subprocess

    try:
        return subprocess.run(
            ["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--formats", default="4bit,4bit+r128")
    ap.add_argument("--batch", type=int, default=25)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--out", default="")
    ap.add_argument("--tag", default="")
    ap.add_argument("--repeat", type=int, default=200, help="calls timed (median)")
    ap.add_argument("--note", default="", help="appended to the note (e.g. which tree ran)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    _stub_kernels()
    rows = [one(f, a.batch, a.context, a.repeat) for f in a.formats.split(",")]
    doc = {
        "what": "host-side work of one decode layer call of kvzip's vLLM backend "
        "(write + attend), Triton launches stubbed",
        "device": "CPU (kernel launches stubbed: the counts are the device's too)",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "command": " ".join(["host_ops.py", *sys.argv[1:]]),
        "commit": _commit(),
        "note": "8B attention shape (32 q / 8 KV heads, head 128, block 16); a layer after the "
        "step's first (the step's plans and row ends made once, as in vLLM); host times: "
        f"median CPU time of {a.repeat} calls on {platform.processor() or platform.machine()} "
        f"({os.cpu_count()} CPUs, shared, load average {os.getloadavg()[0]:.1f}), one torch "
        f"thread, launches stubbed{'; ' + a.note if a.note else ''}",
        "rows": rows,
    }
    lines = [
        "# Host-side work per decode layer call (kvzip's vLLM backend)",
        "",
        f"{doc['date']}, {doc['device']}, {doc['versions']}, commit {doc['commit']}; "
        f"`{doc['command']}`. {doc['note']}.",
        "",
        "| format | batch | torch ops | not views | Triton launches | attend: torch ops "
        "| not views "
        "| launches | attend us | layer us |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['format']} | {r['batch']} | {r['torch_ops']} | {r['torch_ops_not_views']} "
            f"| {r['triton_launches']} | {r['attend_torch_ops']} "
            f"| {r['attend_torch_ops_not_views']} | {r['attend_triton_launches']} "
            f"| {r['attend_us']} | {r['layer_us']} |"
        )
    lines += ["", "Ops that are not views, per format:", ""]
    lines += [f"- {r['format']}: {r['ops']}; launches {r['launches']}" for r in rows]
    lines += ["", "The attention call alone (the decode), ops that are not views:", ""]
    lines += [f"- {r['format']}: {r['attend_ops']}" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"host_ops{a.tag}.json").write_text(json.dumps(doc, indent=1) + "\n")
        (out / f"host_ops{a.tag}.md").write_text(text)


if __name__ == "__main__":
    main()
