"""CPU checks of the CUDA split kernels' lane logic (csrc/paged_decode.cu), whose compiled code
only a GPU runs (test_cuda_decode.py's gpu tests): the numpy model of cuda_lane_model.py, run
through ``paged_decode`` in place of the kernel, for the shipped design v6 and the research
design v7 (``split_v7``: 64-token softmax tiles of two v6 pairs, 2 or 4 ring slots refilled
after each slot's PV, predicated copies with 32 x 32 -> 64-bit block offsets, NOTES.md "v7").

- v6, v7 and v7s4 give the float32 reference's answer within the GPU tests' earned tolerance
  for int4, 4bit, 3.5bit, 3bit at head_dim 64 and 128, pages of 16 and 64 tokens, one and two
  splits, odd pair counts per warp (a last 64-token tile with one pair), more than 32 pairs per
  warp (the block-id refill), sinks and the residual window;
- v7 is v6 bit for bit where each warp has at most one pair (the same arithmetic), and within
  the tolerance elsewhere;
- v7's copies are v6's (same bytes to the same shared addresses, block ids past 2^31 / stride
  included);
- the model sees schedule bugs: each perturbation of v7's ring (a slot refilled before its PV
  or a tile early, a wait one group short, no block-id refill) fails the tolerance.
"""

import random
from collections import Counter

import cuda_lane_model as M
import numpy as np
import pytest
import torch
from test_paged_decode import _rel, make_case

import kvzip_kernels._cuda as C
from kvzip_formats.ops import paged_decode as ref_paged_decode
from kvzip_kernels import DecodeConfig, paged_decode

FORMATS = ["int4", "4bit", "3.5bit", "3bit"]
VARIANTS = ["v6", "v7", "v7s4"]


@pytest.fixture
def model(monkeypatch):
    monkeypatch.setattr(C, "split", M.fake_split)
    monkeypatch.setattr(C, "choose", M.fake_choose)
    monkeypatch.setattr(M, "MUTATION", None)
    return M


def _case(name, hq, hkv, d, ps, lens, sinks=False, recent=0, seed=1):
    (fmt, q, kc, vc, bt, sl), dev = make_case(name, hq, hkv, d, ps, lens, seed, "cpu")
    g = torch.Generator().manual_seed(9)
    kw = {}
    if sinks:
        kw["sinks"] = tuple(
            (torch.randn(len(lens), 1, hkv, d, generator=g) * 2).bfloat16() for _ in range(2)
        )
    if recent:
        kw["recent"] = tuple(
            (torch.randn(len(lens), recent, hkv, d, generator=g) * 2).bfloat16() for _ in range(2)
        )
    ref = ref_paged_decode(fmt, q, kc, vc, bt, sl, block_size=ps, **kw)
    plain = ref_paged_decode(fmt, q, kc, vc, bt, sl, block_size=ps, compute_dtype=torch.bfloat16,
                             **kw)  # fmt: skip
    return fmt, dev, kw, ref, 2 * _rel(plain, ref) + 1e-3


def _run(fmt, dev, kw, ps, splits, variant):
    cfg = DecodeConfig(block_n=16, num_splits=splits, cuda_variant=variant)
    return paged_decode(fmt, *dev, block_size=ps, config=cfg, **kw)


