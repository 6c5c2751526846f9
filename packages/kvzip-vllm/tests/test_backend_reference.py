"""The backend's CPU reference path against attention over the format's roundtrip.

The impl writes K/V into vLLM-shaped pages (``[num_blocks, heads, block_size, 2 * tbh]``
uint8) through a slot mapping and attends over what it reads back; that must equal float32
attention over ``fmt.decode(fmt.encode(x))`` of the same tokens (sink tokens exact, as
``roundtrip`` keeps them; float32, as a kernel reads them, where ``roundtrip`` rounds to
x's dtype), prefill chunks and decode alike, for a scattered block table.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

import kvzip_formats  # noqa: E402
from kvzip_formats.ops import PagedLayout  # noqa: E402
from kvzip_vllm.backend import KvzipAttentionImpl, KvzipAttentionMetadata  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))


class _Int4WithSink(type(kvzip_formats.get_format("int4"))):
    """int4 plus one bf16 sink token, declared the way the compact formats declare theirs."""

    spec = SimpleNamespace(sink_tokens=1)


def _impl(fmt, heads, kv_heads, d, block_size):
    impl = object.__new__(KvzipAttentionImpl)
    impl.num_heads, impl.head_size, impl.num_kv_heads = heads, d, kv_heads
    impl.scale = 1 / math.sqrt(d)
    impl.fmt, impl.block_size = fmt, block_size
    impl.layouts = {kind: PagedLayout.of(fmt, d, block_size, kind) for kind in "kv"}
    impl.sink_tokens = int(fmt.sink_tokens)
    impl._sinks, impl._layer_index, impl._no_kernels = None, {}, None
    return impl


def _reference(fmt, q, k, v, scale):
    d = k.shape[-1]
    kr = fmt.decode(fmt.encode(k, kind="k", layer=3), kind="k", layer=3, head_dim=d)
    vr = fmt.decode(fmt.encode(v, kind="v", layer=3), kind="v", layer=3, head_dim=d)
    sinks = int(fmt.sink_tokens)
    kr[:sinks], vr[:sinks] = k[:sinks].float(), v[:sinks].float()
    g = q.shape[1] // k.shape[1]
    kr, vr = kr.repeat_interleave(g, 1), vr.repeat_interleave(g, 1)
    n, t = k.shape[0], q.shape[0]
    s = torch.einsum("qhd,khd->hqk", q.float(), kr) * scale
    mask = torch.arange(n)[None, :] > torch.arange(n - t, n)[:, None]
    s.masked_fill_(mask[None], -math.inf)
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vr)


def _compact(name):
    from calibration_cache import calibration

    return kvzip_formats.get_format(name, calibration=calibration(name))


@pytest.mark.parametrize(
    ("fmt", "heads", "kv_heads", "d"),
    [
        (kvzip_formats.get_format("int4"), 9, 3, 64),
        (kvzip_formats.get_format("int4"), 4, 1, 128),
        (_Int4WithSink(), 9, 3, 64),
        (_Int4WithSink(), 4, 1, 128),
        # compact formats, calibrated for the embedded model (3 KV heads, d 64): 3.5bit's K and V
        # rows differ in size, all three keep a bf16 sink token
        ("4bit", 9, 3, 64),
        ("3.5bit", 9, 3, 64),
    ],
    ids=["int4-d64", "int4-d128", "int4+sink-d64", "int4+sink-d128", "4bit", "3.5bit"],
)
def test_paged_prefill_then_decode_matches_roundtrip_attention(fmt, heads, kv_heads, d):
    if isinstance(fmt, str):
        fmt = _compact(fmt)
    torch.manual_seed(0)
    bs, nblocks, n_prefill = 16, 12, 37  # 3 blocks, the last one partial
    layer = SimpleNamespace(layer_name="model.layers.3.self_attn.attn")
    impl = _impl(fmt, heads, kv_heads, d, bs)
    tbh = sum(lay.token_head_bytes for lay in impl.layouts.values())
    cache = torch.zeros(nblocks, kv_heads, bs, tbh, dtype=torch.uint8)
    table = torch.tensor([[7, 2, 9, 4]])
    total = n_prefill + 1
    k = torch.randn(total, kv_heads, d).to(torch.bfloat16)
    v = torch.randn(total, kv_heads, d).to(torch.bfloat16)
    q = torch.randn(total, heads, d).to(torch.bfloat16)
    slots = table[0][torch.arange(total) // bs] * bs + torch.arange(total) % bs
    for lo, hi in ((0, 20), (20, n_prefill), (n_prefill, total)):  # 2 prefill chunks, 1 decode
        impl.do_kv_cache_update(layer, k[lo:hi], v[lo:hi], cache, slots[lo:hi])
        meta = KvzipAttentionMetadata(
            num_actual_tokens=hi - lo,
            max_query_len=hi - lo,
            max_seq_len=hi,
            query_start_loc_cpu=torch.tensor([0, hi - lo]),
            seq_lens_cpu=torch.tensor([hi]),
            seq_lens=torch.tensor([hi]),
            block_table=table,
            slot_mapping=slots[lo:hi],
        )
        out = torch.zeros(hi - lo, heads, d, dtype=torch.float32)
        impl.forward(layer, q[lo:hi], k[lo:hi], v[lo:hi], cache, meta, out)
        want = _reference(fmt, q[lo:hi], k[:hi], v[:hi], impl.scale)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
