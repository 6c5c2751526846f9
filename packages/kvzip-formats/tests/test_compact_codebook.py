"""The frozen codebooks equal Lloyd-Max levels for N(0, 1), rounded to float16."""

import numpy as np
import pytest
import torch

from kvzip_formats.compact import codebook
from kvzip_formats.lloyd_max import gaussian_codebook


@pytest.mark.parametrize("bits", sorted(codebook.POSITIVE_LEVELS))
def test_frozen_levels_are_fp16_lloyd_max(bits):
    want = torch.tensor(gaussian_codebook(bits).astype(np.float16)).float()
    assert torch.equal(codebook.levels(bits), want)
    lv = codebook.levels(bits)
    assert torch.equal(lv, -lv.flip(0)) and (lv.diff() > 0).all()
    # thresholds are exact midpoints (sum of two fp16 values is exact in fp32)
    assert torch.equal(codebook.edges(bits).double(), (lv[1:].double() + lv[:-1].double()) / 2)


def test_unknown_bits():
    with pytest.raises(ValueError, match="codebook"):
        codebook.levels(9)
