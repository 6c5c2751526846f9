"""Regenerate the frozen golden vectors of the compact formats (run by hand, never by tests).

    uv run python packages/kvzip-formats/tests/golden/compact/make_golden.py

Writes ``calibration/`` (a small synthetic calibration: 2 layers, 2 KV heads, head_dim 16
and a second one at head_dim 64) and ``vectors.json``: for each format, head_dim, layer and
kind, the bf16 input (uint16 bit patterns), the packed rows (hex) and the decoded values
(float32 bit patterns). A change here is a change to bytes on disk: bump the spec version.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvzip_formats import get_format
from kvzip_formats.calibration import Calibration

HERE = Path(__file__).parent
FORMATS = ("4bit", "3.5bit", "3bit")


def synthetic_calibration(head_dim: int, seed: int) -> Calibration:
    g = torch.Generator().manual_seed(seed)
    L, H, d = 2, 2, head_dim
    shape = (L, H, d)
    t = {
        "k_mean": torch.randn(shape, generator=g) * 2,
        "k_var": torch.rand(shape, generator=g) * 4 + 0.01,
        "k_weight": torch.rand(shape, generator=g) ** 3 * 10 + 0.001,
        "v_mean": torch.randn(shape, generator=g) * 0.1,
        "v_var": torch.rand(shape, generator=g) + 0.05,
        "v_weight": torch.rand(shape, generator=g) + 0.5,
    }
    model = dict(
        name=f"synthetic-d{d}",
        identity=f"golden-d{d}",
        num_layers=L,
        num_kv_heads=H,
        num_q_heads=2 * H,
        head_dim=d,
    )
    return Calibration(model=model, tensors=t, fit={"synthetic_seed": seed})


def inputs(cal: Calibration, kind: str, layer: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mean, var, _ = cal.stats(kind, layer)
    x = torch.randn(7, cal.num_kv_heads, cal.head_dim, generator=g) * var.sqrt() + mean
    x[3] = 0  # an all-zero vector
    x[4, 0] = mean[0]  # exactly the mean: y = 0
    x[5, 1] *= 40  # an outlier token
    return x.to(torch.bfloat16)


def main() -> None:
    vectors = []
    for d, seed in ((16, 1), (64, 2)):
        cal = synthetic_calibration(d, seed)
        cal.save(HERE / f"calibration-d{d}")
        for name in FORMATS:
            fmt = get_format(name, calibration=cal)
            for layer in range(cal.num_layers):
                for kind in "kv":
                    x = inputs(cal, kind, layer, seed=100 * seed + 10 * layer + (kind == "v"))
                    packed = fmt.encode(x, kind=kind, layer=layer)
                    dec = fmt.decode(packed, kind=kind, layer=layer, head_dim=d)
                    vectors.append(
                        {
                            "format": name,
                            "head_dim": d,
                            "layer": layer,
                            "kind": kind,
                            "shape": list(x.shape),
                            "x_bf16": x.view(torch.int16).flatten().tolist(),
                            "packed_hex": bytes(packed.flatten().tolist()).hex(),
                            "decoded_f32": dec.view(torch.int32).flatten().tolist(),
                        }
                    )
    (HERE / "vectors.json").write_text(json.dumps({"spec_version": 1, "vectors": vectors}) + "\n")
    print(f"{len(vectors)} vectors")


if __name__ == "__main__":
    main()