# (hq, hkv, d, page size, lens, splits, sinks and a window of 128): per split, warp w's pairs
# are units tile_lo + 2w + 8m and the next (4 warps)
CASES = {
    # two splits of 2 units and one of 1 (a 5-token sequence): one pair per warp at most
    "d64-p16-two-splits": (4, 1, 64, 16, [37, 5], 2, False),
    # 9 units of 64-token pages in one split: warp 0 a whole 64-token tile, warps 1-3 one pair
    "d128-p64-one-split": (8, 1, 128, 64, [130], 1, False),
    # 25 units: warp 0 four pairs (the last with one unit), warps 1-3 three (a last tile of
    # one pair)
    "d128-p16-odd-pairs": (8, 2, 128, 16, [16 * 8 * 3 + 7], 1, False),
    # 268 units per split, two splits: 34 pairs for warp 0 (block ids refilled at pair 32)
    "d64-p16-34-pairs": (4, 1, 64, 16, [2 * 4288 - 20], 2, False),
    "d128-p64-33-pairs": (8, 1, 128, 64, [4224 + 16 * 5], 1, False),
    # sink position skipped, the window cut off (odd unit counts), a one-token sequence
    "d128-sinks-window": (8, 2, 128, 16, [300, 100, 1], 2, True),
    "d64-sinks": (9, 3, 64, 16, [37, 1], 2, True),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("case", list(CASES))
def test_model_matches_reference(model, variant, name, case):
    hq, hkv, d, ps, lens, splits, extra = CASES[case]
    if extra and name == "int4":
        pytest.skip("sinks and the window are the compact formats'")
    fmt, dev, kw, ref, tol = _case(name, hq, hkv, d, ps, lens, sinks=extra,
                                   recent=128 if extra and d == 128 else 0)  # fmt: skip
    out = _run(fmt, dev, kw, ps, splits, variant)
    err = _rel(out, ref)
    assert err <= tol, f"{name} {variant} {case}: relative L2 error {err:.2e} > {tol:.2e}"


def _parts(model, monkeypatch, name, case, variant):
    """The split stage's partial outputs and log-sum-exps of the model for ``variant``."""
    hq, hkv, d, ps, lens, splits, _ = CASES[case]
    got = {}

    def capture(*a, **kw):
        M.fake_split(*a, **kw)
        got["o"], got["lse"] = a[8].clone(), a[9].clone()

    monkeypatch.setattr(C, "split", capture)
    fmt, dev, kw, ref, tol = _case(name, hq, hkv, d, ps, lens)
    out = _run(fmt, dev, kw, ps, splits, variant)
    return got["o"], got["lse"], out, tol


@pytest.mark.parametrize("name", FORMATS)
def test_v7_is_v6_with_one_pair_per_warp(model, monkeypatch, name):
    """With at most one pair per warp a v7 tile is v6's tile and an absent pair (-inf scores,
    no PV): the same arithmetic, so the same bits."""
    o6, l6, _, _ = _parts(model, monkeypatch, name, "d64-p16-two-splits", "v6")
    for v in ("v7", "v7s4"):
        o7, l7, _, _ = _parts(model, monkeypatch, name, "d64-p16-two-splits", v)
        assert torch.equal(o7, o6) and torch.equal(l7, l6), v


@pytest.mark.parametrize("name", FORMATS)
def test_v7_near_v6_with_many_pairs(model, monkeypatch, name):
    """Several pairs per warp: v7's P is rounded against a running maximum over 64 tokens, v6's
    over 32; the outputs agree within the tolerance (and are not all equal: the tiles differ)."""
    _, _, out6, tol = _parts(model, monkeypatch, name, "d128-p16-odd-pairs", "v6")
    for v in ("v7", "v7s4"):
        _, _, out7, _ = _parts(model, monkeypatch, name, "d128-p16-odd-pairs", v)
        assert _rel(out7, out6.float()) <= tol, v


@pytest.mark.parametrize("variant", ["v7", "v7s4"])
def test_block_strided_caches(model, variant):
    """K and V as views into one allocation with a padded block stride (vLLM's layout): the
    model's answer is the contiguous caches', bit for bit."""
    (fmt, *_), (q, kc, vc, bt, sl) = make_case("4bit", 8, 2, 128, 16, [300], 0, "cpu")
    nb, hkv, kp = kc.shape
    vp = vc.shape[2]
    stride = hkv * (kp + vp) + 16
    buf = torch.zeros(nb, stride, dtype=torch.uint8)
    buf[:, : hkv * kp] = kc.reshape(nb, -1)
    buf[:, hkv * kp : hkv * (kp + vp)] = vc.reshape(nb, -1)
    k = buf.as_strided((nb, hkv, kp), (stride, kp, 1))
    v = buf.as_strided((nb, hkv, vp), (stride, vp, 1), storage_offset=hkv * kp)
    cfg = DecodeConfig(block_n=16, num_splits=2, cuda_variant=variant)
    want = paged_decode(fmt, q, kc, vc, bt, sl, block_size=16, config=cfg)
    got = paged_decode(fmt, q, k, v, bt, sl, block_size=16, block_stride=stride, config=cfg)
    assert torch.equal(got, want)


class _Recorder(M.Cta):
    """A CTA whose global reads are zeros at any address, each copy recorded."""

    def __init__(self, *a):
        super().__init__(*a)
        self.copies = Counter()

    def gread(self, addr, n):
        return np.zeros(n, dtype=np.uint8)

    def cp_async16(self, w, s, gmem, pred):
        s, gmem = np.broadcast_to(s, (32,)), np.broadcast_to(gmem, (32,))
        for lane in np.flatnonzero(np.broadcast_to(pred, (32,))):
            self.copies[w, int(s[lane]), int(gmem[lane])] += 1
        super().cp_async16(w, s, gmem, pred)


@pytest.mark.parametrize("S", [2, 4])
@pytest.mark.parametrize("FMT", [0, 1, 3])
def test_v7_copies_are_v6s(FMT, S):
    """v7's predicated copies with 32 x 32 -> 64-bit block offsets move the bytes v6's 64-bit
    offsets move, to the same shared addresses: block ids near 2^20 times strides of ~2^17 (the
    products pass 2^31, so 32-bit products would wrap), an odd unit count, a split not at 0,
    34 pairs for warp 0 in either split (the block-id refill)."""
    D, PS, NW = 64, 16, 4
    stride_k, stride_v = (1 << 17) + 48, (1 << 17) + 96
    nblk = 2 * 272 + 3
    bt = np.array(random.Random(0).sample(range(1 << 20, (1 << 20) + 4096), nblk), dtype=np.int32)
    assert int(bt.max()) * stride_k >= 1 << 31
    assert M.i32(int(bt.max()) * stride_k) != int(bt.max()) * stride_k
    P = dict(sl=np.array([nblk * PS - 9]), bt=bt, stride_btb=nblk, G=8, kflat=np.zeros(16),
             vflat=np.zeros(16), qk_scale=0.1, k_page_bytes=8192, v_page_bytes=4096,
             k_blk_stride=stride_k, v_blk_stride=stride_v, PS=PS, ps_log2=4,
             tokens_per_split=PS * 272, skip=3)  # fmt: skip
    lv = np.arange(64, dtype=np.int64) | 0x3C00
    T = None if FMT == 0 else M.RepLut(FMT, lv)
    qbits = np.full((8, D), 0x3C00, dtype=np.int64)
    for split in (0, 1):
        got = {}
        for design, prog in ((6, M.split_v6), (7, M.split_v7)):
            k = M.Kernel(FMT, D, NW, S, P, 0, 1, split)
            cta = _Recorder(k.F, NW, S, P["kflat"], P["vflat"], np.random.default_rng(0))
            with np.errstate(all="ignore"):
                for w in range(NW):
                    W = M.Warp(k.F, T, qbits, 8, np.ones(8), 0.1)
                    for _ in prog(k, cta, w, T, W):
                        pass
            got[design] = cta.copies
        assert got[6] == got[7] and len(got[6]) > 0
        assert max(c for c in got[7].values()) == 1  # no address copied twice


MUTATIONS = ["refill_before_pv", "refill_one_tile_early", "wait_one_less", "no_bid_refill"]


@pytest.mark.parametrize("variant", ["v7", "v7s4"])
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_perturbed_schedules_fail(model, monkeypatch, variant, mutation):
    """The model is sharp enough: with its ring refilled before a slot's PV, or a tile early
    (where v6 issued), with the second wait one group short, or without the block-id refill at
    pair 32, the answer is wrong (or not finite), where the kernel's schedule passes."""
    hq, hkv, d, ps, lens, splits, _ = CASES["d64-p16-34-pairs"]
    fmt, dev, kw, ref, tol = _case("4bit", hq, hkv, d, ps, lens)
    monkeypatch.setattr(M, "MUTATION", mutation)
    err = _rel(_run(fmt, dev, kw, ps, splits, variant), ref)
    assert not err <= tol, f"{mutation} {variant}: error {err:.2e} within {tol:.2e}"


def test_prmt_model():
    """The model's prmt is PTX's default mode (byte select, bit 3: sign replicate)."""
    assert M.prmt(0x44332211, 0x88776655, 0x3210) == 0x44332211
    assert M.prmt(0x44332211, 0x88776655, 0x7654) == 0x88776655
    assert M.prmt(0x44332211, 0x00000080, 0x0C04) == 0x11FF1180
    assert [int(M.byte_of(0xDDCCBBAA, k)) for k in range(4)] == [0xAA, 0xBB, 0xCC, 0xDD]


def test_index_builders_are_the_planes():
    """k3_indices and v_frag's word-wide 3-bit indices (PTX prmt) give, bit for bit, the indices
    of the format's bit planes built one by one (design v5's way, git history)."""
    rng = random.Random(0)
    for _ in range(2000):
        lo, hi = rng.getrandbits(32), rng.getrandbits(16)
        x0, x1 = M.k3_indices(lo, hi)
        for kk in range(4):
            L, H = lo >> (8 * kk), hi >> (4 * kk)
            assert M.byte_of(x0, kk) == (L & 0xF) | ((H & 3) << 4)
            assert M.byte_of(x1, kk) == ((L >> 4) & 0xF) | ((H & 0xC) << 2)
        W, H = rng.getrandbits(32), rng.getrandbits(32)
        for g in range(8):
            sl, sh = 4 * (g & 1), 2 * (g & 3)
            X = ((W >> sl) & 0x0F0F0F0F) + (((H >> sh) & 0x03030303) << 4)
            for tok in range(4):
                w, h = (W >> (8 * tok)) & 0xFF, (H >> (8 * tok)) & 0xFF
                assert M.byte_of(X, tok) == ((w >> sl) & 0xF) | (((h >> sh) & 3) << 4)


# kernel lines the model cites (cu:LINE in cuda_lane_model.py) and a piece of each: a change of
# the kernel moves or changes them, and the model must follow
CITED = {
    146: "int4_pairs(uint32_t x",
    172: "byte_of(uint32_t w, int k)",
    293: "k3_indices(uint32_t lo, uint32_t hi",
    303: "k_pairs(const KRow<FMT, D>& kr",
    321: "v_frag(const uint8_t* vrow",
    437: "void score(const KRow<FMT, D> kr[2]",
    493: "void softmax(float (*s)[4], float (*p)[4])",
    538: "void pv_unit(const float p[4]",
    731: "const int first = tile_lo + 2 * warp;",
    756: "const uint8_t* kp = ksrc + blk * P.k_blk_stride + toff * F::KCB;",
    784: "cp_async_wait<S - 2>();",
    787: "if ((nn & 31) == 0) load_bids(nn);",
    846: "mad_wide(int a, int b, const uint8_t* base)",
    884: "const int npairs = first < tile_hi ? (tile_hi - first + 2 * NW - 1) / (2 * NW) : 0;",
    885: "const int ntiles = (npairs + 1) / 2;",
    889: "const int u = first + 2 * (base + lane) * NW;",
    899: "const int kstr = (int)P.k_blk_stride, vstr = (int)P.v_blk_stride;",
    903: "const uint32_t ring_s = ",
    908: "const bool on = u < tile_hi;",
    909: "const int blk = __shfl_sync(FULL_MASK, hf ? bids1 : bids0, m & 31);",
    911: "ring_s + (uint32_t)((m & (S - 1)) * (2 * ST::BYTES) + hf * ST::BYTES);",
    912: "const uint8_t* kp = mad_wide(blk, kstr, ksrc) + toff * F::KCB;",
    922: "ST::V, mad_wide(blk, mstr, msrc) + toff * F::MB, on && mlane);",
    929: "issue(m);",
    942: "if (((m0 + S) & 31) == 0) load_bids(m0 + S);",
    943: "const bool two = m0 + 1 < npairs;",
    950: "cp_async_wait<S - 1>();",
    952: "cp_async_wait<S - 2>();",
    954: "if (j == 1 && !two) {",
    963: "const uint8_t* st0 = ring[warp][(m0 + j) & (S - 1)];",
    967: "const int t0 = (first + 2 * (m0 + j) * NW + hf) * 16;",
    973: "const int t = 4 * (g >> 1) + 2 * r + (g & 1), tok = t0 + t;",
    983: "W.template softmax<4>(s, p);",
    986: "if (j == 0 || two) {",
    992: "W.pv_unit(p[2 * j + hf], vs_r, vz_r, st0 + hf * ST::BYTES + ST::K + 4 * q, g, lut);",
    995: "__syncwarp();  // every lane's reads of the slot are done before it is refilled",
    996: "issue(m0 + j + S);",
    1000: "cp_async_wait<0>();",
}


def test_cited_kernel_lines():
    src = C._SRC.read_text().splitlines()
    for n, text in CITED.items():
        assert text in src[n - 1], f"paged_decode.cu:{n} is not {text!r}: {src[n - 1]!r}"
    import re
    from pathlib import Path

    cites = re.findall(r"cu:(\d+)", Path(M.__file__).read_text())
    assert cites and all(1 <= int(c) <= len(src) for c in cites)
