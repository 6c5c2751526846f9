#!/usr/bin/env python3
"""sm_90a SASS of the CUDA decode kernels (csrc/paged_decode.cu), compiled on the CPU machine
with nvcc (no GPU): per kernel (design, format, head_dim) the ptxas registers, spills and shared
memory, and the instructions of the token loop (the shortest backward branch around the mma
instructions: one warp's 16-token tile; v6: 32 tokens) by opcode class. Per token and KV head:
loop instructions / 16 (v6: / 32).

    KVZIP_NVCC=.../nvcc uv run python packages/kvzip-kernels/benchmarks/cuda_sass.py \\
        --out results/kernels [--against REV]

``--against REV`` also compiles the source as git revision REV holds it, with the same nvcc
and flags, and says per kernel instance present in both whether the machine code is the same
(every instruction word equal): a clean-up of the source that must not change the kernel.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import re
import subprocess
import tempfile
from pathlib import Path

import triton

from kvzip_kernels import _cuda

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
FMT = {0: "int4", 1: "4bit", 2: "3.5bit", 3: "3bit"}
CLASSES = {
    "HMMA": "mma",
    "LDS": "lds",
    "LDG": "ldg",
    "LDGSTS": "cp.async",
    "LDGDEPBAR": "cp.async",
    "DEPBAR": "cp.async",
    "PRMT": "prmt",
    "LOP3": "int",
    "SHF": "int",
    "IADD3": "int",
    "IMAD": "int",
    "LEA": "int",
    "SHFL": "shfl",
    "MUFU": "mufu",
    "MOVM": "movmatrix",
}


def kernel_name(mangled: str) -> tuple[str, str, int] | None:
    m = re.search(r"split_(v4a|v5|v6)ILi(\d)ELi(\d+)ELi\d+ELi(\d+)E", mangled)
    if not m:
        return None
    # v6 with S ring stages: "v6" (S = 2, the shipped design) or "v6s<S>" (research runs)
    design = m[1] if m[1] != "v6" else ("v6" if m[4] == "2" else f"v6s{m[4]}")
    return (design, FMT[int(m[2])], int(m[3]))


def compile_sass(src: Path, flags: list[str]) -> tuple[subprocess.CompletedProcess, str]:
    """nvcc (ptxas -v) of ``src`` to an sm_90a cubin and its SASS (cuobjdump)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        r = subprocess.run(
            [_cuda.nvcc(), "-O3", *flags[:1], "-Xptxas", "-v", "-cubin", "-o", str(cubin)]
            + [str(src)],
            capture_output=True,
            text=True,
            check=True,
        )
        sass = subprocess.run(
            [BIN / "cuobjdump", "-sass", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    return r, sass


def words(sass: str) -> dict[tuple, list[str]]:
    """Per kernel instance (kernel_name) the 64-bit words of its SASS, in order (two per
    128-bit sm_90 instruction)."""
    out = {}
    for fn in re.split(r"\n\s*Function : ", sass)[1:]:
        key = kernel_name(fn.split("\n", 1)[0])
        if key is not None:
            out[key] = re.findall(r"/\* (0x[0-9a-f]{16}) \*/", fn)
    return out


def same_code(rev: str, flags: list[str], sass: str) -> list[dict]:
    """The kernel instances of this source and of git revision ``rev``'s: instruction counts
    and whether every instruction word is equal."""
    repo = _cuda._SRC.parents[5]
    rel = _cuda._SRC.relative_to(repo)
    old = subprocess.run(
        ["git", "-C", str(repo), "show", f"{rev}:{rel}"], capture_output=True, text=True, check=True
    ).stdout
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / _cuda._SRC.name
        src.write_text(old)
        _, old_sass = compile_sass(src, flags)
    now, then = words(sass), words(old_sass)
    rows = []
    for key in sorted(now):
        w0 = then.get(key)
        rows.append(
            dict(
                variant=key[0],
                format=key[1],
                head_dim=key[2],
                instr=len(now[key]) // 2,
                instr_then=None if w0 is None else len(w0) // 2,
                same_machine_code=w0 == now[key],
            )
        )
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="")
    p.add_argument("--against", default="", help="a git revision whose source to compare with")
    a = p.parse_args()
    flags = _cuda.arch_flags((9, 0))
    r, sass = compile_sass(_cuda._SRC, flags)
    res = {}
    cur = None
    for ln in r.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", ln)
        if m:
            cur = kernel_name(m[1])
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ln)
        if m and cur:
            res.setdefault(cur, {})["spill_bytes"] = int(m[1]) + int(m[2])
        m = re.search(r"Used (\d+) registers.*?(\d+) bytes smem", ln)
        if m and cur:
            res.setdefault(cur, {}).update(regs=int(m[1]), smem_bytes=int(m[2]))
    rows = []
    for fn in re.split(r"\n\s*Function : ", sass)[1:]:
        key = kernel_name(fn.split("\n", 1)[0])
        if key is None:
            continue
        ins = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", fn)
        addr = {int(x, 16): op for x, op in ins}
        loops = [
            (int(t, 16), int(s, 16))
            for s, t in re.findall(r"/\*([0-9a-f]+)\*/[^\n]*BRA `?\(?\.?L?[^\n]*?0x([0-9a-f]+)", fn)
            if int(t, 16) < int(s, 16)
        ]
        # the token loop: the shortest backward branch around tensor-core work (longer ones are
        # the compiler's re-convergence paths of divergent shuffles, inner ones copy loops)
        with_mma = [
            (lo, hi)
            for lo, hi in loops
            if any(op.startswith("HMMA") for x, op in addr.items() if lo <= x <= hi)
        ]
        lo, hi = min(with_mma, key=lambda x: x[1] - x[0])
        body = [op for x, op in addr.items() if lo <= x <= hi]
        by = collections.Counter(CLASSES.get(op.split(".")[0], "other") for op in body)
        rows.append(
            dict(
                variant=key[0],
                format=key[1],
                head_dim=key[2],
                **res.get(key, {}),
                loop_instr=len(body),
                per_token_head=round(len(body) / (32 if key[0].startswith("v6") else 16), 1),
                by_class=dict(sorted(by.items())),
            )
        )
    for x in rows:  # dynamic shared memory (csrc: smem_bytes): replicated tables + the ring
        if x["variant"] == "v5" or x["variant"].startswith("v6"):
            d, f = x["head_dim"], x["format"]
            kcb = 7 * d // 16 if f == "3bit" else d // 2
            vcb = {"int4": d // 2, "4bit": d // 2, "3.5bit": 3 * d // 8, "3bit": 5 * d // 16}[f]
            mb = 4 if f == "int4" else 2
            entries = {"int4": 0, "4bit": 256, "3.5bit": 320, "3bit": 336}[f]
            stages = 4 if x["variant"] == "v5" else int(x["variant"][3:] or 2)
            ring = 4 * stages * (1 if x["variant"] == "v5" else 2)  # units of 16 tokens
            x["dynamic_smem_bytes"] = entries * 128 + ring * 16 * (kcb + vcb + 2 * mb)
    rows.sort(key=lambda x: (x["format"], x["head_dim"], x["variant"]))
    for x in rows:
        print(
            f"{x['variant']:5s} {x['format']:7s} d{x['head_dim']:<4d} regs {x.get('regs')} "
            f"spill {x.get('spill_bytes')} smem {x.get('smem_bytes')}"
            f"+{x.get('dynamic_smem_bytes', 0)} loop {x['loop_instr']} "
            f"= {x['per_token_head']} /token-head  {x['by_class']}"
        )
    same = None
    if a.against:
        same = same_code(a.against, flags, sass)
        for x in same:
            print(
                f"against {a.against}: {x['variant']} {x['format']} d{x['head_dim']}: "
                f"{x['instr']} instructions ({x['instr_then']} then), same machine code: "
                f"{x['same_machine_code']}"
            )
    if a.out:
        out = Path(a.out) / "cuda_sass.json"
        meta = dict(
            date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            nvcc=subprocess.run([_cuda.nvcc(), "--version"], capture_output=True, text=True)
            .stdout.strip()
            .splitlines()[-1],
            flags=flags[:1],
            source=str(_cuda._SRC.name),
        )
        if same is not None:
            meta["against"] = dict(rev=a.against, instances=same)
        out.write_text(json.dumps(dict(meta, rows=rows), indent=1))
        print("wrote", out)


if __name__ == "__main__":
    main()
