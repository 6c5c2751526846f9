#!/usr/bin/env python3
"""sm_90a SASS of the CUDA split kernels (csrc/paged_decode.cu) on the CPU: per instance (design
v6 or v7, format, head_dim, ring slots) the token loop's instructions per token and KV head,
registers, spills, shared memory per CTA and the CTAs per SM those allow on an H100/H200; and,
with ``--against REV``, whether the v6 instances' machine code is word for word that of the
file at git revision REV (a change beside v6 must leave v6 alone).

    python packages/kvzip-kernels/benchmarks/cuda_sass.py [--against REV] [--out DIR]

Compiling and counting are fp8mma.py's (``compile_sass``: nvcc -O3
-gencode=arch=compute_90a,code=sm_90a -cubin -Xptxas -v, then cuobjdump -sass; ``loop_body``:
the shortest backward branch around every mma). The loop of a v6 instance is one warp's 32-token
tile, of a v7 instance its 64-token tile. The count is static: code inside the loop that runs
once in 32 iterations (the block-id refill) or only when the running maximum moved (the
rescale) counts in full, as it did for v6's figures.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "fp8mma"))
import fp8mma  # noqa: E402  (its SASS helpers: compile_sass, loop_body, CLASSES)

ROOT = HERE.parents[2]
SRC = HERE.parent / "src" / "kvzip_kernels" / "csrc" / "paged_decode.cu"
FORMATS = {0: "int4", 1: "4bit", 2: "3.5bit", 3: "3bit"}
NW = 4  # warps per CTA
SM_SMEM = 228 * 1024  # shared memory per SM on sm_90 (227 KB usable by one CTA)
CTA_RESERVED = 1024  # shared memory the runtime keeps per CTA on sm_90
SM_REGS = 65536
MAX_CTAS = 32  # resident CTAs per SM on sm_90
_NAME = re.compile(r"split_v(\d)ILi(\d)ELi(\d+)ELi(\d+)ELi(\d+)E")


def tile_tokens(design: int) -> int:
    return 32 if design == 6 else 64


def dynamic_smem(fmt: int, d: int, slots: int) -> int:
    """The launcher's dynamic shared memory (``smem_bytes<FMT, D, NW, S>``): the replicated
    level tables, then NW x S ring slots of two 16-token units (``Stage<FMT, D>``)."""
    kcb = 7 * d // 16 if fmt == 3 else d // 2
    vcb = d // 2 if fmt <= 1 else 3 * d // 8 if fmt == 2 else 5 * d // 16
    mb = 4 if fmt == 0 else 2
    stage = 16 * (kcb + vcb + 2 * mb)
    entries = {0: 0, 1: 256, 2: 320, 3: 336}[fmt]
    return entries * 128 + NW * slots * 2 * stage


def ctas_per_sm(regs: int, smem: int, threads: int = 32 * NW) -> int:
    """CTAs of ``threads`` threads resident per SM (sm_90: 64K registers allocated per warp in
    units of 256, 228 KB of shared memory with 1 KB reserved per CTA)."""
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = SM_REGS // (per_warp * (threads // 32))
    by_smem = SM_SMEM // (smem + CTA_RESERVED)
    return min(by_regs, by_smem, MAX_CTAS)


def instances(src: Path) -> dict[tuple, dict]:
    """Per (design, fmt, d, slots): ptxas's resources, the machine code and the loop's counts."""
    with tempfile.TemporaryDirectory() as tmp:  # one file name: one anonymous-namespace hash
        path = Path(tmp) / "paged_decode.cu"
        path.write_text(src.read_text())
        log, sass = fp8mma.compile_sass("90a", path)
    res: dict = {}
    cur = None
    for ln in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", ln)
        if m:
            n = _NAME.search(m[1])
            cur = (int(n[1]), int(n[2]), int(n[3]), int(n[5])) if n else None
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ln)
        if m and cur:
            res.setdefault(cur, {})["spill_bytes"] = int(m[1]) + int(m[2])
        m = re.search(r"Used (\d+) registers.*?(\d+) bytes smem", ln)
        if m and cur:
            res.setdefault(cur, {}).update(regs=int(m[1]), static_smem_bytes=int(m[2]))
    out = {}
    for fn in re.split(r"\n\s*Function : ", sass)[1:]:
        head, body_text = fn.split("\n", 1)
        n = _NAME.search(head)
        if not n:
            continue
        key = (int(n[1]), int(n[2]), int(n[3]), int(n[5]))
        # every instruction's text and both 64-bit words of its encoding (the second, with
        # the scheduling bits, on a line of its own), whitespace normalised (cuobjdump pads
        # to the file's longest line)
        code = [" ".join(ln.split()) for ln in body_text.splitlines() if "/* 0x" in ln]
        ins, body = fp8mma.loop_body(fn)
        by = collections.Counter(fp8mma.CLASSES.get(op.split(".")[0], "other") for op in body)
        design, fmt, d, slots = key
        r = res.get(key, {})
        smem = dynamic_smem(fmt, d, slots) + r.get("static_smem_bytes", 0)
        out[key] = dict(
            kernel=f"split_v{design}<{fmt}, {d}, {NW}, {slots}>",
            design=f"v{design}",
            format=FORMATS[fmt],
            head_dim=d,
            ring_slots=slots,
            tile_tokens=tile_tokens(design),
            **r,
            smem_per_cta_bytes=smem,
            ctas_per_sm=ctas_per_sm(r.get("regs", 255), smem) if r else None,
            loop_instr=len(body),
            per_token_head=round(len(body) / tile_tokens(design), 2),
            by_class=dict(sorted(by.items())),
            whole_kernel_instr=len(ins),
            code=code,
        )
    return out


def source_at(rev: str) -> Path:
    """csrc/paged_decode.cu at git revision ``rev``, in a temporary file."""
    rel = SRC.relative_to(ROOT).as_posix()
    text = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:{rel}"], capture_output=True, text=True, check=True
    ).stdout
    tmp = Path(tempfile.mkdtemp()) / "paged_decode.cu"
    tmp.write_text(text)
    return tmp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", help="git revision whose v6 instances must be the same code")
    ap.add_argument("--out", help="directory for cuda_sass_v7.json and .md")
    a = ap.parse_args()
    now = instances(SRC)
    same = None
    if a.against:
        before = instances(source_at(a.against))
        v6 = sorted(k for k in before if k[0] == 6)
        same = {
            f"{FORMATS[k[1]]} d{k[2]}": (k in now and now[k]["code"] == before[k]["code"])
            for k in v6
        }
        same["instructions"] = [len(before[k]["code"]) // 2 for k in v6]
    rows = [{k: v for k, v in x.items() if k != "code"} for _, x in sorted(now.items())]
    base = {(r["format"], r["head_dim"]): r for r in rows if r["design"] == "v6"}
    for r in rows:
        b = base.get((r["format"], r["head_dim"]))
        r["vs_v6"] = round(r["per_token_head"] / b["per_token_head"], 3) if b else None
    for r in rows:
        print(
            f"{r['design']} S{r['ring_slots']} {r['format']:6s} d{r['head_dim']:<3d} "
            f"loop {r['loop_instr']:5d} = {r['per_token_head']:6.2f} /token-head "
            f"(x{r['vs_v6']}) regs {r.get('regs')} spill {r.get('spill_bytes')} "
            f"smem {r['smem_per_cta_bytes']} ctas/SM {r['ctas_per_sm']}"
        )
    if same is not None:
        print(f"v6 instances word for word those of {a.against}: {same}")
    if not a.out:
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = "python packages/kvzip-kernels/benchmarks/cuda_sass.py" + "".join(
        f" --{k} {v}" for k, v in (("against", a.against), ("out", a.out)) if v
    )
    doc = dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        device="CPU (no GPU): nvcc + cuobjdump only",
        nvcc=fp8mma._nvcc_version(),
        flags="-O3 -gencode=arch=compute_90a,code=sm_90a -cubin -Xptxas -v; cuobjdump -sass",
        command=cmd,
        source=SRC.relative_to(ROOT).as_posix(),
        ctas_per_sm_rule=(
            "min(65536 / (regs rounded to 8 per thread x 128 threads), "
            "228 KB / (dynamic + static smem + 1 KB reserved))"
        ),
        v6_same_code_as=a.against,
        v6_same=same,
        rows=rows,
    )
    (out / "cuda_sass_v7.json").write_text(json.dumps(doc, indent=1) + "\n")
    md = [
        "# CUDA split kernels v6 and v7: SASS of the token loop (sm_90a)",
        "",
        f"{doc['date']}, {doc['device']}, {doc['nvcc']}; `{cmd}`.",
        "Loop = the shortest backward branch around the mma instructions (v6: one warp's",
        "32-token tile; v7: its 64-token tile), counted statically; per token-head = loop /",
        "tile tokens. CTAs per SM: " + doc["ctas_per_sm_rule"] + ".",
        "",
    ]
    if same is not None:
        md += [f"v6 instances word for word those of `{a.against}`: {same}", ""]
    md += [
        "| design | ring slots x 32 tokens | format | head_dim | loop instr | per token-head "
        "| vs v6 | registers | spill bytes | smem per CTA (bytes) | CTAs per SM | classes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        md.append(
            f"| {r['design']} | {r['ring_slots']} | {r['format']} | {r['head_dim']} | "
            f"{r['loop_instr']} | {r['per_token_head']} | {r['vs_v6']} | {r.get('regs')} | "
            f"{r.get('spill_bytes')} | {r['smem_per_cta_bytes']} | {r['ctas_per_sm']} | "
            + ", ".join(f"{k} {v}" for k, v in r["by_class"].items())
            + " |"
        )
    (out / "cuda_sass_v7.md").write_text("\n".join(md) + "\n")
    print("wrote", out / "cuda_sass_v7.json")


if __name__ == "__main__":
    main()
