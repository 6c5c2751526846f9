"""CPU checks of design v6 of the CUDA split kernel (csrc/paged_decode.cu, NOTES.md "v6"),
whose compiled code only a GPU runs (test_cuda_decode.py's gpu tests):

- its index builders (3bit's K 3-bit indices of a row at once, the 3-bit V indices of 4 tokens
  in one word, bytes by PTX ``prmt``) give, bit for bit, the indices of the format's bit
  planes built one by one (as design v5 did, git history), on random words for every lane's
  shifts;
- the expressions of the numpy model (benchmarks/cuda_model.py) are the kernel source's;
- the model of v6's per-lane fragment logic (two 16-token units per warp tile sharing one
  online-softmax update), run through ``paged_decode`` in place of the kernel, matches the
  float32 reference within the earned tolerance of the GPU tests.
"""

import random
import sys
from pathlib import Path

import pytest
import torch
from test_paged_decode import _rel, make_case

import kvzip_kernels._cuda as C
from kvzip_formats.ops import paged_decode as ref_paged_decode
from kvzip_kernels import DecodeConfig, paged_decode

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def model():
    sys.path.insert(0, str(BENCH))
    split, choose = C.split, C.choose
    try:
        import cuda_model  # replaces C.split / C.choose at import: restored below
    finally:
        C.split, C.choose = split, choose
        sys.path.remove(str(BENCH))
    return cuda_model


def test_prmt_model(model):
    """The model's prmt is PTX's default mode (byte select, bit 3: sign replicate)."""
    assert model.prmt(0x44332211, 0x88776655, 0x3210) == 0x44332211
    assert model.prmt(0x44332211, 0x88776655, 0x7654) == 0x88776655
    assert model.prmt(0x44332211, 0x00000080, 0x0C04) == 0x11FF1180
    assert [model.byte_of(0xDDCCBBAA, k) for k in range(4)] == [0xAA, 0xBB, 0xCC, 0xDD]


def test_v6_indices_are_v5s(model):
    rng = random.Random(0)
    for _ in range(3000):
        lo, hi = rng.getrandbits(32), rng.getrandbits(16)
        x0, x1 = model.k3_indices(lo, hi)
        for kk in range(4):  # v5's KRow::pairs, k-step KS4 + kk
            L, H = lo >> (8 * kk), hi >> (4 * kk)
            assert model.byte_of(x0, kk) == (L & 0xF) | ((H & 3) << 4)
            assert model.byte_of(x1, kk) == ((L >> 4) & 0xF) | ((H & 0xC) << 2)
        W, H = rng.getrandbits(32), rng.getrandbits(32)
        for g in range(8):  # v5's v_frag: 16-bit halves w0 = W & 0xFFFF, w1 = W >> 16
            sl, sh = 4 * (g & 1), 2 * (g & 3)
            X = ((W >> sl) & 0x0F0F0F0F) + (((H >> sh) & 0x03030303) << 4)
            for half, (w, h) in enumerate(((W & 0xFFFF, H & 0xFFFF), (W >> 16, H >> 16))):
                x = ((w >> sl) & 0x0F0F) | (((h >> sh) & 0x0303) << 4)
                assert model.byte_of(X, 2 * half) == x & 0xFF
                assert model.byte_of(X, 2 * half + 1) == x >> 8


def test_model_expressions_are_the_kernels(model):
    """The model transcribes these lines of the kernel; a change to one needs the other."""
    src = C._SRC.read_text()
    for line in (
        "return prmt(w, 0u, 0x4440u | (uint32_t)k);",
        "const uint32_t t = prmt(hi, 0u, 0x1100u);",
        "const uint32_t hs = (t & 0x000F000Fu) | ((t >> 4) & 0x0F000F00u);",
        "x0 = (lo & 0x0F0F0F0Fu) + ((hs & 0x03030303u) << 4);",
        "x1 = ((lo >> 4) & 0x0F0F0F0Fu) + ((hs & 0x0C0C0C0Cu) << 2);",
        "X = ((W >> sl) & 0x0F0F0F0Fu) + (((H >> sh) & 0x03030303u) << 4);",
        "X = (*reinterpret_cast<const uint32_t*>(vrow + j * ST) >> sl) & 0x0F0F0F0Fu;",
        "const int u = first + 2 * n * NW + hf;",
        "const int first = tile_lo + 2 * warp;",
    ):
        assert line in src, line


@pytest.mark.parametrize("name", ["int4", "4bit", "3.5bit", "3bit"])
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "ps", "lens", "splits"),
    [(4, 1, 64, 16, [37, 5], 2), (8, 1, 128, 64, [130], 2), (8, 2, 128, 16, [100, 1], 3)],
)
def test_v6_model_matches_reference(model, monkeypatch, name, hq, hkv, d, ps, lens, splits):
    """Odd and even unit counts per split, partial last units, a one-token sequence, pages of
    16 and 64 tokens, head_dim 64 and 128: v6's lanes compute the reference's attention."""
    monkeypatch.setattr(C, "split", model.fake_split)
    monkeypatch.setattr(
        C,
        "choose",
        lambda backend, n, spec, g, dev: "cuda" if model._supported(n, spec, g) else "triton",
    )
    (fmt, q, kc, vc, bt, sl), dev = make_case(name, hq, hkv, d, ps, lens, 1, "cpu")
    ref = ref_paged_decode(fmt, q, kc, vc, bt, sl, block_size=ps)
    plain = ref_paged_decode(fmt, q, kc, vc, bt, sl, block_size=ps, compute_dtype=torch.bfloat16)
    monkeypatch.setattr(model, "VARIANT", "v6")
    cfg = DecodeConfig(block_n=16, num_splits=splits)
    out = paged_decode(fmt, *dev, block_size=ps, config=cfg)
    err, tol = _rel(out, ref), 2 * _rel(plain, ref) + 1e-3
    assert err <= tol, f"{name}: v6 model relative L2 error {err:.2e} > {tol:.2e}"
