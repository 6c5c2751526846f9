"""benchmarks/ablation.py (research code outside the shipped package): its variants are the
shipped codec with ingredients switched off by subclassing, so the "all on" variant is the
shipped format byte for byte and "no refit" differs only in the stored scale."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "ablation.py"


@pytest.fixture(scope="module")
def ablation():
    spec = importlib.util.spec_from_file_location("kvzip_ablation_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules[spec.name]


@pytest.fixture(scope="module")
def cal_and_kv(loaded):
    from kvzip_eval.calibrate import fit
    from kvzip_eval.corpus import token_windows
    from kvzip_eval.model import capture_kv

    cal = fit(loaded, token_windows(loaded.tokenizer, 1, 64, split="calib", seed=0))
    ids = token_windows(loaded.tokenizer, 1, 40, split="eval", seed=0)
    return cal, capture_kv(loaded, ids)


def test_shipped_codec_has_no_refit_switch():
    from kvzip_formats.compact.codec import CompactFormat

    assert not hasattr(CompactFormat, "refit_scale")


@pytest.mark.slow  # end to end: runs the command on the model
def test_all_on_variant_is_the_shipped_format(ablation, cal_and_kv):
    from kvzip_formats import get_format

    cal, kv = cal_and_kv
    for v in ablation.shipped():
        ours, shipped = ablation.make_format(v, cal), get_format(v.budget, calibration=cal)
        for layer in (0, 7):
            for i, kind in enumerate("kv"):
                x = kv[layer][i]
                a = ours.encode(x, kind=kind, layer=layer)
                assert torch.equal(a, shipped.encode(x, kind=kind, layer=layer))


@pytest.mark.slow  # end to end: runs the command on the model
def test_no_refit_variant_stores_the_rms_scale(ablation, cal_and_kv):
    from dataclasses import replace

    from kvzip_formats.packing import bytes_to_f16

    cal, kv = cal_and_kv
    v = ablation.shipped()[0]  # 4bit
    on, off = ablation.make_format(v, cal), ablation.make_format(replace(v, refit=False), cal)
    x = kv[3][0]
    a, b = on.encode(x, kind="k", layer=3), off.encode(x, kind="k", layer=3)
    code_bytes = on.spec.layout(x.shape[-1], "k").code_bytes
    assert torch.equal(a[..., :code_bytes], b[..., :code_bytes])  # same codes
    y = on.transform(x, kind="k", layer=3)
    s0 = y.square().mean(-1).sqrt().to(torch.float16)
    assert torch.equal(bytes_to_f16(b[..., code_bytes:]).reshape(s0.shape), s0)
    assert not torch.equal(a[..., code_bytes:], b[..., code_bytes:])  # the refit moved it
    # and the refit is what lowers the error of the decoded vectors
    err = [
        (f.decode(p, kind="k", layer=3, head_dim=x.shape[-1]) - x.float()).square().mean()
        for f, p in ((on, a), (off, b))
    ]
    assert err[0] < err[1]
