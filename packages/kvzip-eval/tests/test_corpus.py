import pytest
import torch

from kvzip_eval.corpus import corpus_tokens, load_text, token_windows


def test_default_text_is_pydoc():
    text = load_text()
    assert len(text) > 100_000 and "The" in text


def test_missing_text_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_text(tmp_path / "none.txt")


def test_windows_deterministic(loaded):
    tok = loaded.tokenizer
    a = token_windows(tok, 3, 256, seed=1)
    b = token_windows(tok, 3, 256, seed=1)
    c = token_windows(tok, 3, 256, seed=2)
    assert a.shape == (3, 256) and a.dtype == torch.long
    assert torch.equal(a, b) and not torch.equal(a, c)


def _spans(windows, stream):
    """Start offset of each window inside the token stream."""
    out = []
    for w in windows:
        hits = (stream.unfold(0, len(w), 1) == w).all(1).nonzero().flatten()
        assert len(hits) >= 1
        out.append(int(hits[0]))
    return out


def test_windows_disjoint_within_and_across_splits(loaded):
    tok = loaded.tokenizer
    length = 512
    ev = token_windows(tok, 4, length, split="eval")
    ca = token_windows(tok, 4, length, split="calib")
    ev_stream = corpus_tokens(tok, split="eval")
    ca_stream = corpus_tokens(tok, split="calib")
    starts = sorted(_spans(ev, ev_stream))
    assert all(b - a >= length for a, b in zip(starts, starts[1:], strict=False))
    _spans(ca, ca_stream)
    # No calibration window occurs anywhere in the evaluation split (and vice versa).
    whole = tok(load_text(), add_special_tokens=False)["input_ids"]
    assert torch.equal(torch.cat([ev_stream, ca_stream]), torch.tensor(whole))
    for w in ca:
        assert not (ev_stream.unfold(0, length, 1) == w).all(1).any()
    for w in ev:
        assert not (ca_stream.unfold(0, length, 1) == w).all(1).any()


def test_text_too_short(loaded, tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("only a few words here. " * 20)
    with pytest.raises(ValueError, match="text too short.*windows of 1024"):
        token_windows(loaded.tokenizer, 2, 1024, text_file=f)
    with pytest.raises(ValueError, match="text too short"):
        token_windows(loaded.tokenizer, 11, 8192)  # the pydoc eval split holds 10


def test_bad_split(loaded):
    with pytest.raises(ValueError, match="split"):
        token_windows(loaded.tokenizer, 1, 8, split="train")
