"""The PTX codebook lookups of the compact-format decode kernel, checked on the CPU.

The GPU path of ``_decode_codebook`` runs inline PTX that the Triton interpreter cannot
execute; this test interprets that PTX text (the few integer instructions it uses) on random
code words and compares every output with the frozen codebook. The GPU tests run the same
code compiled.
"""

import re

import numpy as np
import pytest
import torch

from kvzip_formats.compact import codebook
from kvzip_kernels._decode_codebook import _ASM2, _ASM3, _ASM4

M32 = 0xFFFFFFFF


def _prmt(a, b, c):
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for k in range(4):
        s = (c >> (4 * k)) & 0xF
        byte = pool[s & 7]
        if s & 8:  # sign-replicate mode
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * k)
    return out


def _lop3(a, b, c, lut):
    out = 0
    for bit in range(32):
        idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((lut >> idx) & 1) << bit
    return out


def run_ptx(asm: str, inputs: dict[str, int]) -> dict[str, int]:
    """Execute the straight-line PTX block ``asm`` on 32-bit registers."""
    regs = dict(inputs)

    def val(tok):
        tok = tok.strip()
        return int(tok, 0) & M32 if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", tok) else regs[tok]

    for stmt in asm.replace("{", ";").replace("}", ";").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, args = stmt.split(None, 1)
        d, *src = [x.strip() for x in args.split(",")]
        v = [val(x) for x in src]
        if op == "mov.b32":
            r = v[0]
        elif op == "and.b32":
            r = v[0] & v[1]
        elif op == "or.b32":
            r = v[0] | v[1]
        elif op == "shr.b32":
            r = v[0] >> v[1]
        elif op == "shl.b32":
            r = (v[0] << v[1]) & M32
        elif op == "mul.lo.u32":
            r = (v[0] * v[1]) & M32
        elif op == "lop3.b32":
            r = _lop3(v[0], v[1], v[2], v[3])
        elif op == "prmt.b32":
            r = _prmt(v[0], v[1], v[2])
        else:
            raise AssertionError(f"instruction {op} not modelled")
        regs[d] = r
    return regs


def _fp16_pairs(*words):
    vals = [w >> s & 0xFFFF for w in words for s in (0, 16)]
    return torch.tensor(vals, dtype=torch.int32).to(torch.int16).view(torch.float16).float()


def test_asm4_matches_codebook():
    lv = codebook.levels(4)
    rng = np.random.default_rng(0)
    words = [0, M32, 0x87878787, 0x78787878] + [int(x) for x in rng.integers(0, 2**32, 300)]
    for w in words:
        r = run_ptx(_ASM4.value, {"$4": w})
        codes = [(w >> (8 * k)) & 0xFF for k in range(4)]
        assert torch.equal(_fp16_pairs(r["$0"], r["$1"]), lv[[c & 15 for c in codes]]), hex(w)
        assert torch.equal(_fp16_pairs(r["$2"], r["$3"]), lv[[c >> 4 for c in codes]]), hex(w)


@pytest.mark.parametrize("seed", range(3))
def test_asm3_matches_codebook(seed):
    lv = codebook.levels(3)
    rng = np.random.default_rng(seed)
    for _ in range(150):
        b2 = [int(x) for x in rng.integers(0, 256, 4)]
        b1s = [int(x) for x in rng.integers(0, 16, 4)]
        w2 = sum(b << (8 * k) for k, b in enumerate(b2))
        w1 = sum(b << (8 * k) for k, b in enumerate(b1s))
        r = run_ptx(_ASM3.value, {"$8": w2, "$9": w1})
        for cls in range(4):
            codes = [((b2[k] >> (2 * cls)) & 3) | (((b1s[k] >> cls) & 1) << 2) for k in range(4)]
            got = _fp16_pairs(r[f"${2 * cls}"], r[f"${2 * cls + 1}"])
            assert torch.equal(got, lv[codes]), (cls, b2, b1s)


def test_asm2_matches_codebook():
    lv = codebook.levels(2)
    rng = np.random.default_rng(3)
    for w in [0, M32] + [int(x) for x in rng.integers(0, 2**32, 200)]:
        r = run_ptx(_ASM2.value, {"$8": w})
        for cls in range(4):
            codes = [((w >> (8 * k)) >> (2 * cls)) & 3 for k in range(4)]
            assert torch.equal(_fp16_pairs(r[f"${2 * cls}"], r[f"${2 * cls + 1}"]), lv[codes])
