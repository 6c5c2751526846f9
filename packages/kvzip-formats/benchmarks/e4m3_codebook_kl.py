"""KL of the compact formats with fp8 e4m3 codebook levels beside today's, in ONE default
`kvzip eval` run: NAME-e4m3 (and +r128) has levels e4m3(alpha L) / alpha, edges their midpoints;
alpha per width (one octave, as ab1f2e2's e4m3_levels.py) minimises the N(0, 1) MSE. CPU.
    python packages/kvzip-formats/benchmarks/e4m3_codebook_kl.py results/formats/e4m3_codebooks
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch

from kvzip_eval.cmd_eval import command
from kvzip_formats import register_format
from kvzip_formats.compact import SPECS, CompactFormat, codebook

E4, out, g = torch.float8_e4m3fn, Path(sys.argv[1]), torch.Generator().manual_seed(0)
xs = torch.randn(2_000_000, generator=g, dtype=torch.float64).sort()[0]
c1, c2 = (torch.cat((torch.zeros(1, dtype=xs.dtype), (xs**p).cumsum(0))) for p in (1, 2))
grid = torch.arange(127, dtype=torch.uint8).view(E4).float()  # every finite e4m3 value >= 0
BASE, LV, ED, cb, F = ("4bit", "3.5bit", "3bit"), {}, {}, {}, {}
mid = lambda v: (v[1:] + v[:-1]) / 2  # noqa: E731


def mse(lv, ed):  # of N(0, 1) samples quantised with edges ed to levels lv, from bin sums
    i = torch.cat((torch.tensor([0]), torch.searchsorted(xs, ed), torch.tensor([len(xs)])))
    n, s1, s2 = i.diff(), c1[i[1:]] - c1[i[:-1]], c2[i[1:]] - c2[i[:-1]]
    return ((s2 - 2 * lv * s1 + n * lv * lv).sum() / len(xs)).item()


for b in (4, 3, 2):  # widths of 4bit, 3.5bit and 3bit (V's second half)
    L, e4 = codebook.levels(b).double(), lambda L, a: (L * a).float().to(E4).double() / a
    m, a = min((mse(e4(L, a), mid(e4(L, a))), a) for a in (2 ** (k / 2000) for k in range(2000)))
    p, m0 = (L * a).float().to(E4), mse(L, codebook.edges(b).double())
    nearest = grid[((L * a).abs().float()[:, None] - grid).abs().argmin(1)] * L.sign()
    assert torch.equal(p.float(), nearest.float()) and not torch.equal(e4(L, a), L)
    LV[b], ED[b] = e4(L, a).float(), mid(e4(L, a).float())
    hx = [f"0x{x:02x}" for x in p.view(torch.uint8).tolist()]  # the e4m3 bytes of alpha L
    cb[b] = dict(alpha=a, levels=LV[b].tolist(), e4m3=hx, mse=(m0, m), mse_increase=m / m0 - 1)


# today's codec with the e4m3 levels and their midpoints as edges
E4M3 = type("E4M3", (CompactFormat,), dict(levels=lambda f, b: LV[b], edges=lambda f, b: ED[b]))
for n in BASE:
    spec = dataclasses.replace(SPECS[n], name=f"{n}-e4m3")
    register_format(spec.name, lambda calibration=None, s=spec: E4M3(s, calibration))
    y, q = torch.randn(64, 3, 64, generator=g), (CompactFormat(SPECS[n]), E4M3(spec))
    assert not torch.equal(*(f.quantize(y, kind="v") for f in q)), f"{n}: same codes"
names = [f"{n}{e}{w}" for w in ("", "+r128") for e in ("", "-e4m3") for n in BASE]
args = ["--no-progress", "--formats", ",".join(names), "--report", str(out / "eval_report")]
command.main([*args, "--json", str(out / "eval.json")], standalone_mode=False)  # default preset
R = json.loads((out / "eval.json").read_text())
for n in names[:3] + names[6:9]:
    k0, k1 = (R["formats"][n.replace("bit", f"bit{e}")]["kl_mean"] for e in ("", "-e4m3"))
    F[n] = dict(kl_today=k0, kl_e4m3=k1, ratio=k1 / k0, within_5pct=abs(k1 / k0 - 1) <= 0.05)
cpu = next(ln.split(": ")[1].strip() for ln in open("/proc/cpuinfo") if "model name" in ln)
res = dict(device=cpu, **R["provenance"], eval_timings_s=R["timings_s"], formats=F, codebooks=cb)
(out / "e4m3_codebook_kl.json").write_text(json.dumps(res, indent=1) + "\n")
print(json.dumps(dict(F=F, alpha={b: c["alpha"] for b, c in cb.items()}), indent=1))
