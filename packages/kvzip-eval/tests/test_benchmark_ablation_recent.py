"""benchmarks/ablation_recent.py (research code outside the shipped package): its attention
reads the bf16 K/V inside the band of the last R positions up to each query and the format's
K/V before it; at R = 0 it is plain causal attention over the format's K/V, at R >= T over the
bf16 K/V, and in between each query row mixes the two exactly as the band says."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "ablation_recent.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("kvzip_ablation_recent_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules[spec.name]


def _inputs(t=12, heads=4, kv_heads=2, d=8):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, t, d, generator=g)
    kb, vb = (torch.randn(1, kv_heads, t, d, generator=g) for _ in range(2))
    kq, vq = kb + 0.3 * torch.randn_like(kb), vb + 0.3 * torch.randn_like(vb)  # "quantized"
    return q, kb, vb, kq, vq


def _run(bench, q, kb, vb, kq, vq, recent):
    bench.ACTIVE.update(cache=SimpleNamespace(raw={0: (kb, vb)}), recent=recent)
    try:
        out, _ = bench.recent_window_attention(SimpleNamespace(layer_idx=0), q, kq, vq, None)
    finally:
        bench.ACTIVE.update(cache=None, recent=0)
    return out.transpose(1, 2)  # [1, heads, T, d]


def _causal(q, k, v):
    n = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n, 1), v.repeat_interleave(n, 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_no_window_is_causal_attention_over_the_formats_kv(bench):
    q, kb, vb, kq, vq = _inputs()
    torch.testing.assert_close(_run(bench, q, kb, vb, kq, vq, 0), _causal(q, kq, vq))


def test_query_chunks_give_the_same_attention(bench, monkeypatch):
    q, kb, vb, kq, vq = _inputs()
    whole = _run(bench, q, kb, vb, kq, vq, 4)
    monkeypatch.setattr(bench, "QUERY_CHUNK", 5)  # 12 rows: chunks of 5, 5, 2
    torch.testing.assert_close(_run(bench, q, kb, vb, kq, vq, 4), whole)


def test_a_window_as_long_as_the_sequence_is_attention_over_bf16(bench):
    q, kb, vb, kq, vq = _inputs()
    torch.testing.assert_close(_run(bench, q, kb, vb, kq, vq, 12), _causal(q, kb, vb))


@pytest.mark.parametrize("recent", [1, 3, 5])
def test_each_query_reads_bf16_inside_its_band_and_the_format_before_it(bench, recent):
    q, kb, vb, kq, vq = _inputs()
    out = _run(bench, q, kb, vb, kq, vq, recent)
    kb2, vb2, kq2, vq2 = (x.repeat_interleave(2, 1) for x in (kb, vb, kq, vq))
    for i in (0, 4, 11):
        j = torch.arange(i + 1)
        inside = j > i - recent
        k = torch.where(inside[:, None], kb2[0, :, : i + 1], kq2[0, :, : i + 1])
        v = torch.where(inside[:, None], vb2[0, :, : i + 1], vq2[0, :, : i + 1])
        p = torch.softmax(q[0, :, i : i + 1] @ k.transpose(-1, -2) / 8**0.5, -1)
        torch.testing.assert_close(out[0, :, i], (p @ v)[:, 0])
