"""Ablation of the compact formats: what each ingredient contributes at each budget.

Research code, not part of the shipped ``kvzip_eval`` package:

    uv run python packages/kvzip-eval/benchmarks/ablation.py --calibration DIR \\
        --json results/quality/ablation.json --report results/quality/ablation

Every variant is the shipped codec (``kvzip_formats.compact``) with one or more ingredients
switched off by a subclass here (the codec itself has no switches); all are scored by
``kvzip_eval.quality.kl.measure_kl`` on the same held-out windows, next to the baselines, in
one run. Short windows (default 1 x 2,048 tokens) keep it
to ~35 minutes on 2 heavily shared cores; ``kvzip eval --full`` gives the published numbers.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see cmd_eval: small ops, shared cores

import dataclasses  # noqa: E402
import functools  # noqa: E402
from pathlib import Path  # noqa: E402

import click  # noqa: E402
import torch  # noqa: E402

from kvzip_eval.options import output_options  # noqa: E402

#: MSE-optimal step of a uniform mid-rise quantizer for N(0, 1) (by grid search over the
#: step on 4e5 samples), for the "uniform grid" rows: levels (i - (2^b - 1) / 2) * step.
UNIFORM_STEP = {2: 0.9957, 3: 0.5860, 4: 0.3352, 5: 0.1881}


@dataclasses.dataclass(frozen=True)
class Variant:
    label: str
    budget: str
    k_groups: tuple
    v_groups: tuple
    center: bool = True
    smooth: bool = True
    rotate: bool = True
    sink: int = 1
    lloyd: bool = True
    refit: bool = True


def _without_refit(fmt, packed: torch.Tensor, y: torch.Tensor, kind: str) -> torch.Tensor:
    """The shipped rows with the least-squares scale refit undone: the codes are chosen at
    ``s0 = f16(rms(y))`` either way, so storing ``s0`` in the scale field is the codec
    without step 2's refit."""
    from kvzip_formats.packing import f16_to_bytes

    layout = fmt.spec.layout(y.shape[-1], kind)
    s0 = y.float().square().mean(-1).sqrt().to(torch.float16)
    out = packed.clone()
    out[..., layout.code_bytes :] = f16_to_bytes(s0)
    return out


def make_format(variant: Variant, calibration):
    from kvzip_formats.calibration import Calibration
    from kvzip_formats.compact.codec import CompactFormat, CompactSpec
    from kvzip_formats.compact.transform import derive

    t = dict(calibration.tensors)
    for kind in "kv":
        if not variant.center:  # statistics about 0 instead of about the mean
            t[f"{kind}_var"] = t[f"{kind}_var"] + t[f"{kind}_mean"] ** 2
            t[f"{kind}_mean"] = torch.zeros_like(t[f"{kind}_mean"])
        if not variant.smooth:  # weight = var gives a = 1 (no smoothing), order by variance
            t[f"{kind}_weight"] = t[f"{kind}_var"].clone()
    cal = Calibration(model=calibration.model, tensors=t, fit=calibration.fit)
    spec = CompactSpec(variant.label, variant.k_groups, variant.v_groups, variant.sink, 0)

    class Ablated(CompactFormat):
        def quantize(self, y, *, kind):
            packed = super().quantize(y, kind=kind)
            return packed if variant.refit else _without_refit(self, packed, y, kind)

        def transform_of(self, kind, layer):
            key = (kind, layer)
            if key not in self._transforms:
                mean, var, weight = self.calibration.stats(kind, layer)
                groups = self.spec.layout(self.calibration.head_dim, kind).groups
                self._transforms[key] = derive(mean, var, weight, groups, rotate=variant.rotate)
            return self._transforms[key]

        def levels(self, bits):
            return _lloyd_levels(bits) if variant.lloyd else _uniform_levels(bits)

        def edges(self, bits):
            lv = self.levels(bits)
            return (lv[1:] + lv[:-1]) * 0.5

    return Ablated(spec, cal)


@functools.cache
def _lloyd_levels(bits: int) -> torch.Tensor:
    """The frozen codebook, or (5 bits, ablation only) Lloyd-Max levels rounded to fp16."""
    from kvzip_formats.compact import codebook
    from kvzip_formats.lloyd_max import gaussian_codebook

    if bits in codebook.POSITIVE_LEVELS:
        return codebook.levels(bits)
    return torch.tensor(gaussian_codebook(bits), dtype=torch.float16).float()


@functools.cache
def _uniform_levels(bits: int) -> torch.Tensor:
    n = 1 << bits
    return (torch.arange(n, dtype=torch.float32) - (n - 1) / 2) * UNIFORM_STEP[bits]


def shipped() -> list[Variant]:
    """The three shipped formats, as variants (for checks on other windows or calibrations)."""
    return [
        Variant("shipped", "4bit", ((1.0, 4),), ((1.0, 4),)),
        Variant("shipped", "3.5bit", ((1.0, 4),), ((1.0, 3),)),
        Variant("shipped", "3bit", ((0.5, 4), (0.5, 3)), ((0.5, 3), (0.5, 2))),
    ]


