import pytest
import torch
from _formats import Damaged, Identity, Recorder

from kvzip_eval.corpus import token_windows
from kvzip_eval.quality.hook import FormatCache
from kvzip_eval.quality.kl import final_hidden, measure_kl
from kvzip_formats import get_format


@pytest.fixture(scope="module")
def windows(loaded):
    return token_windows(loaded.tokenizer, 2, 96, seed=3)


@pytest.fixture(scope="module")
def stats(loaded, windows):
    formats = {
        "bf16": get_format("bf16"),
        "identity": Identity(),
        "int4": get_format("int4"),
        "damaged": Damaged(),
    }
    # reuse_exact=False: every format really runs through the hook.
    return measure_kl(loaded, formats, windows, reuse_exact=False, progress=False)


def test_bf16_through_hook_is_exactly_zero(stats):
    s = stats["bf16"]
    assert s.kl_mean == 0.0 and s.kl_p99 == 0.0 and s.top1_agree == 1.0
    assert s.positions == 2 * 96


def test_identity_format_is_exactly_zero(stats):
    assert stats["identity"].kl_mean == 0.0 and stats["identity"].top1_agree == 1.0


def test_int4_positive_and_damaged_large(stats):
    int4, bad = stats["int4"], stats["damaged"]
    # results/quality/baselines/report.md: int4 0.128 on 8,192-token windows; short ones nearby.
    assert 0.02 < int4.kl_mean < 0.5
    assert int4.kl_median <= int4.kl_mean <= int4.kl_p99
    assert bad.kl_mean > 5 * int4.kl_mean and bad.kl_mean > 0.5
    assert bad.top1_agree < int4.top1_agree


def test_reuse_exact_detects_bf16_only(loaded, windows):
    formats = {"bf16": get_format("bf16"), "int4": get_format("int4")}
    s = measure_kl(loaded, formats, windows[:1, :32], progress=False)
    assert s["bf16"].exact and s["bf16"].kl_mean == 0.0
    assert not s["int4"].exact and s["int4"].kl_mean > 0


def test_current_token_reads_through_format(loaded, windows):
    # Position 0 attends only to itself: its output changes only if its own K/V go
    # through the format.
    ids = windows[:1, :8]
    h_ref, _ = final_hidden(loaded, ids)
    h_bad, _ = final_hidden(loaded, ids, Damaged())
    assert not torch.equal(h_ref[0], h_bad[0])


def test_every_layer_and_decode_step_goes_through_format(loaded, windows):
    rec = Recorder()
    ids = windows[:1, :10]
    cache = FormatCache(loaded.model.config, rec)
    with torch.no_grad():
        loaded.model(input_ids=ids, past_key_values=cache, use_cache=True)
        loaded.model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
    layers = loaded.info.num_layers
    prefill = [c for c in rec.calls if c[2] == 0]
    decode = [c for c in rec.calls if c[2] == 10]
    assert sorted(prefill) == sorted((i, k, 0, 10) for i in range(layers) for k in "kv")
    assert sorted(decode) == sorted((i, k, 10, 1) for i in range(layers) for k in "kv")


def test_left_padding_positions(loaded):
    # Row 1 has 3 pad slots: its real tokens are positions 0.. and pads are never encoded.
    rec = Recorder()
    cache = FormatCache(loaded.model.config, rec, pad=[0, 3])
    k = torch.randn(2, loaded.info.num_kv_heads, 7, loaded.info.head_dim, dtype=torch.bfloat16)
    cache.update(k, k.clone(), 0)
    cache.update(k[:, :, :1], k[:, :, :1].clone(), 0)
    assert [c[2:] for c in rec.calls if c[1] == "k"] == [(0, 7), (0, 4), (7, 1), (4, 1)]


def test_windows_must_be_2d(loaded):
    with pytest.raises(ValueError, match=r"LongTensor\[n, T\]"):
        measure_kl(loaded, {}, torch.zeros(5, dtype=torch.long), progress=False)


class _SinkDamaged(Damaged):
    """A lossy row codec whose first two positions are read back exactly (as compact formats'
    sink token), through the base ``KVFormat.roundtrip``: the hook batches it."""

    sink_tokens = 2


class _SinkDamagedPerRow(_SinkDamaged):
    """The same codec with its own ``roundtrip``: the hook calls it row by row."""

    def roundtrip(self, x, *, kind, layer, start=0):
        return super().roundtrip(x, kind=kind, layer=layer, start=start)


def test_batched_sink_rows_equal_row_by_row(loaded):
    # Left-padded rows: the sink slots sit at a different cache index in each row, and only
    # real tokens (never pad slots) may count as sink positions.
    torch.manual_seed(0)
    x = torch.randn(3, loaded.info.num_kv_heads, 6, loaded.info.head_dim).bfloat16()
    pads = [0, 3, 1]
    outs = []
    for fmt in (_SinkDamaged(), _SinkDamagedPerRow()):
        cache = FormatCache(loaded.model.config, fmt, pad=pads)
        prefill = cache._apply(x, "k", 0, 0)
        step = cache._apply(x[:, :, :1], "k", 0, 6)  # a decode step at cache index 6
        outs.append((prefill, step))
    (pb, sb), (pr, sr) = outs
    for b, p in enumerate(pads):
        real = slice(p, None)
        assert torch.equal(pb[b, :, real], pr[b, :, real])
        assert torch.equal(pb[b, :, p : p + 2], x[b, :, p : p + 2])  # positions 0, 1: exact
        assert not torch.equal(pb[b, :, p + 2 :], x[b, :, p + 2 :])  # later ones: lossy
    assert torch.equal(sb, sr) and not torch.equal(sb, x[:, :, :1])
