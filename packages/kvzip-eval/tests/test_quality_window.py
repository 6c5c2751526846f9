"""The residual window (``quality.window``): its attention reads the bf16 K/V inside the band of
the last R positions up to each query and the format's K/V before it (at R = 0 plain causal
attention over the format's K/V, at R >= T over the bf16 K/V), honours left padding, and the
``NAME+rN`` formats count the window's bf16 copies in their bits."""

from __future__ import annotations

from types import SimpleNamespace

import click
import pytest
import torch

from kvzip_eval.quality import window
from kvzip_formats import get_format


def _inputs(t=12, heads=4, kv_heads=2, d=8, batch=1):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, t, d, generator=g)
    kb, vb = (torch.randn(batch, kv_heads, t, d, generator=g) for _ in range(2))
    kq, vq = kb + 0.3 * torch.randn_like(kb), vb + 0.3 * torch.randn_like(vb)  # "quantized"
    return q, kb, vb, kq, vq


def _run(q, kb, vb, kq, vq, recent, mask=None):
    cache = SimpleNamespace(raw={0: (kb, vb)}, recent=recent)
    with window.reading(cache):
        out, _ = window.band_attention(SimpleNamespace(layer_idx=0), q, kq, vq, mask)
    return out.transpose(1, 2)  # [B, heads, T, d]


def _causal(q, k, v):
    n = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n, 1), v.repeat_interleave(n, 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_no_window_is_causal_attention_over_the_formats_kv():
    q, kb, vb, kq, vq = _inputs()
    torch.testing.assert_close(_run(q, kb, vb, kq, vq, 0), _causal(q, kq, vq))


def test_query_chunks_give_the_same_attention(monkeypatch):
    q, kb, vb, kq, vq = _inputs()
    whole = _run(q, kb, vb, kq, vq, 4)
    monkeypatch.setattr(window, "QUERY_CHUNK", 5)  # 12 rows: chunks of 5, 5, 2
    torch.testing.assert_close(_run(q, kb, vb, kq, vq, 4), whole)


def test_a_window_as_long_as_the_sequence_is_attention_over_bf16():
    q, kb, vb, kq, vq = _inputs()
    torch.testing.assert_close(_run(q, kb, vb, kq, vq, 12), _causal(q, kb, vb))


@pytest.mark.parametrize("recent", [1, 3, 5])
def test_each_query_reads_bf16_inside_its_band_and_the_format_before_it(recent):
    q, kb, vb, kq, vq = _inputs()
    out = _run(q, kb, vb, kq, vq, recent)
    kb2, vb2, kq2, vq2 = (x.repeat_interleave(2, 1) for x in (kb, vb, kq, vq))
    for i in (0, 4, 11):
        j = torch.arange(i + 1)
        inside = j > i - recent
        k = torch.where(inside[:, None], kb2[0, :, : i + 1], kq2[0, :, : i + 1])
        v = torch.where(inside[:, None], vb2[0, :, : i + 1], vq2[0, :, : i + 1])
        p = torch.softmax(q[0, :, i : i + 1] @ k.transpose(-1, -2) / 8**0.5, -1)
        torch.testing.assert_close(out[0, :, i], (p @ v)[:, 0])


def test_a_left_padded_row_equals_the_same_row_unpadded():
    """Row 1 is row 0's last 9 tokens behind 3 pads: its real queries see the same keys at the
    same distances, so its band and output are row 0's suffix run alone; pad queries give 0."""
    q, kb, vb, kq, vq = _inputs(batch=1)
    alone = _run(*(x[:, :, 3:] for x in (q, kb, vb, kq, vq)), 4)
    pads = torch.zeros(1, 1, 12, 12, dtype=torch.bool)
    pads[..., 3:] = True  # keys 0-2 are pads
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    mask = (pads & causal).expand(1, 1, 12, 12)
    out = _run(q, kb, vb, kq, vq, 4, mask=mask)
    torch.testing.assert_close(out[:, :, 3:], alone)
    assert torch.count_nonzero(out[:, :, :3]) == 0


def test_split_name_and_its_errors():
    assert window.split_name("4bit+r128") == ("4bit", 128)
    assert window.split_name("3.5bit") == ("3.5bit", 0)
    with pytest.raises(ValueError, match="N >= 1"):
        window.split_name("4bit+r0")
    with pytest.raises(ValueError, match="recent >= 1"):
        window.Windowed(get_format("int4"), 0)


def test_the_windows_bf16_copies_are_counted_in_bits():
    fmt = get_format("int4")
    w = window.Windowed(fmt, 128)
    assert w.name == "int4+r128"
    # 128 tokens x 16 bits over a 131,072-token sequence: +1/64 bit per element
    assert w.bits_per_element() == pytest.approx(fmt.bits_per_element() + 128 * 16 / 131072)
    assert w.bits_per_element(seq_len=8192) == pytest.approx(
        fmt.bits_per_element(seq_len=8192) + 128 * 16 / 8192
    )
    assert window.recent_of(w) == 128 and window.recent_of(fmt) == 0


def test_resolve_formats_takes_a_window_suffix_and_refuses_unknown_bases(loaded):
    from kvzip_eval.cmd_eval import resolve_formats

    got = resolve_formats(["int4", "int4+r16"], None, loaded.info)
    assert isinstance(got["int4+r16"], window.Windowed) and got["int4+r16"].recent == 16
    with pytest.raises(click.BadParameter, match="unknown format 'nope'.*NAME\\+rN"):
        resolve_formats(["nope+r16"], None, loaded.info)


def test_a_window_covering_every_token_gives_the_bf16_reference(loaded):
    """Through the model: int4 with a window longer than the text reads every K/V in bf16, so
    its hidden states equal the bf16 reference's under the same attention function, bit for
    bit; with a window of 4 they differ, and are closer to bf16 than int4 without one."""
    from kvzip_eval.quality.kl import final_hidden

    ids = torch.tensor([list(range(100, 164))])
    fmt = get_format("int4")
    with window.band_mode(loaded.model):
        ref, _ = final_hidden(loaded, ids)
        full, _ = final_hidden(loaded, ids, window.Windowed(fmt, 64))
        some, _ = final_hidden(loaded, ids, window.Windowed(fmt, 4))
        none, _ = final_hidden(loaded, ids, fmt)
    assert loaded.model.config._attn_implementation != window.NAME  # restored
    assert torch.equal(full, ref)
    err = lambda h: (h.float() - ref.float()).norm().item()  # noqa: E731
    assert 0 < err(some) < err(none)
