"""Reference paged cache-write: the byte layout of spec/paged_layout.md, exactly."""

import pytest
import torch

from kvzip_formats import FormatError, get_format
from kvzip_formats.ops import PagedLayout, cache_write, gather_rows, new_paged_cache


@pytest.mark.parametrize("name", ["int4", "fp8", "bf16"])
@pytest.mark.parametrize("block_size", [16, 64])
def test_bytes_land_where_the_spec_says(name, block_size):
    fmt = get_format(name)
    g = torch.Generator().manual_seed(block_size)
    n, heads, d = 21, 3, 64
    x = torch.randn(n, heads, d, generator=g)
    slots = torch.randperm(3 * block_size, generator=g)[:n]
    for kind in ("k", "v"):
        cache = new_paged_cache(fmt, 3, heads, block_size, d)
        cache_write(fmt, x, cache, slots, kind=kind, block_size=block_size)
        rows = fmt.encode(x, kind=kind, layer=0)
        lay = PagedLayout.of(fmt, d, block_size)
        cb, mb = lay.code_bytes, lay.meta_bytes
        for i, slot in enumerate(slots.tolist()):
            blk, t = divmod(slot, block_size)
            for h in range(heads):
                page = cache[blk, h]
                if kind == "k":  # token-major codes
                    codes = page[t * cb : (t + 1) * cb]
                else:  # channel-major codes: byte j of token t at j * block_size + t
                    codes = page[t : block_size * cb : block_size]
                meta = page[block_size * cb + t * mb : block_size * cb + (t + 1) * mb]
                assert torch.equal(torch.cat((codes, meta)), rows[i, h]), (kind, i, h)
        # gather_rows reads the same rows back in token order through a block table
        order = torch.argsort(slots)
        bt = torch.arange(3, dtype=torch.int32)
        got = gather_rows(cache, lay, bt, 3 * block_size, kind)[slots[order]]
        assert torch.equal(got, rows[order])


def test_skip_slots_and_untouched_bytes():
    fmt = get_format("int4")
    cache = new_paged_cache(fmt, 2, 1, 16, 64)
    cache.fill_(0xAB)
    x = torch.randn(3, 1, 64)
    cache_write(fmt, x, cache, torch.tensor([-1, 5, -1]), kind="k", block_size=16)
    lay = PagedLayout.of(fmt, 64, 16)
    changed = (cache != 0xAB).nonzero()[:, 2]
    assert set(changed.tolist()) <= set(range(5 * 32, 6 * 32)) | set(
        range(16 * 32 + 20, 16 * 32 + 24)
    )
    assert lay.page_bytes == 16 * 36


def test_rejects_bad_input():
    fmt = get_format("int4")
    cache = new_paged_cache(fmt, 2, 2, 16, 64)
    x = torch.randn(3, 2, 64)
    with pytest.raises(FormatError, match="slot_mapping holds slot 32"):
        cache_write(fmt, x, cache, torch.tensor([0, 1, 32]), kind="k", block_size=16)
    with pytest.raises(FormatError, match="int32 or int64"):
        cache_write(fmt, x, cache, torch.tensor([0.0, 1.0, 2.0]), kind="k", block_size=16)
    with pytest.raises(FormatError, match=r"\[num_tokens\] = \[3\]"):
        cache_write(fmt, x, cache, torch.tensor([0, 1]), kind="k", block_size=16)
    with pytest.raises(FormatError, match=">= -1"):
        cache_write(fmt, x, cache, torch.tensor([0, 1, -2]), kind="k", block_size=16)
    with pytest.raises(FormatError, match="block_size must be one of"):
        cache_write(fmt, x, cache, torch.tensor([0, 1, 2]), kind="k", block_size=8)
    with pytest.raises(FormatError, match="must have shape"):
        cache_write(fmt, x, cache[..., :-2], torch.tensor([0, 1, 2]), kind="k", block_size=16)
    with pytest.raises(FormatError, match="contiguous"):
        cache_write(
            fmt,
            x,
            cache.transpose(0, 1).contiguous().transpose(0, 1),
            torch.tensor([0, 1, 2]),
            kind="k",
            block_size=16,
        )
