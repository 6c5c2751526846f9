"""Plan once per step, run per layer (``decode_plan.py``): one plan run over several layers'
caches gives each layer exactly ``paged_decode``'s output; a layer whose tensors are not the
planned ones is refused naming what differs; ``supports``/``refusal`` answer without a call."""

import math

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


def _planned(tokens, splits, step=128):
    """The plan's rounding: (splits, tokens per split) for a split count."""
    per = math.ceil(math.ceil(tokens / splits) / step) * step
    return math.ceil(tokens / per), per


def test_split_rule_fills_whole_rounds():
    """Split sizing by the CUDA kernel's residency (NOTES.md "Split sizing by rounds"): the
    grid's CTAs run in rounds of SMs x CTAs per SM, each round paying a CTA's fixed cost."""
    from kvzip_kernels.decode_plan import SPLIT_FIXED_TOKENS, _num_splits, _splits_by_rounds

    cfg = DecodeConfig()
    # 70B-TP8 (1 KV head per GPU) at 32k on 132 SMs x 3 compact CTAs: the old rule's 64 splits
    # of 512 tokens were 512 CTAs = 1.29 rounds; 43 of 768 are one round
    assert _planned(32768, _splits_by_rounds(8, 32768, 396, cfg, 128)) == (43, 768)
    assert _planned(32768, _splits_by_rounds(16, 32768, 396, cfg, 128)) == (24, 1408)
    assert _planned(131072, _splits_by_rounds(8, 131072, 396, cfg, 128)) == (94, 1408)
    # int4's 4 CTAs per SM hold the old rule's 512 CTAs in one round: unchanged
    assert _splits_by_rounds(8, 32768, 528, cfg, 128) == 64
    # the large grids keep splits of 2048 tokens (8B: 8 KV heads, batch 64, 128k)
    assert _splits_by_rounds(64 * 8, 131072, 396, cfg, 128) == 64
    # a sequence shorter than a split: one split
    assert _splits_by_rounds(4, 300, 396, cfg, 128) == 1
    # against the old rule (what _num_splits does without the residency; on the CPU it takes
    # 4 SMs): never more than 3% above its modelled cost, never a split over split_tokens
    cpu = torch.device("cpu")
    for per_sm in (1, 2, 3, 4, 6):
        slots = 4 * per_sm
        for work in (1, 2, 3, 5, 8, 13, 24, 64, 200):
            for tokens in (100, 511, 2048, 5000, 32768, 131072):
                old = _planned(tokens, _num_splits(work, 1, tokens, cfg, cpu))
                new = _planned(tokens, _num_splits(work, 1, tokens, cfg, cpu, per_sm, 128))

                cost = [
                    math.ceil(work * p[0] / slots) * (SPLIT_FIXED_TOKENS + min(p[1], tokens))
                    for p in (old, new)
                ]
                assert cost[1] <= 1.03 * cost[0], (per_sm, work, tokens, old, new)
                assert new[1] <= max(cfg.split_tokens, 128), (per_sm, work, tokens, new)
