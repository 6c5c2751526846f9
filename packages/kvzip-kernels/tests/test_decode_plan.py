"""Plan once per step, run per layer (``decode_plan.py``): one plan run over several layers'
caches gives each layer exactly ``paged_decode``'s output; a layer whose tensors are not the
planned ones is refused naming what differs; ``supports``/``refusal`` answer without a call."""

import pytest
import torch
from test_paged_decode import make_case

from kvzip_formats import FormatError, get_format
from kvzip_kernels import DecodeConfig, paged_decode, plan, refusal, supports
from kvzip_kernels.testing import synthetic_calibration


def _layers(name, n, device):
    """``n`` layers' caches and queries over one step's block table and lengths."""
    hq, hkv, d, lens = 8, 2, 128, [37, 20, 1]
    cases = [make_case(name, hq, hkv, d, 16, lens, seed, device) for seed in range(n)]
    fmt = cases[0][0][0]
    if name[0].isdigit():  # a calibration of n layers (each layer decodes with its own)
        fmt = get_format(name, calibration=synthetic_calibration(hkv, d, num_layers=n))
    return fmt, [c[1] for c in cases]


@pytest.mark.parametrize("name", ["int4", "4bit"])
def test_one_plan_runs_every_layer_as_paged_decode_does(name, device):
    fmt, layers = _layers(name, 2, device)
    _, _, _, bt, sl = layers[0]
    cfg = DecodeConfig(block_n=16, num_splits=2)
    g = torch.Generator().manual_seed(5)
    sinks = None
    if name == "4bit":  # bf16 sinks, different per layer
        sinks = [
            tuple((torch.randn(3, 1, 2, 128, generator=g) * 2).bfloat16().to(device) for _ in "kv")
            for _ in layers
        ]
    p = plan(
        fmt,
        num_q_heads=8,
        head_dim=128,
        block_table=bt,
        seq_lens=sl,
        k_cache=layers[0][1],
        v_cache=layers[0][2],
        block_size=16,
        n_sink=1 if sinks else 0,
        config=cfg,
    )
    for i, (q, kc, vc, _, _) in enumerate(layers):
        sk = sinks[i] if sinks else None
        want = paged_decode(fmt, q, kc, vc, bt, sl, block_size=16, layer=i, config=cfg, sinks=sk)
        out = torch.empty_like(q)
        got = p.run(q, kc, vc, layer=i, out=out, sinks=sk)
        assert got is out and torch.equal(got, want), i


def test_a_layer_that_is_not_the_planned_one_is_refused(device):
    fmt, layers = _layers("int4", 1, device)
    q, kc, vc, bt, sl = layers[0]
    p = plan(
        fmt, num_q_heads=8, head_dim=128, block_table=bt, seq_lens=sl, k_cache=kc, v_cache=vc,
        block_size=16,
    )  # fmt: skip
    with pytest.raises(FormatError, match="k_cache .* is not the planned cache"):
        p.run(q, kc[:-1], vc)
    with pytest.raises(FormatError, match=r"q must be bfloat16 \[3, 8, 128\]"):
        p.run(q[:2], kc, vc)
    with pytest.raises(FormatError, match="n_sink=0: sinks= must be None"):
        p.run(q, kc, vc, sinks=(q[:, None, :2], q[:, None, :2]))


def test_supports_and_refusal_need_no_call():
    four = get_format("4bit", calibration=synthetic_calibration(2, 128))
    geo = dict(num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=16)
    assert supports(four, **geo, sinks=True, window=True) and refusal("int4", **geo) is None
    assert "head_dim 64 and 128" in refusal(four, **{**geo, "head_dim": 32})
    assert "block_size" in refusal("int4", **{**geo, "block_size": 24})
    assert "no kvzip_kernels implementation" in refusal("bf16", **geo)
    assert "not a multiple of" in refusal("int4", **{**geo, "num_q_heads": 7})
    assert "sinks= is for the compact formats" in refusal("int4", **geo, sinks=True)
    assert "recent= (a residual window)" in refusal("fp8", **geo, window=True)
    assert not supports("int4", **{**geo, "head_dim": 96})
