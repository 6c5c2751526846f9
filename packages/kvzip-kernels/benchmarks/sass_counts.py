#!/usr/bin/env python3
"""sm_90 SASS of the decode loops, compiled on the CPU machine (Triton's own ptxas/cuobjdump,
no GPU): registers, spill stack and the instructions of the token loop (the body of the one
backward branch) per warp-iteration and per token and KV head (x num_warps / block_n).

    uv run python packages/kvzip-kernels/benchmarks/sass_counts.py --out results/kernels
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
INTS = "stride_btb num_kv_heads tokens_per_split num_splits".split()


def _inspect(kernel, sig, consts, num_warps, num_stages):
    sig = dict(sig, **{k: "constexpr" for k in consts})
    k = triton.compile(
        ASTSource(kernel, signature=sig, constexprs=consts),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=num_warps, num_stages=num_stages),
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        Path(path).write_bytes(k.asm["cubin"])
        res = subprocess.run(
            [BIN / "cuobjdump", "--dump-resource-usage", path], capture_output=True, text=True
        ).stdout
        sass = subprocess.run([BIN / "cuobjdump", "-sass", path], capture_output=True, text=True)
    regs = re.search(r"REG:(\d+) STACK:(\d+)", res)
    loops = [
        (int(a, 16) - int(t, 16)) // 16 + 1
        for a, t in re.findall(r"/\*([0-9a-f]+)\*/[^\n]*BRA 0x([0-9a-f]+)", sass.stdout)
        if int(t, 16) < int(a, 16)
    ]
    return dict(regs=int(regs[1]), spill_stack_bytes=int(regs[2]), loop_instr=max(loops))


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--configs", default="128/4/2,64/4/2")
    p.add_argument("--out", default="")
    a = p.parse_args()
    from kvzip_formats import get_format
    from kvzip_kernels._decode_codebook import _codebook_split_kernel
    from kvzip_kernels._decode_kernels import _int4_split_kernel
    from kvzip_kernels._formats import kernel_spec
    from kvzip_kernels.testing import synthetic_calibration

    rows = []
    for cfg in a.configs.split(","):
        bn, nw, ns = map(int, cfg.split("/"))
        base = dict(G=4, BLOCK_M=16, D=128, PS=16, BLOCK_N=bn, INTERPRET=False)
        sig = dict(bt_ptr="*i32", sl_ptr="*i32", o_ptr="*fp32", lse_ptr="*fp32", qk_scale="fp32")
        sig.update({k: "i32" for k in INTS})
        i4 = dict(sig, q_ptr="*bf16", kc_ptr="*u8", vc_ptr="*u8", kw_ptr="*i32", vw_ptr="*i32")
        i4.update({k: "i32" for k in "stride_qb stride_qh page_bytes blk_stride".split()})
        runs = [("int4", _int4_split_kernel, i4, base)]
        for name in ("4bit", "3.5bit", "3bit"):
            spec = kernel_spec(get_format(name, calibration=synthetic_calibration(8, 128)), 128, 16)
            c = dict(base, KCB=spec.layout.code_bytes, VCB=spec.vlay.code_bytes)
            for kind, groups in (("K", spec.k_groups), ("V", spec.v_groups)):
                for g, (bits, n, off, off1) in enumerate(groups):
                    c.update(
                        {
                            f"{kind}B{g}": bits,
                            f"{kind}N{g}": n,
                            f"{kind}O{g}": off,
                            f"{kind}P{g}": off1,
                        }
                    )
            cs = dict(
                sig,
                q_ptr="*fp16",
                qs_ptr="*fp32",
                kc_ptr="*u8",
                vc_ptr="*u8",
                kh_ptr="*fp16",
                vh_ptr="*fp16",
                lut_ptr="*fp32",
            )
            cs.update(
                {
                    k: "i32"
                    for k in "k_page_bytes v_page_bytes k_blk_stride v_blk_stride skip".split()
                }
            )
            runs.append((name, _codebook_split_kernel, cs, c))
        for name, kern, s, c in runs:
            r = _inspect(kern, s, c, nw, ns)
            r.update(
                format=name,
                config=cfg,
                warp_instr_per_token_head=round(r["loop_instr"] * nw / bn, 1),
            )
            rows.append(r)
            print(r, flush=True)
    if a.out:
        meta = dict(
            device="none: sm_90 SASS compiled on the CPU machine",
            date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            versions=dict(triton=triton.__version__),
            command="uv run python packages/kvzip-kernels/benchmarks/sass_counts.py "
            + f"--configs {a.configs} --out {a.out}",
            note="G=4 (8B GQA), head_dim 128, page 16",
        )
        Path(a.out, "sass_counts_v3.json").write_text(json.dumps(dict(meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
