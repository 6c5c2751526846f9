"""The split-KV merge: one compiled kernel for every split count.

The merge combines each row's splits by their base-2 log-sum-exps. It reads them in fixed
chunks with a running maximum, so the split count is neither a block size nor specialised on,
and a server whose steps change their split count compiles it once. Checked against a float64
reference across split counts around the chunk width, with empty splits (lse = -inf) and
rows with no split at all.
"""

import os

import pytest
import torch

from kvzip_kernels._decode_kernels import _merge_kernel


def _case(rows, splits, d, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(rows, splits, d, generator=g)
    lse = torch.randn(rows, splits, generator=g) * 8
    lse[torch.rand(rows, splits, generator=g) < 0.3] = float("-inf")  # empty splits
    for r in range(2, rows):  # each later row keeps at least one live split
        lse[r, r % splits] = float(r)
    lse[0] = float("-inf")  # a row without any split (the merge's division guards it)
    lse[1, :] = float("-inf")
    lse[1, splits - 1] = 3.0  # one live split, the last one
    return o.to(device), lse.to(device)


def _reference(o, lse):
    lse, o = lse.double().cpu(), o.double().cpu()
    w = torch.exp2(lse - lse.max(1, keepdim=True).values.clamp(min=-1e300))
    w = torch.where(torch.isinf(lse), torch.zeros_like(w), w)
    den = w.sum(1, keepdim=True)
    return (w[..., None] * o).sum(1) / den


def _merge(o, lse, out_bf16=False):
    rows, splits, d = o.shape
    out = torch.empty(rows, d, dtype=torch.bfloat16 if out_bf16 else torch.float32,
                      device=o.device)  # fmt: skip
    _merge_kernel[(rows,)](
        o.contiguous(), lse.contiguous(), out, splits, CH=16, D=d, OUT_BF16=out_bf16,
        INTERPRET=os.environ.get("TRITON_INTERPRET") == "1", num_warps=4,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("splits", [1, 2, 15, 16, 17, 33, 100])
def test_merge_matches_reference_across_split_counts(splits, device):
    o, lse = _case(6, splits, 64, device, seed=splits)
    got = _merge(o, lse).double().cpu()
    want = _reference(o, lse)
    live = ~torch.isnan(want).any(1)  # row 0 has no split: 0 / 0 in the reference
    assert live[1:].all()
    torch.testing.assert_close(got[live], want[live], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles for a CUDA device")
def test_merge_compiles_once_for_every_split_count():
    """The kernel compiled for one split count serves the others (vLLM's JIT monitor counts
    a compilation during serving as a latency spike)."""
    dev = torch.device("cuda")
    _merge(*_case(4, 3, 128, dev))

    def compiled():
        return sum(len(c[0]) for c in _merge_kernel.device_caches.values())

    before = compiled()
    for splits in (1, 5, 16, 17, 64, 200, 513):
        o, lse = _case(4, splits, 128, dev, seed=splits)
        torch.testing.assert_close(
            _merge(o, lse).double().cpu()[1:], _reference(o, lse)[1:], rtol=1e-5, atol=1e-5
        )
    assert compiled() == before
