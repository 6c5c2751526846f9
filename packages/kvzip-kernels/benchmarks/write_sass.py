#!/usr/bin/env python3
"""sm_90a SASS of the compact formats' cache-write kernels, compiled on the CPU machine
(Triton's own ptxas/cuobjdump, no GPU): registers, spill stack, shared memory, instructions
per thread by opcode, and warp-instructions per token and KV head (the tile loop's body; the
previous fused kernel: its whole program, it has no loop), for the one-kernel write
(``_write_compact.py``) and the previous fused write (``write_fused.py``, FMA transform).

    .venv/bin/python packages/kvzip-kernels/benchmarks/write_sass.py --out results/kernels
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ALIGNED = {"stride_xt", "stride_xh", "page_bytes", "blk_stride"}
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
COMMON = dict(cache_ptr="*u8", cache16_ptr="*fp16", slot_ptr="*i64", status_ptr="*i32",
              y_out_ptr="*i32", n="i32", stride_xt="i32", stride_xh="i32",
              num_kv_heads="i32", page_bytes="i32", blk_stride="i32")  # fmt: skip


def compile_sass(kernel, sig, consts, num_warps, num_stages, keep=None):
    sig = dict(sig, **{k: "constexpr" for k in consts})
    # what the launcher specialises at run time: pointers, strides and page sizes of the 8B
    # shape are multiples of 16 (n and num_kv_heads are not assumed to be)
    names = kernel.arg_names
    aligned = [k for k, v in sig.items() if v.startswith("*") or k in ALIGNED]
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in aligned}
    k = triton.compile(
        ASTSource(kernel, signature=sig, constexprs=consts, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=num_warps, num_stages=num_stages),
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        Path(path).write_bytes(k.asm["cubin"])
        res = subprocess.run(
            [BIN / "cuobjdump", "--dump-resource-usage", path], capture_output=True, text=True
        ).stdout
        sass = subprocess.run(
            [BIN / "cuobjdump", "-sass", path], capture_output=True, text=True
        ).stdout
    if keep:
        Path(keep).write_text(sass)
        Path(keep).with_suffix(".ttgir").write_text(k.asm["ttgir"])
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", res)
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)", sass)
    cnt = collections.Counter(ops)
    loops = [
        (int(a, 16) - int(t, 16)) // 16 + 1
        for a, t in re.findall(r"/\*([0-9a-f]+)\*/[^\n;]*BRA[^;\n]*0x([0-9a-f]+) ;", sass)
        if int(t, 16) < int(a, 16)
    ]
    return dict(
        regs=int(m[1]), stack=int(m[2]), shared=k.metadata.shared, instr=len(ops),
        loop_instr=max(loops, default=0), top=dict(cnt.most_common(16)),
    )  # fmt: skip


def groups_of(name, kind, d=128):
    from kvzip_formats import get_format
    from kvzip_formats.ops import PagedLayout
    from kvzip_kernels._formats import _kernel_groups
    from kvzip_kernels.testing import synthetic_calibration

    fmt = get_format(name, calibration=synthetic_calibration(8, d))
    lay = PagedLayout.of(fmt, d, 16, kind)
    return _kernel_groups(fmt.spec.layout(d, kind)), lay.code_bytes


def new_kernel(name, kind, bt, nw, ns, keep=None, xp=1):
    from kvzip_kernels._write_compact import _codebook_consts, _compact_write_kernel

    groups, cb = groups_of(name, kind)
    c = dict(BT=bt, D=128, PS=16, CB=cb, CM=kind == "v", XP=xp, Y_OUT=False, INTERPRET=False)
    for g, (b, n, o, p) in enumerate(groups):
        e, lv = _codebook_consts(b)
        c.update({f"B{g}": b, f"N{g}": n, f"O{g}": o, f"P{g}": p, f"E{g}": e, f"L{g}": lv})
    xdt = {1: "*bf16", 2: "*fp16", 3: "*fp32"}[xp]
    sig = dict(COMMON, x_ptr=xdt, at_ptr="*bf16", bias_ptr="*fp32")
    sig = {k: sig[k] for k in "x_ptr at_ptr bias_ptr".split()} | COMMON
    r = compile_sass(_compact_write_kernel, sig, c, nw, ns, keep)
    # the tile loop's body (a program loops over tiles; its prologue loads the head's A)
    r["warp_instr_per_token_head"] = round(r["loop_instr"] * nw / bt, 1)
    return r


def old_kernel(name, kind, keep=None):
    sys.path.insert(0, str(Path(__file__).parent))
    from write_fused import _codebook_fused_write_kernel

    groups, cb = groups_of(name, kind)
    c = dict(BT=32, D=128, PS=16, CB=cb, CM=kind == "v", KC=16, Y_OUT=False)
    for g, (b, n, o, p) in enumerate(groups):
        c.update({f"B{g}": b, f"N{g}": n, f"O{g}": o, f"P{g}": p})
    sig = dict(x_ptr="*bf16", mean_ptr="*fp32", enc_ptr="*fp32")
    sig |= {k: COMMON[k] for k in "cache_ptr cache16_ptr slot_ptr".split()}
    sig |= dict(edge_ptr="*fp32", lev_ptr="*fp32")
    sig |= {k: v for k, v in COMMON.items() if k not in sig}
    r = compile_sass(_codebook_fused_write_kernel, sig, c, 8, 2, keep)
    r["warp_instr_per_token_head"] = round(r["instr"] * 8 / 32, 1)
    return r


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--configs", default="64/4/1,64/4/2,128/8/1", help="BT/warps/stages,...")
    p.add_argument("--formats", default="4bit,3.5bit,3bit")
    p.add_argument("--old", action="store_true", help="also the previous fused kernel")
    p.add_argument("--keep", default="", help="directory for the SASS and TTGIR text")
    p.add_argument("--out", default="")
    a = p.parse_args()
    rows = []
    for name in a.formats.split(","):
        for kind in "kv":
            for cfg in a.configs.split(","):
                bt, nw, ns = map(int, cfg.split("/"))
                keep = a.keep and f"{a.keep}/new_{name}_{kind}_{bt}_{nw}_{ns}.sass"
                r = dict(kernel="compact", format=name, kind=kind, config=cfg)
                r |= new_kernel(name, kind, bt, nw, ns, keep)
                rows.append(r)
                print(json.dumps(r), flush=True)
            if a.old:
                keep = a.keep and f"{a.keep}/old_{name}_{kind}.sass"
                r = dict(kernel="fused-fma", format=name, kind=kind, config="32/8/2")
                r |= old_kernel(name, kind, keep)
                rows.append(r)
                print(json.dumps(r), flush=True)
    if a.out:
        meta = dict(
            device="none: sm_90a SASS compiled on the CPU machine",
            date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            versions=dict(triton=triton.__version__),
            command="python packages/kvzip-kernels/benchmarks/write_sass.py "
            + " ".join(sys.argv[1:]),
            note="head_dim 128, page 16, bf16 x; instr = SASS instructions of the program",
        )
        Path(a.out, "write_sass.json").write_text(json.dumps(dict(meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
