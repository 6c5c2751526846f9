"""CPU checks of the fp8 tensor-core decode research design (benchmarks/fp8mma/: fp8mma.cu,
fp8mma.py; NOTES.md "fp8 tensor-core decode"), whose kernel only a GPU runs (fp8mma.py gpu):

- the e4m3 levels (e4m3(alpha L) / alpha of the 4-bit Lloyd-Max levels) and their MSE cost;
- the PRMT decode of a code word, modelled bit for bit (PTX ``prmt`` semantics), gives the
  e4m3 bytes of the codes the packer wrote, for random words;
- the K and V page packers round-trip;
- the numpy model of the lanes (code words read as each lane reads them, the m16n8k32 e4m3 and
  m16n8k16 f16 fragments of the PTX ISA, movmatrix, the e4m3 hi + lo split of q and P', the
  online softmax, the warps' and splits' merge) run through whole decodes equals the float64
  reference within the stated tolerance, for both variants (f8, cvt), and a one-bit mistake
  in the decode makes it fail;
- the sm_90a / sm_89 SASS of the loop (nvcc on the CPU): no spills, the mma count per tile,
  fewer instructions per token-head than v6's 27.5 for the sm_90 variant.
"""

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "fp8mma"


@pytest.fixture(scope="module")
def fm():
    sys.path.insert(0, str(BENCH))
    try:
        import fp8mma
    finally:
        sys.path.remove(str(BENCH))
    return fp8mma


def test_levels(fm):
    lv = fm.levels()
    mags = np.asarray(lv["mag_bytes"])
    assert (np.diff(fm.e4m3_value(mags)) > 0).all() and (mags < 0x7F).all()
    # every level is an e4m3 number over alpha; the MSE cost is the NOTES' study's (+0.70%)
    lev = np.asarray(lv["levels"])
    assert np.allclose(fm.e4m3_round(lev * lv["alpha"]), lev * lv["alpha"])
    assert 0.0 < lv["mse_e4m3"] / lv["mse_exact"] - 1 < 0.01
    assert lv["t0"] == int.from_bytes(bytes(mags[:4].tolist()), "little")


def test_e4m3_rounding(fm):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(10000) * 10.0 ** rng.uniform(-4, 2.5, 10000)
    r = fm.e4m3_round(x)
    vals = fm.e4m3_value(np.arange(256))
    vals = vals[np.isfinite(vals)]
    nearest = np.abs(np.clip(x, -448, 448)[:, None] - vals[None]).min(axis=1)
    assert np.allclose(np.abs(np.clip(x, -448, 448) - r), nearest)


def test_prmt_semantics(fm):
    a, b = 0x03020100, 0x87868584
    assert int(fm.prmt(a, b, 0x3210)) == a
    assert int(fm.prmt(a, b, 0x7654)) == b
    assert int(fm.prmt(a, b, 0x0123)) == 0x00010203
    # bit 3 of a selector nibble: the selected byte's bit 7 replicated
    assert int(fm.prmt(a, b, 0xC840)) == 0xFF008400


def test_decode_bit_for_bit(fm):
    lv = fm.levels()
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, (4096, 8)).astype(np.uint8)
    w = fm._word(codes)
    assert (fm._unword(w) == codes).all()
    alo, ahi = fm.decode_word(w, lv["t0"], lv["t1"])
    mags = np.asarray(lv["mag_bytes"], dtype=np.uint32)
    want = mags[codes & 7] | ((codes.astype(np.uint32) >> 3) << 7)  # sign-magnitude e4m3
    byte = lambda x, i: (x >> np.uint32(8 * i)) & np.uint32(0xFF)  # noqa: E731
    got = np.stack([byte(x, i) for x in (alo, ahi) for i in range(4)], -1)
    assert (got == want).all()


def test_pack_roundtrip(fm):
    rng = np.random.default_rng(2)
    for pack, unpack in ((fm.pack_k_page, fm.unpack_k_page), (fm.pack_v_page, fm.unpack_v_page)):
        codes = rng.integers(0, 16, (fm.PS, fm.D)).astype(np.uint8)
        sc = rng.uniform(0.01, 3, fm.PS).astype(np.float16)
        page = pack(codes, sc)
        assert page.shape == (fm.PAGE,) and page.dtype == np.uint8
        c2, s2 = unpack(page)
        assert (c2 == codes).all() and (s2 == sc).all()
    # V: a channel's 16 codes in its two words: half h holds tokens 4b + 2h + {0, 1}
    assert sorted(fm._v_tokens().ravel().tolist()) == list(range(16))


