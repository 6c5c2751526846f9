#!/usr/bin/env python3
"""Host-side work per call of paged_decode / cache_write, with the Triton launches stubbed.

Counts the torch (aten) ops one call issues (each is a GPU kernel or a copy on the device)
and the host-to-device uploads among them, and times the wrapper on the CPU. Runs on the CPU
(the counts do not depend on the device; times are this machine's, for ratios only):

    uv run python packages/kvzip-kernels/benchmarks/host_overhead.py --out results/kernels
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


class _Stub:
    """Stands in for a @triton.jit kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *a, **k: None


def _stub_kernels():
    import importlib

    # the package re-exports the functions under the modules' names: import the modules
    # (decode_plan: where the decode launches since plan/run; absent before)
    names = ("kvzip_kernels.paged_decode", "kvzip_kernels.decode_plan", "kvzip_kernels.cache_write")
    for mod_name in names:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        for name in dir(mod):
            if name.endswith("_kernel"):
                setattr(mod, name, _Stub())
    try:  # the compact formats' q/o transforms (absent before version c3)
        import kvzip_kernels._device_consts as dc

        dc._fold_q_kernel = dc._unfold_o_kernel = _Stub()
    except ImportError:
        pass
    # the compact formats' write: one kernel since 2026-12-02 (_write_compact), the split
    # path's quantize/pack kernel before (_write_codebook)
    for mod_name, kern in (
        ("kvzip_kernels._write_compact", "_compact_write_kernel"),
        ("kvzip_kernels._write_codebook", "_codebook_write_kernel"),
    ):
        try:
            setattr(importlib.import_module(mod_name), kern, _Stub())
        except ImportError:
            pass


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--formats", default="int4,4bit,3.5bit,3bit")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="")
    p.add_argument("--tag", default="")
    a = p.parse_args()
    from kvzip_formats import get_format
    from kvzip_formats.ops import new_paged_cache
    from kvzip_kernels import cache_write, paged_decode
    from kvzip_kernels.testing import synthetic_calibration

    _stub_kernels()
    b, hq, hkv, d, ps, ctx = 8, 32, 8, 128, 16, 4096
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, d, generator=g).bfloat16()
    bt = torch.arange(b * ctx // ps, dtype=torch.int32).view(b, -1)
    sl = torch.full((b,), ctx, dtype=torch.int32)
    x = torch.randn(2048, hkv, d, generator=g).bfloat16()
    slots = torch.arange(2048)
    rows = []
    for name in a.formats.split(","):
        cal = synthetic_calibration(hkv, d) if name[0].isdigit() else None
        fmt = get_format(name, calibration=cal)
        kc = new_paged_cache(fmt, b * ctx // ps, hkv, ps, d, kind="k")
        vc = new_paged_cache(fmt, b * ctx // ps, hkv, ps, d, kind="v")
        calls = {
            "paged_decode": lambda fmt=fmt, kc=kc, vc=vc: paged_decode(
                fmt, q, kc, vc, bt, sl, block_size=ps, max_seq_len=ctx
            ),
            "cache_write": lambda fmt=fmt, kc=kc: cache_write(
                fmt, x, kc, slots, kind="k", block_size=ps, check_slots=False
            ),
        }
        for op, fn in calls.items():
            fn()  # first call: caches fill
            with _Count() as c:
                fn()
            t0 = time.perf_counter()
            for _ in range(a.iters):
                fn()
            host_us = (time.perf_counter() - t0) / a.iters * 1e6
            heavy = {
                k: v
                for k, v in c.ops.items()
                if k not in ("view", "empty", "slice", "clone", "transpose")
            }
            rows.append(
                dict(
                    format=name,
                    op=op,
                    aten_ops=sum(c.ops.values()),
                    ops=dict(c.ops),
                    non_view_ops=heavy,
                    host_us=round(host_us, 1),
                )
            )
            print(rows[-1], flush=True)
    if a.out:
        meta = dict(
            device="CPU (kernel launches stubbed)",
            date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            versions=dict(python=platform.python_version(), torch=torch.__version__),
            command=" ".join([Path(sys.executable).name] + sys.argv),
            note="host_us: this shared CPU, ratios only; shape 8B (32 q / 8 kv heads), batch 8",
        )
        out = Path(a.out)
        (out / f"host_overhead{a.tag}.json").write_text(json.dumps(dict(meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
