"""Reference paged decode attention against a dense attention on the decoded K/V."""

import math

import pytest
import torch

from kvzip_formats import FormatError, get_format
from kvzip_formats.ops import cache_write, new_paged_cache, paged_decode


@pytest.mark.parametrize("name", ["int4", "fp8", "bf16"])
def test_matches_dense_attention(name):
    fmt = get_format(name)
    g = torch.Generator().manual_seed(1)
    hq, hkv, d, ps = 6, 2, 64, 16
    lens = [37, 16]
    bt = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    kc, vc = new_paged_cache(fmt, 6, hkv, ps, d), new_paged_cache(fmt, 6, hkv, ps, d)
    dense = []
    for i, n in enumerate(lens):
        k, v = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
        tok = torch.arange(n)
        slots = bt[i, tok // ps].long() * ps + tok % ps
        cache_write(fmt, k, kc, slots, kind="k", block_size=ps)
        cache_write(fmt, v, vc, slots, kind="v", block_size=ps)
        dense.append(
            (
                fmt.decode(fmt.encode(k, kind="k", layer=0), kind="k", layer=0, head_dim=d),
                fmt.decode(fmt.encode(v, kind="v", layer=0), kind="v", layer=0, head_dim=d),
            )
        )
    q = torch.randn(2, hq, d, generator=g).bfloat16()
    out = paged_decode(fmt, q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32), block_size=ps)
    for i, (k, v) in enumerate(dense):
        k, v = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[i].float(), k) / math.sqrt(d), -1)
        assert torch.allclose(out[i], torch.einsum("hn,nhd->hd", p, v), atol=1e-5, rtol=1e-5)
    plain = paged_decode(
        fmt,
        q,
        kc,
        vc,
        bt,
        torch.tensor(lens, dtype=torch.int32),
        block_size=ps,
        compute_dtype=torch.bfloat16,
    )
    err = ((plain.float() - out).norm() / out.norm()).item()
    assert plain.dtype == torch.bfloat16 and 1e-4 < err < 3e-2  # bf16 math: a real, small error


def test_rejects_bad_input():
    fmt = get_format("int4")
    kc = new_paged_cache(fmt, 2, 2, 16, 64)
    q = torch.randn(1, 4, 64).bfloat16()
    bt = torch.zeros(1, 2, dtype=torch.int32)
    sl = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(FormatError, match="not a multiple"):
        paged_decode(fmt, q[:, :3], kc, kc, bt, sl, block_size=16)
    with pytest.raises(FormatError, match="block_table must be int32"):
        paged_decode(fmt, q, kc, kc, bt.long(), sl, block_size=16)
    with pytest.raises(FormatError, match="k_cache must have shape"):
        paged_decode(fmt, q[..., :32], kc, kc, bt, sl, block_size=16)
    with pytest.raises(FormatError, match="at least one token"):
        paged_decode(fmt, q, kc, kc, bt, sl * 0, block_size=16)
