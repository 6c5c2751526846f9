"""The calibration's deterministic forward (``kvzip_eval.calibrate.exact``): its pieces are
exact or fixed-order, it agrees with the model's float64 forward, and `kvzip calibrate` writes
the same bytes under every SIMD width and thread count this machine can emulate."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
import torch

from kvzip_eval.calibrate import exact


def test_exact_matmul_does_not_depend_on_the_order_of_the_sum():
    """Block-quantized operands: every partial sum is exact, so any order gives one result."""
    g = torch.Generator().manual_seed(0)
    k = 1536
    # magnitudes spread over 2**-20 .. 2**20, signs mixed: plain float64 sums depend on order
    a = torch.randn(4, k, generator=g, dtype=torch.float64) * 2.0 ** torch.randint(
        -20, 20, (4, k), generator=g
    )
    b = torch.randn(k, 3, generator=g, dtype=torch.float64) * 2.0 ** torch.randint(
        -20, 20, (k, 3), generator=g
    )
    bits = exact.product_bits(k)
    assert bits == 21
    bq = exact.quantize(b, bits, 0)
    got = exact.exact_matmul(a, bq, bits)
    aq = exact.quantize(a, bits, -1)
    terms = aq[:, :, None] * bq[None]  # [4, k, 3], each product exact
    perm = torch.randperm(k, generator=g)
    for other in (terms.sum(1), terms.flip(1).cumsum(1)[:, -1], terms[:, perm].cumsum(1)[:, -1]):
        assert torch.equal(got, other)
    # while the unquantized product does depend on the order here
    plain = a[:, :, None] * b[None]
    assert not torch.equal(plain.cumsum(1)[:, -1], plain.flip(1).cumsum(1)[:, -1])
    # quantization error: at most half a quantum, 2**-(bits+1) of the row's (column's) max
    assert ((aq - a).abs() <= a.abs().amax(-1, keepdim=True) * 2.0**-bits).all()


def test_quantize_keeps_at_most_bits_and_handles_zero_rows():
    x = torch.tensor([[3.0, -1e-9, 0.5], [0.0, 0.0, 0.0]], dtype=torch.float64)
    q = exact.quantize(x, 4, -1)
    assert q[0].tolist() == [3.0, 0.0, 0.5] and q[1].tolist() == [0.0, 0.0, 0.0]
    assert exact.pow2(torch.tensor([-3, 0, 10])).tolist() == [0.125, 1.0, 1024.0]


def test_exp_and_sin_cos_match_libm_to_a_few_ulps():
    x = torch.linspace(-700, 700, 20001, dtype=torch.float64)
    assert ((exact.exp(x) - torch.exp(x)) / torch.exp(x)).abs().max() < 1e-15
    a = torch.linspace(-9000, 9000, 20001, dtype=torch.float64)
    s, c = exact.sin_cos(a)
    assert (s - torch.sin(a)).abs().max() < 1e-15 and (c - torch.cos(a)).abs().max() < 1e-15
    with pytest.raises(ValueError, match="below 1.6e6"):
        exact.sin_cos(torch.tensor([2e6], dtype=torch.float64))
    inv = exact.default_inv_freq(100000.0, 64)
    want = 1.0 / (100000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    assert ((inv - want) / want).abs().max() < 1e-15


def test_attention_does_not_depend_on_the_query_block(monkeypatch):
    forward = exact.ExactLlama.__new__(exact.ExactLlama)
    forward.hq, forward.hkv, forward.d = 4, 2, 16
    forward.table = exact._weight_table(exact._TABLE_LEN)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(300, h, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    outs = []
    for block in (32, 128, 512):
        monkeypatch.setattr(exact, "QUERY_BLOCK", block)
        outs.append(forward._attention(q * 3, k, v))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    # and it is causal softmax attention, to the grid's precision
    ref = (
        torch.nn.functional.scaled_dot_product_attention(
            (q * 3).transpose(0, 1),
            k.transpose(0, 1).repeat_interleave(2, 0),
            v.transpose(0, 1).repeat_interleave(2, 0),
            is_causal=True,
        )
        .transpose(0, 1)
        .reshape(300, 64)
    )
    assert (outs[0] - ref).abs().max() < 1e-3 * v.abs().max()


def test_exact_forward_agrees_with_the_models_float64_forward(loaded):
    """The statistics' K/V are the model's (transformers, float64) to 1e-3 of each layer's
    largest entry (measured: <= 1.1e-4 at 300 tokens; bf16 differs from it by 4e-2)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from kvzip_eval.corpus import token_windows
    from kvzip_eval.model import hf_folder

    ids = token_windows(loaded.tokenizer, 1, 160, split="calib", seed=0)
    ref_model = AutoModelForCausalLM.from_pretrained(
        hf_folder(None), dtype=torch.float64, attn_implementation="sdpa"
    ).eval()
    cache = DynamicCache(config=ref_model.config)
    with torch.no_grad():
        ref_model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    ref = [(la.keys[0].transpose(0, 1), la.values[0].transpose(0, 1)) for la in cache.layers]
    got = {li: (k, v) for li, _, _, k, v in exact.ExactLlama(loaded.model).qkv(ids)}
    assert sorted(got) == list(range(loaded.info.num_layers))
    for li, (k, v) in got.items():
        for mine, theirs in ((k, ref[li][0]), (v, ref[li][1])):
            err = (mine - theirs).abs().max() / theirs.abs().max()
            assert err < 1e-3, (li, float(err))


#: Settings that change which kernels run: torch's vector width (ATen dispatch), MKL's and
#: oneDNN's instruction sets, numpy's, and the thread count.
ISA_SETTINGS = {
    "default-1thread": {
        "ATEN_CPU_CAPABILITY": "default",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "NPY_DISABLE_CPU_FEATURES": "AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL "
        "AVX512_ICL AVX512_SPR AVX2 FMA3",
    },
    "avx2-2threads": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "OMP_NUM_THREADS": "2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    },
    "native-2threads": {"OMP_NUM_THREADS": "2"},
}
_CHILD = (
    "import sys, torch; print('kernels', torch.backends.cpu.get_cpu_capability(), "
    "torch.get_num_threads(), file=sys.stderr); from kvzip_eval.cli import main; main()"
)


@pytest.mark.slow  # three `kvzip calibrate` processes (~20 s of CPU each)
def test_calibrate_writes_the_same_bytes_under_every_isa_and_thread_count(tmp_path):
    """2 windows x 160 tokens (two query blocks) under each setting: identical tensors."""
    digests, kernels = {}, {}
    for name, env in ISA_SETTINGS.items():
        out = tmp_path / name
        child_env = {
            k: v for k, v in os.environ.items() if k not in ISA_SETTINGS["default-1thread"]
        }
        res = subprocess.run(
            [sys.executable, "-c", _CHILD, "calibrate", "--out", str(out)]
            + ["--windows", "2", "--length", "160"],
            env={**child_env, **env, "OMP_WAIT_POLICY": "PASSIVE"},
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        kernels[name] = next(ln for ln in res.stderr.splitlines() if ln.startswith("kernels"))
        digests[name] = hashlib.sha256((out / "calibration.safetensors").read_bytes()).hexdigest()
    # the settings took effect: other vector widths and thread counts really ran
    assert kernels["default-1thread"] == "kernels DEFAULT 1"
    assert kernels["avx2-2threads"] == "kernels AVX2 2"
    assert len(set(digests.values())) == 1, (digests, kernels)
