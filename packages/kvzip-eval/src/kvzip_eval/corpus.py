"""Held-out text and deterministic token windows.

The default text is Python's own ``pydoc_data.topics`` (English prose shipped with every
Python), its topics joined in sorted key order; users pass ``--text-file`` for their own.
The token stream is split once: the first ``EVAL_SHARE`` of the tokens feed evaluation, the
rest feed calibration, so a calibrated format never sees the text it is scored on.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Literal

import torch

#: Share of the token stream used for evaluation; the rest is the calibration split.
#: pydoc_data.topics is ~120k SmolLM2 tokens: 75% leaves 10 windows of 8,192 for evaluation.
EVAL_SHARE = 0.75

Split = Literal["eval", "calib"]


def load_text(text_file: str | Path | None = None) -> str:
    """The corpus: ``text_file`` (UTF-8) or, by default, Python's ``pydoc_data.topics``."""
    if text_file is None:
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k] for k in sorted(topics))
    p = Path(text_file).expanduser()
    if not p.is_file():
        raise ValueError(f"text_file {str(text_file)!r} does not exist or is not a file")
    return p.read_text(encoding="utf-8", errors="replace")


@functools.lru_cache(maxsize=8)
def _tokens_cached(tokenizer, text_hash: str, text: str) -> torch.Tensor:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def corpus_tokens(
    tokenizer, *, text_file: str | Path | None = None, split: Split = "eval"
) -> torch.Tensor:
    """The token ids of one split of the corpus, ``LongTensor[N]``."""
    if split not in ("eval", "calib"):
        raise ValueError(f"split must be 'eval' or 'calib', got {split!r}")
    text = load_text(text_file)
    tokens = _tokens_cached(tokenizer, hashlib.sha256(text.encode()).hexdigest(), text)
    cut = int(len(tokens) * EVAL_SHARE)
    return tokens[:cut] if split == "eval" else tokens[cut:]


def token_windows(
    tokenizer,
    n: int,
    length: int,
    *,
    text_file: str | Path | None = None,
    split: Split = "eval",
    seed: int = 0,
) -> torch.Tensor:
    """``n`` disjoint windows of ``length`` tokens from one split, ``LongTensor[n, length]``.

    Deterministic in (text, tokenizer, n, length, split, seed): the split is cut into
    ``length``-token slots after a seeded offset and ``n`` slots are drawn by a seeded
    permutation. Raises ``ValueError`` when the split holds fewer than ``n * length`` tokens.
    """
    if n < 1 or length < 1:
        raise ValueError(f"n and length must be positive, got n={n}, length={length}")
    tokens = corpus_tokens(tokenizer, text_file=text_file, split=split)
    slots = len(tokens) // length
    if slots < n:
        src = "pydoc_data.topics" if text_file is None else str(text_file)
        raise ValueError(
            f"text too short: the {split!r} split of {src} has {len(tokens)} tokens, "
            f"{n} windows of {length} tokens need {n * length}; pass a longer --text-file, "
            "fewer windows or shorter ones"
        )
    gen = torch.Generator().manual_seed(seed)
    slack = len(tokens) - slots * length
    offset = int(torch.randint(0, slack + 1, (1,), generator=gen))
    picked = torch.randperm(slots, generator=gen)[:n]
    starts = offset + picked * length
    return torch.stack([tokens[s : s + length] for s in starts.tolist()])
