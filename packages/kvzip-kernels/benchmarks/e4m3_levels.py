#!/usr/bin/env python3
"""How much rounding the compact formats' codebook levels to fp8 e4m3 would add to their
quantisation error (the fp8 tensor-core design NOTES.md's "v6" section analyses; not built):
per code width, the levels times a global scale chosen to minimise the added error (the
per-token scale absorbs it), rounded to e4m3; the mean squared error of quantising N(0, 1)
samples with the format's own edges, with exact and with rounded levels (the least-squares
per-token scale of the write is not modelled: the codes and the scale stay today's). CPU only.

    uv run python packages/kvzip-kernels/benchmarks/e4m3_levels.py --out results/kernels
"""

import argparse
import datetime
import json
from pathlib import Path

import torch

from kvzip_formats.compact import codebook


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="")
    p.add_argument("--samples", type=int, default=2_000_000)
    a = p.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(a.samples, generator=g, dtype=torch.float64)
    rows = []
    for bits in (4, 3, 2):
        lv = codebook.levels(bits).double()
        ed = codebook.edges(bits).double()
        code = torch.bucketize(x, ed)
        mse = ((x - lv[code]) ** 2).mean().item()
        best = None
        for k in range(2000):  # global scales over one octave: e4m3's grid repeats per octave
            s = 2 ** (k / 2000)
            r = torch.tensor(lv * s, dtype=torch.float32).to(torch.float8_e4m3fn).double() / s
            m = ((x - r[code]) ** 2).mean().item()
            if best is None or m < best[0]:
                best = (m, s, r)
        m, s, r = best
        rows.append(
            dict(
                bits=bits,
                levels=lv.tolist(),
                scale=s,
                e4m3_levels=r.tolist(),
                max_rel_level_error=((r - lv).abs() / lv.abs()).max().item(),
                mse_exact=mse,
                mse_e4m3=m,
                mse_increase=m / mse - 1,
            )
        )
        print(f"{bits}-bit: MSE {mse:.5f} -> {m:.5f} (+{100 * (m / mse - 1):.2f}%), scale {s:.4f}")
    if a.out:
        out = Path(a.out) / "e4m3_levels.json"
        out.write_text(
            json.dumps(
                dict(
                    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    torch=torch.__version__,
                    samples=a.samples,
                    command="python packages/kvzip-kernels/benchmarks/e4m3_levels.py",
                    rows=rows,
                ),
                indent=1,
            )
        )
        print("wrote", out)


if __name__ == "__main__":
    main()