def test_quantiser(fm):
    rng = np.random.default_rng(3)
    y = rng.standard_normal((64, fm.D)) * rng.uniform(0.2, 3, (64, 1))
    codes, sc = fm.quantise(y)
    yh = fm.code_values(codes) * sc.astype(np.float64)[:, None]
    rel = np.linalg.norm(yh - y) ** 2 / np.linalg.norm(y) ** 2
    assert rel < 1.2 * fm.levels()["mse_e4m3"]  # about the N(0, 1) MSE of the levels


CASES = [  # B, hkv, G, lens, tokens_per_split: partial pages and tiles, splits, GQA 4 / 8
    (1, 1, 4, [70], 64),
    (2, 2, 4, [33, 100], 32),
    (1, 1, 8, [200], 96),
    (1, 2, 4, [17], 64),
]


@pytest.mark.parametrize("variant,units", [("f8", 1), ("f8", 2), ("cvt", 1), ("cvt", 2)])
@pytest.mark.parametrize("B,hkv,G,lens,tps", CASES)
def test_model_matches_reference(fm, variant, units, B, hkv, G, lens, tps):
    case = fm.make_case(B, hkv, G, max(lens), seed=B * 7 + hkv + G, lens=lens)
    ref = fm.reference(case)
    tps = -(-tps // (32 * units)) * 32 * units  # the kernel's rule: whole tiles per split
    out = fm.model(case, variant, tokens_per_split=tps, units=units)
    tol = fm.tolerance(case, variant)
    err = float(np.abs(out - ref).max())
    assert np.isfinite(out).all()
    assert err <= tol, f"{variant}: model max abs error {err:.3e} > tolerance {tol:.3e}"
    # the tolerance is not vacuous: below 5% of the outputs' largest magnitude
    assert tol < 0.05 * np.abs(ref).max()


def test_model_catches_a_wrong_bit(fm, monkeypatch):
    """The hi codes' signs read one bit off (w << 3 for w << 4): the model must fail."""
    case = fm.make_case(1, 1, 4, 70, seed=5, lens=[70])
    ref = fm.reference(case)

    def wrong(w, t0, t1):
        w = np.asarray(w, dtype=np.uint32)
        m = w & np.uint32(0x77777777)
        alo = fm.prmt(t0, t1, m) ^ (w & np.uint32(0x80808080))
        ahi = fm.prmt(t0, t1, m >> np.uint32(16)) ^ ((w << np.uint32(3)) & np.uint32(0x80808080))
        return alo, ahi

    monkeypatch.setattr(fm, "decode_word", wrong)
    err = float(np.abs(fm.model(case, "f8") - ref).max())
    assert err > 10 * fm.tolerance(case, "f8")


def test_sass_counts(fm):
    """sm_90a (H100/H200) and sm_89 SASS of the loop (nvcc and cuobjdump on the CPU; fails,
    not skips, without them: the count is this design's deliverable)."""
    try:
        nvcc = fm._nvcc()
    except FileNotFoundError as e:
        pytest.fail(f"fp8mma's SASS count needs nvcc: {e}")
    cuobjdump = fm._tool("cuobjdump")
    assert shutil.which(cuobjdump) or Path(cuobjdump).exists(), (
        f"no cuobjdump (on PATH or in triton's bundle) next to {nvcc}"
    )
    rows = {
        (r["variant"], r["units"], r["arch"]): r
        for r in fm.sass_counts("90a") + fm.sass_counts("89")
    }
    assert len(rows) == 8
    # per 32-token unit: scores 2 m-tiles x 4 k-steps, PV 8 m-tiles, each k32 = 2 mma
    for u in (1, 2):
        cvt = rows[("cvt", u, "sm_90a")]  # the Hopper design
        assert cvt["spill_bytes"] == 0
        assert cvt["by_opcode"]["HMMA"] == 32 * u and cvt["by_class"]["prmt"] == 64 * u
        assert cvt["per_token_head"] < 27.5  # v6's 4bit d128 loop
        f8 = rows[("f8", u, "sm_89")]  # a native fp8 mma.sync (Ada; Blackwell likewise)
        assert f8["spill_bytes"] == 0 and f8["by_opcode"]["QMMA"] == 32 * u
        # sm_90 has no synchronous fp8 mma: ptxas emulates each with F2FP + 2 HMMA (+ FADD)
        f8_90 = rows[("f8", u, "sm_90a")]
        assert "QMMA" not in f8_90["by_opcode"] and f8_90["by_opcode"]["HMMA"] == 64 * u
