"""Row layout of the compact formats: bit planes, offsets from the spec, packing round trip."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvzip_formats.base import FormatError
from kvzip_formats.compact.layout import RowLayout


def test_spec_table_offsets_d128():
    # spec/4bit.md section 5 and spec/3.5bit.md, 3bit.md: (offset, bytes, width, shift, start)
    lay = RowLayout(((64, 4), (64, 3)))
    got = [(p.offset, p.nbytes, p.width, p.shift, p.start) for p in lay.planes]
    assert got == [(0, 32, 4, 0, 0), (32, 16, 2, 0, 64), (48, 8, 1, 2, 64)]
    assert (lay.code_bytes, lay.row_bytes) == (56, 58)
    lay3 = RowLayout(((128, 3),))
    assert [(p.offset, p.nbytes, p.width, p.shift) for p in lay3.planes] == [
        (0, 32, 2, 0),
        (32, 16, 1, 2),
    ]
    lay5 = RowLayout(((128, 5),))
    assert [(p.offset, p.nbytes, p.width, p.shift) for p in lay5.planes] == [
        (0, 64, 4, 0),
        (64, 16, 1, 4),
    ]


def test_nibble_order_matches_int4():
    lay = RowLayout(((16, 4),))
    codes = torch.arange(16)
    packed = lay.pack(codes)
    assert packed.tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]


def test_three_bit_planes_by_hand():
    lay = RowLayout(((8, 3),))
    codes = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    # low 2 bits: 0,1,2,3,0,1,2,3 -> bytes 0b11100100 twice; bit 2: channels 4..7 -> 0xF0
    assert lay.pack(codes).tolist() == [0xE4, 0xE4, 0xF0]


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(
        st.tuples(st.sampled_from([8, 16, 32, 64]), st.integers(1, 7)), min_size=1, max_size=3
    ),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_unpack_roundtrip(groups, seed):
    lay = RowLayout(tuple(groups))
    g = torch.Generator().manual_seed(seed)
    hi = lay.channel_bits()
    codes = (torch.rand(5, 2, lay.head_dim, generator=g) * (2.0**hi)).long()
    packed = lay.pack(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 2, lay.code_bytes)
    assert lay.code_bytes * 8 == int(hi.sum())
    assert torch.equal(lay.unpack(packed), codes)


@pytest.mark.parametrize("groups", [((12, 4),), ((16, 0),), ((16, 8),)])
def test_bad_groups_rejected(groups):
    with pytest.raises(FormatError, match="group"):
        RowLayout(groups)
