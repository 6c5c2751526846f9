#!/usr/bin/env python3
"""The machine code of the CUDA C decoders (csrc/kvzl.cu) at git revisions, compiled on the CPU
machine with nvcc for one GPU (no GPU needed): per decode kernel (``kvzl_decode``, the one-blob
decoder; ``kvzl_bdec`` and ``kvzl_bdec_smem``, the batched ones) the ptxas registers and
spills, the SASS instruction count, the row loop's instruction count (the shortest backward
branch around the mantissa byte loads and the word ballot) and whether the SASS is identical
to the first revision's.

    KVZIP_NVCC=.../nvcc uv run python packages/kvzip-lossless/benchmarks/decode_sass.py \\
        --revs 90d8419 HEAD --out results/lossless

``cuobjdump`` comes from Triton's wheel (``triton/backends/nvidia/bin``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import tempfile
from pathlib import Path

import triton

from kvzip_formats.nvcc import find_nvcc
from kvzip_lossless import _cuda

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
SRC = "packages/kvzip-lossless/src/kvzip_lossless/csrc/kvzl.cu"
KERNELS = ("kvzl_decode", "kvzl_bdec", "kvzl_bdec_smem")


def nvcc() -> str:
    return find_nvcc()


def functions(sass: str) -> dict[str, list[str]]:
    """Mangled kernel name -> its instructions (address comments dropped)."""
    out: dict[str, list[str]] = {}
    cur = None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = out.setdefault(m.group(1), [])
            continue
        m = re.search(r"/\*([0-9a-f]{4})\*/\s*(.*?);", line)
        if cur is not None and m:
            cur.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def row_loop(ins: list[tuple[int, str]]) -> int | None:
    """Instructions of the shortest loop (backward branch) holding a byte load and a ballot."""
    best = None
    for addr, text in ins:
        m = re.search(r"BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", text)
        if not m or int(m.group(1), 16) >= addr:
            continue
        body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
        if any("LDG.E.U8" in t for t in body) and any("VOTE.ANY" in t for t in body):
            best = len(body) if best is None else min(best, len(body))
    return best


def build(rev: str, flags: list[str], tmp: Path) -> dict:
    src = subprocess.run(["git", "show", f"{rev}:{SRC}"], capture_output=True, check=True).stdout
    cu = tmp / f"{rev}.cu"
    cu.write_bytes(src)
    cubin = tmp / f"{rev}.cubin"
    cmd = [nvcc(), "-O3", *flags, "-cubin", "-Xptxas", "-v", "-o", str(cubin), str(cu)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    regs, spills, cur = {}, {}, None
    for line in r.stderr.splitlines():
        m = re.search(r"entry function '(\w+)'", line)
        if m:
            cur = m.group(1)
        m = re.search(r"(\d+) bytes spill stores", line)
        if m and cur:
            spills[cur] = int(m.group(1))
        m = re.search(r"Used (\d+) registers", line)
        if m and cur:
            regs[cur] = int(m.group(1))
    sass = subprocess.run(
        [str(BIN / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    out = {}
    for name, ins in functions(sass).items():
        short = next((k for k in KERNELS if re.match(rf"_Z\d+{k}P", name)), None)
        if short:
            out[short] = dict(
                registers=regs.get(name),
                spill_bytes=spills.get(name),
                instructions=len(ins),
                row_loop=row_loop(ins),
                sass=[t for _, t in ins],
            )
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--revs", nargs="+", default=["HEAD"])
    p.add_argument("--capability", default="9.0")
    p.add_argument("--out", default="results/lossless")
    args = p.parse_args()
    cap = tuple(int(c) for c in args.capability.split("."))
    flags = _cuda.arch_flags(cap)[:1]  # the machine code only
    ver = subprocess.run([nvcc(), "--version"], capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as d:
        res = {rev: build(rev, flags, Path(d)) for rev in args.revs}
    first = res[args.revs[0]]
    rows = []
    for rev in args.revs:
        for k in KERNELS:
            r = res[rev].get(k)
            if r is None:
                continue
            same = first.get(k) is not None and first[k]["sass"] == r["sass"]
            rows.append(
                dict(rev=rev, kernel=k, **{x: r[x] for x in r if x != "sass"}, same_sass=same)
            )
    meta = dict(
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        device="none (nvcc on the CPU machine)",
        nvcc=next((x for x in ver.splitlines() if "release" in x), ver.strip()),
        flags=flags,
        command="python packages/kvzip-lossless/benchmarks/decode_sass.py --revs "
        + " ".join(args.revs),
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_sass.json").write_text(json.dumps(dict(**meta, rows=rows), indent=1) + "\n")
    lines = [
        "# CUDA C decoders' machine code by revision",
        "",
        f"{meta['date']}; {meta['device']}; {meta['nvcc']}; flags `{' '.join(flags)}`; "
        f"`{meta['command']}`. Same SASS: identical instructions to `{args.revs[0]}`'s.",
        "",
        "| rev | kernel | registers | spills (B) | instructions | row loop | same SASS |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rev']} | `{r['kernel']}` | {r['registers']} | {r['spill_bytes']} | "
            f"{r['instructions']} | {r['row_loop']} | {'yes' if r['same_sass'] else 'no'} |"
        )
    (out / "decode_sass.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
