"""The backend's CPU reference path against attention over the format's roundtrip; the
bytes vLLM is told a block takes against the bytes the backend uses; layer names.

The impl writes K/V into vLLM-shaped pages (``[num_blocks, heads, block_size,
content_bytes]`` uint8) through a slot mapping and attends over what it reads back; that must
equal float32 attention over ``fmt.decode(fmt.encode(x))`` of the same tokens (sink tokens
exact, as ``roundtrip`` keeps them; float32, as a kernel reads them, where ``roundtrip``
rounds to x's dtype), prefill chunks and decode alike, for a scattered block table.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

import kvzip_formats  # noqa: E402
from kvzip_kernels.paged import PagedAttention, plan_step, sink_plan  # noqa: E402
from kvzip_vllm import backend, compat, support  # noqa: E402
from kvzip_vllm.backend import KvzipAttentionImpl, KvzipAttentionMetadata  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))


class _Int4WithSink(type(kvzip_formats.get_format("int4"))):
    """int4 plus one bf16 sink token, declared the way the compact formats declare theirs."""

    spec = SimpleNamespace(sink_tokens=1)


def _impl(fmt, heads, kv_heads, d, block_size):
    impl = object.__new__(KvzipAttentionImpl)
    impl.num_heads, impl.head_size, impl.num_kv_heads = heads, d, kv_heads
    impl.scale = 1 / math.sqrt(d)
    impl.fmt, impl.block_size = fmt, block_size
    impl._layer_index = {}
    return impl


def _meta(lo, hi, table, slots, sink_tokens):
    qsl, lens = [0, hi - lo], [hi]
    fresh, rows = sink_plan(qsl, lens, sink_tokens)
    return KvzipAttentionMetadata(
        num_actual_tokens=hi - lo,
        max_query_len=hi - lo,
        max_seq_len=hi,
        query_start_loc_cpu=torch.tensor(qsl),
        seq_lens_cpu=torch.tensor(lens),
        seq_lens=torch.tensor(lens),
        block_table=table,
        slot_mapping=slots[lo:hi],
        sink_fresh=fresh,
        sink_rows=rows,
    )


def _reference(fmt, q, k, v, scale):
    d = k.shape[-1]
    kr = fmt.decode(fmt.encode(k, kind="k", layer=3), kind="k", layer=3, head_dim=d)
    vr = fmt.decode(fmt.encode(v, kind="v", layer=3), kind="v", layer=3, head_dim=d)
    sinks = int(fmt.sink_tokens)
    kr[:sinks], vr[:sinks] = k[:sinks].float(), v[:sinks].float()
    g = q.shape[1] // k.shape[1]
    kr, vr = kr.repeat_interleave(g, 1), vr.repeat_interleave(g, 1)
    n, t = k.shape[0], q.shape[0]
    s = torch.einsum("qhd,khd->hqk", q.float(), kr) * scale
    mask = torch.arange(n)[None, :] > torch.arange(n - t, n)[:, None]
    s.masked_fill_(mask[None], -math.inf)
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vr)


def _compact(name):
    from calibration_cache import calibration

    return kvzip_formats.get_format(name, calibration=calibration(name))


@pytest.mark.parametrize(
    ("fmt", "heads", "kv_heads", "d"),
    [
        (kvzip_formats.get_format("int4"), 9, 3, 64),
        (kvzip_formats.get_format("int4"), 4, 1, 128),
        (_Int4WithSink(), 9, 3, 64),
        (_Int4WithSink(), 4, 1, 128),
        # compact formats, calibrated for the embedded model (3 KV heads, d 64): 3.5bit's K and V
        # rows differ in size, all three keep a bf16 sink token
        ("4bit", 9, 3, 64),
        ("3.5bit", 9, 3, 64),
    ],
    ids=["int4-d64", "int4-d128", "int4+sink-d64", "int4+sink-d128", "4bit", "3.5bit"],
)
def test_paged_prefill_then_decode_matches_roundtrip_attention(
    fmt, heads, kv_heads, d, monkeypatch
):
    if isinstance(fmt, str):
        fmt = _compact(fmt)
    torch.manual_seed(0)
    bs, nblocks, n_prefill = 16, 32, 37  # 3 blocks, the last one partial
    layer = SimpleNamespace(layer_name="model.layers.3.self_attn.attn")
    impl = _impl(fmt, heads, kv_heads, d, bs)
    cache = impl.paged.new_cache(nblocks)
    table = torch.tensor([[7, 2, 9, 4]])
    total = n_prefill + 1
    k = torch.randn(total, kv_heads, d).to(torch.bfloat16)
    v = torch.randn(total, kv_heads, d).to(torch.bfloat16)
    q = torch.randn(total, heads, d).to(torch.bfloat16)
    slots = table[0][torch.arange(total) // bs] * bs + torch.arange(total) % bs
    for lo, hi in ((0, 20), (20, n_prefill), (n_prefill, total)):  # 2 prefill chunks, 1 decode
        meta = _meta(lo, hi, table, slots, impl.paged.sink_tokens)
        monkeypatch.setattr(compat, "step_metadata", lambda name, m=meta: m)
        impl.do_kv_cache_update(layer, k[lo:hi], v[lo:hi], cache, slots[lo:hi])
        out = torch.zeros(hi - lo, heads, d, dtype=torch.float32)
        impl.forward(layer, q[lo:hi], k[lo:hi], v[lo:hi], cache, meta, out)
        want = _reference(fmt, q[lo:hi], k[:hi], v[:hi], impl.scale)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------- layer names
@pytest.mark.parametrize(
    ("name", "index"),
    [("model.layers.3.self_attn.attn", 3), ("layers.0.attn", 0), ("model.layers.31.attn", 31)],
)
def test_layer_index_from_vllm_names(name, index):
    assert backend.layer_index(name) == index


@pytest.mark.parametrize("name", ["model.decoder.3.attn", "attn", "", "model.block_7.attn"])
def test_layer_name_without_index_is_refused_naming_it(name):
    impl = _impl(kvzip_formats.get_format("int4"), 4, 1, 64, 16)
    with pytest.raises(support.UnsupportedConfigError, match=f"layer name {name!r}"):
        impl._layer(SimpleNamespace(layer_name=name))


# ---------------------------------------------------------------------------- capacity
_CAPACITY: list[dict] = []


@pytest.fixture(scope="module", autouse=True)
def _write_capacity():
    """With ``KVZIP_RESULTS_DIR`` set, the byte accounting measured below goes to
    ``backend_capacity.json`` / ``.md`` there (the README's sink-overhead figures)."""
    yield
    out_dir = os.environ.get("KVZIP_RESULTS_DIR")
    if not (out_dir and _CAPACITY):
        return
    import vllm

    res = {
        "what": "kvzip-vllm backend: bytes per block vLLM is told vs bytes the backend uses",
        "device": f"cpu ({platform.processor() or platform.machine()})",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "vllm": vllm.__version__,
        },
        "command": " ".join([os.path.basename(sys.executable), "-m", "pytest", *sys.argv[1:]]),
        "shape": "Llama-3.1-8B attention: 8 KV heads, head size 128 (32 query heads)",
        "rows": _CAPACITY,
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "backend_capacity.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = [
        f"# {res['what']}",
        "",
        f"{res['device']}, {res['date']}, torch {torch.__version__}, vllm {vllm.__version__}; "
        f"{res['shape']}; `{res['command']}`",
        "",
        "| format | block size | page bytes (vLLM spec) | of which sink reserve | sink overhead "
        "| tokens per sink slot | vs fp8 bytes per token | one sink entry per block instead |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in _CAPACITY:
        lines.append(
            f"| {r['format']} | {r['block_size']} | {r['page_size_bytes']} | "
            f"{r['sink_reserve_bytes']} | {100 * r['sink_overhead']:.2f}% | "
            f"{r['tokens_per_sink_slot']} | {r['vs_fp8']:.3f}x | "
            f"+{100 * r['per_block_store_overhead']:.1f}% |"
        )
    with open(os.path.join(out_dir, "backend_capacity.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def _synthetic(name, kv_heads, d):
    from kvzip_kernels.testing import synthetic_calibration

    return kvzip_formats.get_format(name, calibration=synthetic_calibration(kv_heads, d))


def _held_tensors(p):
    """The tensors a layer's ``PagedAttention`` holds itself (its format's calibration aside)."""
    held = []
    for key, v in vars(p).items():
        if key == "fmt":
            continue
        vals = v.values() if isinstance(v, dict) else v if isinstance(v, list | tuple) else [v]
        held += [t for t in vals if isinstance(t, torch.Tensor)]
    return held


@pytest.mark.parametrize("name", ["4bit", "3.5bit", "3bit"])
@pytest.mark.parametrize("bs", [16, 64, 128])
def test_page_vllm_sizes_is_the_page_the_backend_uses(name, bs, monkeypatch):
    """vLLM sizes the cache as ``spec.page_size_bytes x num_blocks`` per layer; the backend
    must use exactly that (its sinks in it), and the sinks must cost a few percent at every
    block size. 8 KV heads, head size 128 (Llama-3.1-8B)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    kv_heads, d, heads = 8, 128, 32
    fmt = _synthetic(name, kv_heads, d)
    monkeypatch.setattr(backend, "_active_format", lambda: fmt)
    monkeypatch.setattr(backend, "_active_window", lambda: (0, 32768))
    spec = compat.layer_spec(  # customize_spec (0.32/0.33) or the 0.26 shim's spec
        backend.KvzipAttentionBackend,
        FullAttentionSpec(block_size=bs, num_kv_heads=kv_heads, head_size=d, dtype=torch.bfloat16),
    )
    p = PagedAttention(
        fmt,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_size=d,
        block_size=bs,
        scale=d**-0.5,
        kernels=False,
    )
    nb = 4 * p.blocks_per_slot + 3
    cache = p.new_cache(nb)
    assert cache.numel() == nb * spec.page_size_bytes  # what vLLM allocates for the layer
    pool = p.new_pool(cache)
    # two sequences: a prefill each, then a decode step; their sinks must be read back from
    # the cache's own bytes
    g = torch.Generator().manual_seed(bs)
    lens = [bs + 5, 3]
    table = torch.tensor([[nb - 1, 2], [5, 0]])
    k = torch.randn(sum(lens), kv_heads, d, generator=g).bfloat16()
    v = torch.randn(sum(lens), kv_heads, d, generator=g).bfloat16()
    tok = [torch.arange(n) for n in lens]
    slots = torch.cat([table[i][t // bs] * bs + t % bs for i, t in enumerate(tok)])
    qsl = [0, lens[0], sum(lens)]
    before = cache.clone()
    fresh, rows = sink_plan(qsl, lens, p.sink_tokens)
    st = plan_step(pool, table[:, 0], fresh, rows)
    p.write(k, v, cache, slots, layer=0, sinks=st)
    sk, sv = p.sinks_of(cache, st, layer=0)
    assert torch.equal(sk[:, 0], k[[0, lens[0]]]) and torch.equal(sv[:, 0], v[[0, lens[0]]])
    # the sinks live in the reserve bytes of the cache, nowhere else
    reserve = cache.view(nb, -1)[:, kv_heads * bs * p.token_head_bytes :]
    assert not torch.equal(reserve, before.view(nb, -1)[:, kv_heads * bs * p.token_head_bytes :])
    out = torch.zeros(sum(lens), heads * d)
    p.attend(
        torch.randn(sum(lens), heads * d, generator=g).bfloat16(),
        cache,
        query_start_loc_cpu=torch.tensor(qsl),
        seq_lens_cpu=torch.tensor(lens),
        seq_lens=torch.tensor(lens),
        block_table=table,
        layer=0,
        out=out,
        sinks=st,
    )
    assert torch.isfinite(out).all()
    # nothing beside the cache: the layer holds no tensor; the pool's index vectors (one pool
    # for every layer) are 8 bytes per block and 16 per slot
    assert _held_tensors(p) == []
    assert pool.index_bytes == 8 * nb + 16 * pool.num_slots
    # the sink overhead is the same at every block size: one slot per SINK_SLOT_TOKENS tokens
    overhead = p.reserve / p.token_head_bytes
    assert overhead < 0.03, overhead
    fp8 = 2 * d  # bytes per token and KV head of an fp8 cache
    _CAPACITY.append(
        {
            "format": name,
            "block_size": bs,
            "page_size_bytes": spec.page_size_bytes,
            "rows_bytes": kv_heads * bs * p.token_head_bytes,
            "sink_reserve_bytes": kv_heads * bs * p.reserve,
            "sink_overhead": overhead,
            "tokens_per_sink_slot": p.blocks_per_slot * bs,
            "sink_index_bytes_per_block_all_layers": 8 + 16 / p.blocks_per_slot,
            "vs_fp8": fp8 / p.content_bytes,
            # what one bf16 sink entry per block (the design this replaces) would add
            "per_block_store_overhead": 4 * p.sink_tokens * d / (bs * p.token_head_bytes),
        }
    )


def _common(seq_lens, bound):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    n = len(bound) if bound is not None else seq_lens.shape[0]
    return CommonAttentionMetadata(
        query_start_loc=torch.arange(n + 1),
        query_start_loc_cpu=torch.arange(n + 1),
        seq_lens=seq_lens,
        num_reqs=n,
        num_actual_tokens=n,
        max_query_len=1,
        max_seq_len=100,
        block_table_tensor=torch.zeros(n, 8, dtype=torch.int32),
        slot_mapping=torch.zeros(n, dtype=torch.int64),
        seq_lens_cpu_upper_bound=bound,
    )


def test_step_lengths_come_from_the_host_copy_without_reading_the_device():
    """The builder plans from vLLM's host copy of the lengths: the device tensor is not read
    (a read would wait for the previous step's forward under asynchronous scheduling). A
    device tensor that cannot be read (``meta``) proves it; padded rows past ``num_reqs`` are
    dropped."""
    bound = torch.tensor([37, 5, 64, 0], dtype=torch.int32)  # (the last row: padding)
    m = _common(torch.empty(4, dtype=torch.int32, device="meta"), bound).replace(num_reqs=3)
    assert backend.host_seq_lens(m).tolist() == [37, 5, 64]
    with pytest.raises(NotImplementedError):  # what a read of the device copy would do
        m.seq_lens[: m.num_reqs].cpu()


def test_step_lengths_are_read_back_where_the_host_copy_is_not_exact():
    """With speculative decoding the host copy is an upper bound (drafts not yet verified),
    and without one there is none: the lengths are then read from the device."""
    dev = torch.tensor([36, 5, 60], dtype=torch.int32)
    m = _common(dev, torch.tensor([37, 5, 64], dtype=torch.int32))
    assert backend.host_seq_lens(m, exact_bound=False).tolist() == [36, 5, 60]
    assert backend.host_seq_lens(_common(dev, None)).tolist() == [36, 5, 60]
