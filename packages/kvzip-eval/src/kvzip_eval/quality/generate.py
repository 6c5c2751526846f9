"""Greedy generation with the KV cache read through a format (prefill and decode alike).

Batch-invariant by construction: a prompt's continuation does not depend on which other
prompts share its batch. Every forward has one shape per prompt length bucket: a batch is
always ``batch_size`` rows (short batches are filled with copies of a real row, whose output
is dropped) of ``width(len(prompt))`` columns, the prompt left-padded to the next multiple of
``WIDTH_STEP`` tokens. A row's arithmetic (matmuls, attention, the format's per-token round
trip) then runs with the same kernels on the same values whatever the other rows hold, so
its greedy tokens are bit-identical in any batch composition, on the CPU and on CUDA (where
generation also asks torch for deterministic algorithms). Prompts of one bucket are batched
together; a prompt's output depends only on (prompt, format, max_new_tokens, batch_size).
"""

from __future__ import annotations

import contextlib
import os

import torch

from kvzip_eval.quality import window
from kvzip_eval.quality.hook import FormatCache

#: Prompts are left-padded to the next multiple of this many tokens (one shape per bucket).
WIDTH_STEP = 64


def chat_ids(tokenizer, user: str, assistant_prefix: str = "") -> list[int]:
    """Token ids of a one-turn chat prompt (the model's chat template where it has one)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False
        )
    else:
        text = user + "\n"
    return tokenizer(text + assistant_prefix, add_special_tokens=False)["input_ids"]


def width(n: int) -> int:
    """The padded width of a prompt of ``n`` tokens."""
    return -(-n // WIDTH_STEP) * WIDTH_STEP


@contextlib.contextmanager
def deterministic(device: torch.device):
    """On CUDA: deterministic algorithms (cuBLAS needs CUBLAS_WORKSPACE_CONFIG set before it
    starts; ``kvzip eval`` sets it). The CPU's kernels are deterministic for a fixed shape."""
    if device.type != "cuda":
        yield
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was = torch.are_deterministic_algorithms_enabled()
    warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


def batches(prompts: list[list[int]], batch_size: int) -> list[list[int]]:
    """Indices of ``prompts`` grouped by padded width, ``batch_size`` at most per group, in
    order of width then index (deterministic)."""
    by_width: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_width.setdefault(width(len(p)), []).append(i)
    out = []
    for w in sorted(by_width):
        idx = by_width[w]
        out += [idx[s : s + batch_size] for s in range(0, len(idx), batch_size)]
    return out


@torch.no_grad()
def generate(
    loaded,
    prompts: list[list[int]],
    fmt=None,
    *,
    max_new_tokens: int,
    batch_size: int = 8,
    probes: dict | None = None,
    on_batch=None,
) -> tuple[list[list[int]], set]:
    """Greedy continuations (new token ids, cut at the first EOS) of each prompt, in the order
    given. Returns them and the names of the ``probes`` that were bit-exact on every K/V of
    this run (real rows and fill rows alike: fill rows copy real ones)."""
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(
            f"batch_size and max_new_tokens must be >= 1, got {batch_size}, {max_new_tokens}"
        )
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt")
    tok = loaded.tokenizer
    model = loaded.model
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    if not eos_ids and tok.eos_token_id is not None:
        eos_ids = {tok.eos_token_id}
    exact = set(probes or {})
    outs: list[list[int] | None] = [None] * len(prompts)
    dev = model.device
    with deterministic(dev):
        for idx in batches(prompts, batch_size):
            rows = [prompts[i] for i in idx]
            rows += [rows[-1]] * (batch_size - len(rows))  # fill rows: same shape every batch
            w = width(max(len(p) for p in rows))
            pads = [w - len(p) for p in rows]
            ids = torch.tensor(
                [[pad_id] * n + p for n, p in zip(pads, rows, strict=True)], device=dev
            )
            mask = torch.tensor(
                [[0] * n + [1] * len(p) for n, p in zip(pads, rows, strict=True)], device=dev
            )
            cache = FormatCache(
                model.config,
                fmt,
                pad=pads,
                probes={k: probes[k] for k in exact} if probes else None,
            )
            with window.reading(cache):
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    past_key_values=cache,
                    max_new_tokens=max_new_tokens,
                    min_new_tokens=0,
                    do_sample=False,
                    temperature=None,
                    top_p=None,
                    top_k=None,
                    pad_token_id=pad_id,
                    # a row that ends is fed pads while the others go on: no effect on them
                    eos_token_id=sorted(eos_ids) or None,
                )
            exact &= cache.exact
            for i, row in zip(idx, out[:, w:].tolist(), strict=False):
                cut = next((j for j, t in enumerate(row) if t in eos_ids), len(row))
                outs[i] = row[:cut]
            if on_batch is not None:
                on_batch(len(idx))
    return outs, exact
