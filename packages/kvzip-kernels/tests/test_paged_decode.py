"""paged_decode kernels vs the float32 reference on the dequantised cache.

Earned tolerance: the kernel's relative L2 error against the float32 reference must
be at most twice that of plain torch doing the same attention in bf16, plus 1e-3.
"""

import functools

import pytest
import torch

from kvzip_formats import FormatError, get_format
from kvzip_formats.ops import cache_write as ref_cache_write
from kvzip_formats.ops import new_paged_cache
from kvzip_formats.ops import paged_decode as ref_paged_decode
from kvzip_kernels import DecodeConfig, paged_decode
from kvzip_kernels.testing import synthetic_calibration


def _rel(a, b):
    return ((a.float().cpu() - b).norm() / b.norm()).item()


def make_case(name, hq, hkv, d, block_size, lens, seed, device, extra_blocks=3):
    """A paged cache holding random K/V for sequences of ``lens`` tokens, scattered pages."""
    g = torch.Generator().manual_seed(seed)
    compact = name in ("4bit", "3.5bit", "3bit")
    fmt = get_format(name, calibration=synthetic_calibration(hkv, d) if compact else None)
    b = len(lens)
    max_blocks = max(-(-n // block_size) for n in lens) + 1  # one unused column
    nb = b * max_blocks + extra_blocks
    kc = new_paged_cache(fmt, nb, hkv, block_size, d, kind="k")
    vc = new_paged_cache(fmt, nb, hkv, block_size, d, kind="v")
    bt = torch.randperm(nb, generator=g)[: b * max_blocks].view(b, max_blocks).to(torch.int32)
    for i, n in enumerate(lens):
        tok = torch.arange(n)
        slots = bt[i, tok // block_size].long() * block_size + tok % block_size
        k = torch.randn(n, hkv, d, generator=g) * 2 + torch.randn(1, hkv, d, generator=g)
        ref_cache_write(fmt, k, kc, slots, kind="k", block_size=block_size)
        ref_cache_write(
            fmt, torch.randn(n, hkv, d, generator=g), vc, slots, kind="v", block_size=block_size
        )
    q = torch.randn(b, hq, d, generator=g).to(torch.bfloat16)
    sl = torch.tensor(lens, dtype=torch.int32)
    host = (fmt, q, kc, vc, bt, sl)
    dev = tuple(t.to(device) for t in (q, kc, vc, bt, sl))
    return host, dev


def check(name, hq, hkv, d, block_size, lens, device, config=None, seed=0):
    (fmt, q, kc, vc, bt, sl), dq = make_case(name, hq, hkv, d, block_size, lens, seed, device)
    ref = ref_paged_decode(fmt, q, kc, vc, bt, sl, block_size=block_size)
    plain = ref_paged_decode(
        fmt, q, kc, vc, bt, sl, block_size=block_size, compute_dtype=torch.bfloat16
    )
    out = paged_decode(fmt, *dq, block_size=block_size, config=config)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert torch.isfinite(out).all()
    err, tol = _rel(out, ref), 2 * _rel(plain, ref) + 1e-3
    assert err <= tol, f"{name}: relative L2 error {err:.2e} > earned tolerance {tol:.2e}"


# GQA ratios 1/3/4/8, head_dim 64/128, page sizes 16/64, partial last pages, several splits.
CASES = [
    # hq, hkv, d, block_size, lens, config
    (4, 4, 64, 16, [37, 5], DecodeConfig(block_n=16, num_splits=2)),
    (6, 2, 128, 16, [70], DecodeConfig(block_n=32, num_splits=3)),
    (8, 2, 64, 64, [130, 64], DecodeConfig(block_n=64, num_splits=2)),
    (8, 1, 128, 64, [65], DecodeConfig(block_n=64, num_splits=1)),
]


@pytest.mark.parametrize("name", ["int4", "fp8"])
@pytest.mark.parametrize(("hq", "hkv", "d", "block_size", "lens", "config"), CASES)
def test_matches_reference(name, hq, hkv, d, block_size, lens, config, device):
    check(name, hq, hkv, d, block_size, lens, device, config)


@pytest.mark.parametrize("name", ["4bit", "3.5bit", "3bit"])
@pytest.mark.parametrize(("hq", "hkv", "d", "block_size", "lens", "config"), [CASES[1], CASES[3]])
def test_compact_formats(name, hq, hkv, d, block_size, lens, config, device):
    """Codebook codes, fp16 token scales and the calibrated transforms folded into q and o."""
    check(name, hq, hkv, d, block_size, lens, device, config)


# SmolLM2's shape (9 query heads, 3 KV heads, head_dim 64): 3bit's 3- and 2-bit groups of 32
# channels have classes of 8, paired into 16 by the kernel; 3.5bit/4bit as the neighbours.
SMOL_CASES = [
    (9, 3, 64, 16, [37, 5], DecodeConfig(block_n=16, num_splits=2)),
    (9, 3, 64, 64, [130], DecodeConfig(block_n=64, num_splits=2)),
]


@pytest.mark.parametrize("name", ["3bit", "3.5bit", "4bit"])
@pytest.mark.parametrize(("hq", "hkv", "d", "block_size", "lens", "config"), SMOL_CASES)
def test_compact_head_dim_64(name, hq, hkv, d, block_size, lens, config, device):
    check(name, hq, hkv, d, block_size, lens, device, config)


def test_compact_head_dim_64_sinks(device):
    """3bit at head_dim 64 with its bf16 sink token, as the embedded model runs it."""
    _check_sinks("3bit", 9, 3, 64, device)


def test_compact_rows_too_narrow_are_refused(device):
    """A row the kernel cannot read (a 3-bit group of 16 channels: classes of 4, below
    tl.dot's depth even paired) is a clear error, never garbage."""
    from kvzip_formats.compact.codec import CompactFormat, CompactSpec

    spec = CompactSpec("narrow", ((0.75, 4), (0.25, 3)), ((1, 4),), 1, 1)
    fmt = CompactFormat(spec, synthetic_calibration(1, 64))
    q = torch.zeros(1, 4, 64, dtype=torch.bfloat16, device=device)
    kc = new_paged_cache(fmt, 2, 1, 16, 64, kind="k", device=device)
    vc = new_paged_cache(fmt, 2, 1, 16, 64, kind="v", device=device)
    bt = torch.zeros(1, 2, dtype=torch.int32, device=device)
    sl = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(FormatError, match=">= 16 channels per class"):
        paged_decode(fmt, q, kc, vc, bt, sl, block_size=16)


def test_rotated_int4(device):
    """int4-rot: q rotated before, output after (the rotation costs one bf16 rounding of q)."""
    check("int4-rot", 8, 2, 64, 16, [45], device, DecodeConfig(block_n=16, num_splits=2))


def test_default_config_and_split_edges(device):
    """Default split choice; a split past a short sequence's end must contribute nothing."""
    check("int4", 4, 1, 64, 16, [300, 3], device, DecodeConfig(block_n=16, num_splits=5))
    check("fp8", 4, 1, 64, 16, [40], device)


def test_bad_inputs(device):
    _, (q, kc, vc, bt, sl) = make_case("int4", 4, 2, 64, 16, [20], 0, device)
    with pytest.raises(FormatError, match="bfloat16"):
        paged_decode("int4", q.float(), kc, vc, bt, sl, block_size=16)
    with pytest.raises(FormatError, match="not a multiple of"):
        paged_decode("int4", q[:, :3], kc, vc, bt, sl, block_size=16)
    with pytest.raises(FormatError, match="block_table must be int32"):
        paged_decode("int4", q, kc, vc, bt.long(), sl, block_size=16)
    with pytest.raises(FormatError, match="seq_lens must be int32"):
        paged_decode("int4", q, kc, vc, bt, sl.long(), block_size=16)
    with pytest.raises(FormatError, match="shape"):
        paged_decode("int4", q, kc[..., :-4], vc, bt, sl, block_size=16)
    with pytest.raises(FormatError, match="exceeds block_table capacity"):
        paged_decode("int4", q, kc, vc, bt, sl + 1000, block_size=16)
    with pytest.raises(FormatError, match="seq_lens must be >= 1"):
        paged_decode("int4", q, kc, vc, bt, sl * 0, block_size=16)
    with pytest.raises(FormatError, match="block_size must be one of"):
        paged_decode("int4", q, kc, vc, bt, sl, block_size=24)
    with pytest.raises(FormatError, match="no kvzip_kernels implementation"):
        paged_decode("bf16", q, kc, vc, bt, sl, block_size=16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["int4", "fp8"])
@pytest.mark.parametrize(("hq", "hkv"), [(32, 8), (8, 1), (24, 8)])
def test_gpu_long_context(name, hq, hkv):
    """The compiled kernels with the benchmark's defaults on 8B/70B-TP8 shapes, long lengths."""
    check(name, hq, hkv, 128, 16, [4099, 1000, 37, 8192], "cuda", seed=3)


def test_block_strided_caches(device):
    """vLLM keeps K and V of a block side by side: kv[:, 0] / kv[:, 1] with block_stride."""
    (fmt, q, kc, vc, bt, sl), (dq, dkc, dvc, dbt, dsl) = make_case(
        "int4", 4, 2, 64, 16, [40], 0, device
    )
    kv = torch.stack((dkc, dvc), 1)  # [blocks, 2, heads, page_bytes]
    cfg = DecodeConfig(block_n=16, num_splits=2)
    want = paged_decode("int4", dq, dkc, dvc, dbt, dsl, block_size=16, config=cfg)
    got = paged_decode(
        "int4",
        dq,
        kv[:, 0],
        kv[:, 1],
        dbt,
        dsl,
        block_size=16,
        config=cfg,
        block_stride=kv.stride(0),
    )
    assert torch.equal(got, want)
    with pytest.raises(FormatError, match="block_stride"):
        paged_decode("int4", dq, kv[:, 0], kv[:, 1], dbt, dsl, block_size=16, block_stride=7)


@pytest.mark.parametrize("name", ["4bit", "3bit"])
def test_compact_sink_tokens(name, device):
    """The first token read from its bf16 copy (spec/4bit.md section 8), merged by log-sum-exp;
    a sequence of one token is all sink."""
    _check_sinks(name, 8, 2, 128, device)
    with pytest.raises(FormatError, match="sinks"):
        paged_decode(
            "int4",
            *make_case("int4", 4, 1, 64, 16, [5], 0, device)[1],
            block_size=16,
            sinks=tuple(torch.zeros(1, 1, 1, 64, dtype=torch.bfloat16) for _ in range(2)),
        )


def _check_sinks(name, hq, hkv, d, device):
    (fmt, q, kc, vc, bt, sl), dev = make_case(name, hq, hkv, d, 16, [37, 1], 4, device)
    g = torch.Generator().manual_seed(9)
    sinks = tuple((torch.randn(2, 1, hkv, d, generator=g) * 2).bfloat16() for _ in range(2))
    ref = ref_paged_decode(fmt, q, kc, vc, bt, sl, block_size=16, sinks=sinks)
    plain = ref_paged_decode(
        fmt, q, kc, vc, bt, sl, block_size=16, sinks=sinks, compute_dtype=torch.bfloat16
    )
    out = paged_decode(
        fmt,
        *dev,
        block_size=16,
        config=DecodeConfig(block_n=16, num_splits=2),
        sinks=tuple(t.to(device) for t in sinks),
    )
    err, tol = _rel(out, ref), 2 * _rel(plain, ref) + 1e-3
    assert err <= tol, f"{name} with sinks: {err:.2e} > {tol:.2e}"
    # and the sink changes the answer (the test would not notice a kernel ignoring it)
    without = ref_paged_decode(fmt, q, kc, vc, bt, sl, block_size=16)
    assert _rel(without, ref) > 10 * tol


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["3bit", "4bit"])
def test_gpu_compact_head_dim_64_long_context(name):
    """The compiled kernels at SmolLM2's shape with the default config, long lengths."""
    check(name, 9, 3, 64, 16, [4099, 1000, 37], "cuda", seed=5)


@pytest.mark.parametrize(
    ("name", "lens", "r", "sinks"),
    [
        ("4bit", [37, 1, 20], 16, True),  # a window past the sinks; all sink; window = rest
        ("3bit", [70, 5], 8, False),  # no sinks: a sequence shorter than its window
        ("3.5bit", [33], 32, True),
    ],
)
def test_compact_residual_window(name, lens, r, sinks, device):
    """The last R tokens read from their bf16 copies (spec/residual_window.md), right-aligned
    and merged with the sinks by log-sum-exp; the kernels stop at the window."""
    hq, hkv, d = 8, 2, 128
    (fmt, q, kc, vc, bt, sl), dev = make_case(name, hq, hkv, d, 16, lens, 4, device)
    g = torch.Generator().manual_seed(11)
    b = len(lens)
    sk = tuple((torch.randn(b, 1, hkv, d, generator=g) * 2).bfloat16() for _ in range(2))
    sk = sk if sinks else None
    win = tuple((torch.randn(b, r, hkv, d, generator=g) * 2).bfloat16() for _ in range(2))
    ref = ref_paged_decode(fmt, q, kc, vc, bt, sl, block_size=16, sinks=sk, recent=win)
    plain = ref_paged_decode(
        fmt, q, kc, vc, bt, sl, block_size=16, sinks=sk, recent=win, compute_dtype=torch.bfloat16
    )
    out = paged_decode(
        fmt,
        *dev,
        block_size=16,
        config=DecodeConfig(block_n=16, num_splits=2),
        sinks=None if sk is None else tuple(t.to(device) for t in sk),
        recent=tuple(t.to(device) for t in win),
    )
    err, tol = _rel(out, ref), 2 * _rel(plain, ref) + 1e-3
    assert err <= tol, f"{name} with a window of {r}: {err:.2e} > {tol:.2e}"
    without = ref_paged_decode(fmt, q, kc, vc, bt, sl, block_size=16, sinks=sk)
    assert _rel(without, ref) > 10 * tol  # the window changes the answer


def test_residual_window_reference_reads_the_window_right_aligned():
    """The reference with a window equal to the rows' own decoded values gives the plain
    result; a window only touches the last R positions (a query equal on the others)."""
    (fmt, q, kc, vc, bt, sl), _ = make_case("4bit", 4, 1, 128, 16, [40], 2, "cpu")
    from kvzip_formats.ops.cache_write import PagedLayout, gather_rows

    lay_k, lay_v = (PagedLayout.of(fmt, 128, 16, kd) for kd in "kv")
    k = fmt.decode(gather_rows(kc, lay_k, bt[0], 40, "k"), kind="k", layer=0, head_dim=128)
    v = fmt.decode(gather_rows(vc, lay_v, bt[0], 40, "v"), kind="v", layer=0, head_dim=128)
    own = (k[None, -8:], v[None, -8:])  # [1, 8, 1, 128]: the last 8 rows as they decode
    plain = ref_paged_decode(fmt, q, kc, vc, bt, sl, block_size=16)
    same = ref_paged_decode(fmt, q, kc, vc, bt, sl, block_size=16, recent=own)
    torch.testing.assert_close(same, plain, rtol=0, atol=0)
    with pytest.raises(FormatError, match="recent"):
        ref_paged_decode(fmt, q, kc, vc, bt, sl, block_size=16, recent=(own[0], own[1][:, :4]))


def test_residual_window_is_refused_for_formats_without_one(device):
    with pytest.raises(FormatError, match="recent= .*compact formats"):
        paged_decode(
            "int4",
            *make_case("int4", 4, 1, 64, 16, [5], 0, device)[1],
            block_size=16,
            recent=tuple(torch.zeros(1, 2, 1, 64, dtype=torch.bfloat16) for _ in range(2)),
        )


def test_residual_window_from_a_start_reads_the_rows_before_it(device):
    """``recent_from``: a window that holds only its later positions (a slot filled since a
    prefix-cache hit); the earlier ones come from the rows, in the reference and the kernels."""
    hq, hkv, d, r = 8, 2, 128, 16
    (fmt, q, kc, vc, bt, sl), dev = make_case("4bit", hq, hkv, d, 16, [60, 40, 3], 6, device)
    g = torch.Generator().manual_seed(12)
    sk = tuple((torch.randn(3, 1, hkv, d, generator=g) * 2).bfloat16() for _ in range(2))
    win = tuple((torch.randn(3, r, hkv, d, generator=g) * 2).bfloat16() for _ in range(2))
    start = torch.tensor([50, 0, 2])  # mid-window; the whole window; inside a short sequence
    kw = dict(block_size=16, sinks=sk, recent=win)
    ref = ref_paged_decode(fmt, q, kc, vc, bt, sl, recent_from=start, **kw)
    plain = ref_paged_decode(
        fmt, q, kc, vc, bt, sl, recent_from=start, compute_dtype=torch.bfloat16, **kw
    )
    out = paged_decode(
        fmt,
        *dev,
        block_size=16,
        config=DecodeConfig(block_n=16, num_splits=2),
        sinks=tuple(t.to(device) for t in sk),
        recent=tuple(t.to(device) for t in win),
        recent_from=start.to(torch.int32).to(device),
    )
    err, tol = _rel(out, ref), 2 * _rel(plain, ref) + 1e-3
    assert err <= tol, f"recent_from: {err:.2e} > {tol:.2e}"
    whole = ref_paged_decode(fmt, q, kc, vc, bt, sl, **kw)
    assert _rel(whole[:1], ref[:1]) > 10 * tol  # sequence 0 read 6 rows instead of bf16
    torch.testing.assert_close(whole[1:2], ref[1:2], rtol=0, atol=0)  # from 0: the same
    with pytest.raises(FormatError, match="recent_from"):
        paged_decode(fmt, *dev, block_size=16, recent_from=start.to(device))


def _ring_store(slots: int, blocks: int, per: int, device):
    """A strided bf16 ring store as a server lays one out: each slot's values through
    ``blocks`` consecutive blocks, ``per`` values each, at an offset inside a wider block."""
    buf = torch.zeros(slots * blocks, per + 24, dtype=torch.bfloat16, device=device)
    return buf[:, 8 : 8 + per].view(slots, blocks, per)


def test_a_ring_reads_the_same_window_as_a_window_tensor(device):
    """``recent=Ring(...)``: the window read where the rings keep it (entry ``p mod R``, the
    step's token last) gives the same output, bit for bit, as the window passed as a tensor;
    ``ring_write`` puts K and V where the ring reads them."""
    from kvzip_kernels import Ring, ring_write

    hq, hkv, d, r = 8, 2, 128, 16
    lens = [37, 20, 1]
    (fmt, q, kc, vc, bt, sl), dev = make_case("4bit", hq, hkv, d, 16, lens, 7, device)
    g = torch.Generator().manual_seed(13)
    b = len(lens)
    sk = tuple((torch.randn(b, 1, hkv, d, generator=g) * 2).bfloat16().to(device) for _ in "kv")
    win = tuple((torch.randn(b, r + 1, hkv, d, generator=g) * 2).bfloat16() for _ in "kv")
    kw = dict(block_size=16, config=DecodeConfig(block_n=16, num_splits=2), sinks=sk)
    want = paged_decode(fmt, *dev, recent=tuple(t.to(device) for t in win), **kw)
    # the same window in rings (slot i + 1: not the identity), written by ring_write
    per = 48  # not a divisor of head_dim: entries straddle blocks
    store = _ring_store(b + 1, -(-r * 2 * hkv * d // per), per, device)
    rows, slot, idx = [], [], []
    toks_k, toks_v = [], []
    for i, n in enumerate(lens):
        for j in range(r):
            pos = n - (r + 1) + j
            if pos >= 0:
                rows.append(len(rows))
                slot.append(i + 1)
                idx.append(pos % r)
                toks_k.append(win[0][i, j])
                toks_v.append(win[1][i, j])
    t64 = functools.partial(torch.tensor, dtype=torch.int64, device=device)
    ring_write(
        store, torch.stack(toks_k).to(device), torch.stack(toks_v).to(device), t64(rows),
        t64(slot), t64(idx),
    )  # fmt: skip
    full = torch.tensor(lens, dtype=torch.int32)
    row_end = (full - (r + 1)).clamp(min=1).minimum(full).to(device)
    ring = Ring(store, t64([i + 1 for i in range(b)]), win[0][:, r].to(device),
                win[1][:, r].to(device), r, row_end)  # fmt: skip
    got = paged_decode(fmt, *dev, recent=ring, **kw)
    assert torch.equal(got, want)
    with pytest.raises(FormatError, match="row_end"):
        bad = Ring(ring.store, ring.slots, ring.fresh_k, ring.fresh_v, r, row_end.long())
        paged_decode(fmt, *dev, recent=bad, **kw)


@pytest.mark.parametrize("n_sink", [1, 3])
def test_sink_slots_read_the_same_sinks_as_a_sink_tensor(n_sink, device):
    """``sinks=SinkSlots(...)``: the sinks read by slot from a server's strided store (a slot's
    ``[n, 2, H, d]`` values through consecutive blocks, straddling them) give the same output,
    bit for bit, as the sinks passed as tensors; with a residual window too."""
    from kvzip_kernels import SinkSlots

    hq, hkv, d, r = 8, 2, 128, 4
    lens = [37, 20, 5]
    (fmt, q, kc, vc, bt, sl), dev = make_case("4bit", hq, hkv, d, 16, lens, 7, device)
    g = torch.Generator().manual_seed(17)
    b = len(lens)
    sk = tuple((torch.randn(b, n_sink, hkv, d, generator=g) * 2).bfloat16() for _ in "kv")
    win = tuple((torch.randn(b, r, hkv, d, generator=g) * 2).bfloat16().to(device) for _ in "kv")
    per = 48  # not a divisor of head_dim: a slot's values straddle blocks
    store = _ring_store(b + 2, -(-n_sink * 2 * hkv * d // per), per, device)
    slots = torch.tensor([2, 0, 3], dtype=torch.int64)  # not the identity
    flat = torch.stack(sk, 2).reshape(b, -1)  # [b, n * 2 * H * d]: the slot's value order
    for i in range(b):
        vals = torch.zeros(store.shape[1] * per, dtype=torch.bfloat16)
        vals[: flat.shape[1]] = flat[i]
        store[int(slots[i])] = vals.view(store.shape[1], per).to(device)
    kw = dict(block_size=16, config=DecodeConfig(block_n=16, num_splits=2))
    for extra in ({}, {"recent": win}):
        want = paged_decode(fmt, *dev, sinks=tuple(t.to(device) for t in sk), **kw, **extra)
        got = paged_decode(
            fmt, *dev, sinks=SinkSlots(store, slots.to(device), n_sink), **kw, **extra
        )
        assert torch.equal(got, want), extra.keys()
    with pytest.raises(FormatError, match="SinkSlots.slots"):
        paged_decode(fmt, *dev, sinks=SinkSlots(store, slots.int().to(device), n_sink), **kw)
