"""Greedy generation with the KV cache read through a format (prefill and decode alike)."""

from __future__ import annotations

import torch

from kvzip_eval.quality.hook import FormatCache


def chat_ids(tokenizer, user: str, assistant_prefix: str = "") -> list[int]:
    """Token ids of a one-turn chat prompt (the model's chat template where it has one)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False
        )
    else:
        text = user + "\n"
    return tokenizer(text + assistant_prefix, add_special_tokens=False)["input_ids"]


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
    """Greedy continuations (new token ids, cut at the first EOS) of each prompt.

    Prompts run in left-padded batches of ``batch_size`` (in the order given: callers sort
    by length to waste little on padding). Returns the continuations and the names of the
    ``probes`` that were bit-exact on every K/V of this run.
    """
    tok = loaded.tokenizer
    model = loaded.model
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    if not eos_ids and tok.eos_token_id is not None:
        eos_ids = {tok.eos_token_id}
    exact = set(probes or {})
    outs: list[list[int]] = []
    for s in range(0, len(prompts), batch_size):
        batch = prompts[s : s + batch_size]
        width = max(len(p) for p in batch)
        pads = [width - len(p) for p in batch]
        dev = model.device
        ids = torch.tensor([[pad_id] * n + p for n, p in zip(pads, batch, strict=True)], device=dev)
        mask = torch.tensor(
            [[0] * n + [1] * len(p) for n, p in zip(pads, batch, strict=True)], device=dev
        )
        cache = FormatCache(
            model.config, fmt, pad=pads, probes={k: probes[k] for k in exact} if probes else None
        )
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
            eos_token_id=sorted(eos_ids) or None,
        )
        exact &= cache.exact
        for row in out[:, width:].tolist():
            cut = next((i for i, t in enumerate(row) if t in eos_ids), len(row))
            outs.append(row[:cut])
        if on_batch is not None:
            on_batch(len(batch))
    return outs, exact
