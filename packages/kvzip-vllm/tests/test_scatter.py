"""core.scatter: one masked launch writes a load's decoded blocks into every layer's cache, as
the torch scatter of core.pages does, and leaves a damaged chunk's blocks untouched. CPU twin
under TRITON_INTERPRET=1 (conftest.py); the CUDA case is marked gpu."""

from __future__ import annotations

import pytest
import torch
from test_cuda_pipeline import DEVICES, paged_caches

from kvzip_vllm.core import scatter
from kvzip_vllm.core.pages import Bf16Pages

pytest.importorskip("triton")


def bits(t):
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLNHC"])
def test_masked_scatter_equals_the_torch_scatter_of_good_chunks(device, layout):
    layers, heads, n, d, blocks, bpc = 3, 2, 4, 8, 16, 2
    _, caches = paged_caches(layers, heads, n, d, device, layout, blocks=blocks)
    g = torch.Generator().manual_seed(0)
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=g).to(torch.bfloat16))
    before = [c.clone() for c in caches]
    chunks = 3  # chunk 1 damaged; chunk 2 skips its first block
    out = torch.randn((2 * layers, chunks * bpc, n, heads, d), generator=g).to(torch.bfloat16)
    out = out.to(device)
    dest = {0: (5, 9), 1: (2, 3), 2: (14, 7)}
    skip = {0: 0, 1: 0, 2: 1}
    plan = [(j * bpc + i, dest[j][i], j) for j in range(chunks) for i in range(skip[j], bpc)]
    plan_t = torch.tensor(plan, dtype=torch.int64).T.contiguous().to(device)
    flags = torch.tensor([0, 3, 0], dtype=torch.int32, device=device)
    scatter.masked_scatter(out, caches, scatter.layer_pointers(caches), plan_t, flags)

    want = [c.clone() for c in before]
    pages = Bf16Pages.of(want[0])
    rows = [r for r, _, j in plan if j != 1]
    ids = [b for _, b, j in plan if j != 1]
    for layer, c in enumerate(want):
        pages.scatter(c, ids, out[2 * layer, rows], out[2 * layer + 1, rows])
    for layer, (got, ref) in enumerate(zip(caches, want, strict=True)):
        assert torch.equal(bits(got), bits(ref)), f"layer {layer}"
    for b in (2, 3, 14):  # the damaged chunk's blocks and the skipped block: untouched
        assert all(torch.equal(bits(c[b]), bits(o[b])) for c, o in zip(caches, before, strict=True))


@pytest.mark.parametrize("device", DEVICES)
def test_warm_up_writes_nothing(device):
    _, caches = paged_caches(3, 2, 4, 8, device, "LBNHC", blocks=6)
    g = torch.Generator().manual_seed(1)
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=g).to(torch.bfloat16))
    before = [c.clone() for c in caches]
    scatter.warm_up(caches, scatter.layer_pointers(caches))
    assert all(torch.equal(bits(c), bits(b)) for c, b in zip(caches, before, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles for a CUDA device")
def test_after_the_warm_up_no_row_count_compiles_again():
    """vLLM's JIT monitor counts a compilation during serving as a latency spike: the kernel
    the warm-up compiled serves every restore's row count."""
    layers, heads, n, d, blocks = 2, 2, 16, 128, 64
    _, caches = paged_caches(layers, heads, n, d, "cuda", "LBNHC", blocks=blocks)
    bases = scatter.layer_pointers(caches)
    scatter.warm_up(caches, bases)

    def compiled():
        return sum(len(c[0]) for c in scatter._masked_scatter_kernel.device_caches.values())

    before = compiled()
    for rows in (1, 5, 16, 17, 48):
        out = torch.zeros((2 * layers, rows, n, heads, d), dtype=torch.bfloat16, device="cuda")
        plan = torch.stack(
            [torch.arange(rows), torch.arange(rows), torch.zeros(rows, dtype=torch.long)]
        )
        flags = torch.zeros(1, dtype=torch.int32, device="cuda")
        scatter.masked_scatter(out, caches, bases, plan.cuda().contiguous(), flags)
    torch.cuda.synchronize()
    assert compiled() == before


def test_masked_scatter_refuses_a_mismatched_buffer():
    _, caches = paged_caches(2, 2, 4, 8, "cpu", "LBNHC", blocks=4)
    out = torch.zeros((3, 1, 4, 2, 8), dtype=torch.bfloat16)  # 3 slots for 2 layers
    plan = torch.zeros((3, 1), dtype=torch.int64)
    with pytest.raises(ValueError, match=r"expected contiguous bf16 \[4, rows"):
        scatter.masked_scatter(out, caches, scatter.layer_pointers(caches), plan, plan[0])


def test_supported_names_what_it_cannot_write():
    _, caches = paged_caches(2, 2, 4, 8, "cpu", "LBNHC", blocks=4)
    assert scatter.supported(caches) is None
    other = torch.zeros((4, 2, 4, 16), dtype=torch.bfloat16)  # contiguous: other strides
    assert "differ" in scatter.supported([caches[0], other])
    assert "dtype" in scatter.supported([caches[0].to(torch.float16)])