def variants() -> list[Variant]:
    four = (((1.0, 4),), ((1.0, 4),))
    three = (((0.5, 4), (0.5, 3)), ((0.5, 3), (0.5, 2)))
    base = dict(center=False, smooth=False, sink=0, lloyd=False, refit=False)
    rows = [
        Variant("Hadamard + uniform grid, RMS scale", "4bit", *four, **base),
        Variant("+ key/value centring", "4bit", *four, **dict(base, center=True)),
        Variant("+ bf16 sink token", "4bit", *four, **dict(base, center=True, sink=1)),
        Variant("+ smoothing (q/o_proj-weighted)", "4bit", *four, lloyd=False, refit=False),
        Variant("+ least-squares token scale", "4bit", *four, lloyd=False),
        Variant("+ Lloyd-Max codebook (= 4bit)", "4bit", *four),
        Variant("K 5 bits, V 3 bits", "4bit", ((1.0, 5),), ((1.0, 3),)),
        Variant(
            "channel split 4/3 bits for K and V",
            "3.5bit",
            ((0.5, 4), (0.5, 3)),
            ((0.5, 4), (0.5, 3)),
        ),
        Variant("K 4 bits, V 3 bits (= 3.5bit)", "3.5bit", ((1.0, 4),), ((1.0, 3),)),
        Variant("K 4 bits, V 2 bits", "3bit", ((1.0, 4),), ((1.0, 2),)),
        Variant("K and V 3 bits", "3bit", ((1.0, 3),), ((1.0, 3),)),
        Variant("split rows with a uniform grid", "3bit", *three, lloyd=False),
        Variant("K 4/3-bit, V 3/2-bit split rows (= 3bit)", "3bit", *three),
    ]
    return rows


@click.command()
@click.option(
    "--calibration", "cal_dir", type=click.Path(exists=True, file_okay=False), required=True
)
@click.option("--windows", type=int, default=1, show_default=True)
@click.option("--baselines", default="int4", show_default=True, help="Baselines in the same run.")
@click.option("--length", type=int, default=2048, show_default=True)
@click.option("--only-shipped", is_flag=True, help="Only the three shipped formats.")
@output_options
def main(cal_dir, windows, baselines, length, only_shipped, json_path, report_dir):
    """KL of every ablation variant next to the baselines (mean KL vs bf16, held-out text)."""
    from kvzip_eval.corpus import token_windows
    from kvzip_eval.model import load_model
    from kvzip_eval.quality.kl import measure_kl
    from kvzip_eval.results import json_text, markdown_table, provenance, provenance_markdown
    from kvzip_formats import get_format
    from kvzip_formats.calibration import Calibration

    loaded = load_model()
    cal = Calibration.load(cal_dir)
    cal.check_model(loaded.info)
    info = loaded.info
    formats = {n: get_format(n) for n in baselines.split(",") if n}
    vs = shipped() if only_shipped else variants()
    for v in vs:
        formats[f"{v.budget}: {v.label}"] = make_format(v, cal)
    wins = token_windows(loaded.tokenizer, windows, length, split="eval")
    stats = measure_kl(loaded, formats, wins)
    int4 = stats["int4"].kl_mean
    rows = []
    for name, fmt in formats.items():
        s = stats[name]
        rows.append(
            {
                "budget": name.split(":")[0] if ":" in name else "baseline",
                "variant": name.split(": ", 1)[-1],
                "bits_d128": round(fmt.bits_per_element(128, 32, num_kv_heads=8), 4),
                "bits_d64": round(
                    fmt.bits_per_element(
                        info.head_dim, info.num_layers, num_kv_heads=info.num_kv_heads
                    ),
                    4,
                ),
                "kl_mean": round(s.kl_mean, 5),
                "kl_vs_int4": round(s.kl_mean / int4, 3),
                "kl_median": round(s.kl_median, 5),
                "top1_agree": round(s.top1_agree, 4),
            }
        )
    prov = provenance()
    setup = {
        "model": info.name,
        "identity": info.identity,
        "windows": windows,
        "length": length,
        "split": "eval",
        "calibration": cal.fit,
    }
    cols = [
        "budget",
        "variant",
        "bits_d128",
        "bits_d64",
        "kl_mean",
        "kl_vs_int4",
        "kl_median",
        "top1_agree",
    ]
    table = markdown_table(rows, cols)
    click.echo(table, err=json_path == "-")
    doc = {"result": "ablation", "setup": setup, "rows": rows, "provenance": prov}
    if json_path == "-":
        click.echo(json_text(doc), nl=False)
    elif json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json_text(doc))
    if report_dir:
        out = Path(report_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.md").write_text(
            "# Ablation of the compact formats (mean KL vs bf16, held-out text)\n\n"
            f"{windows} windows x {length} tokens of the eval split of pydoc_data.topics, "
            f"{info.name}; each row is the shipped codec with ingredients switched off; the "
            "rows of the 4bit budget add one ingredient each down to the '=' row; the other "
            "rows are alternative bit splits at the same budget.\n\n"
            + provenance_markdown(prov)
            + "\n"
            + table
            + "\n"
        )


if __name__ == "__main__":
    main()
