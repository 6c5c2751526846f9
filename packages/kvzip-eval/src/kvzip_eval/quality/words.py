"""Words changed: greedy outputs of a format against the bf16 outputs, word by word."""

from __future__ import annotations

import json
from pathlib import Path

from rapidfuzz.distance import Levenshtein

from kvzip_eval.corpus import token_windows
from kvzip_eval.quality.generate import chat_ids
from kvzip_eval.quality.stats import mean_ci95, wilson

#: Instructions the generated prompts rotate through (each followed by a passage).
INSTRUCTIONS = (
    "Summarize the following passage in a few sentences.",
    "Explain the following passage in simple words.",
    "List the key points of the following passage.",
    "Write three questions a reader might ask about the following passage, and answer them.",
)


def words(text: str) -> list[str]:
    """Whitespace-separated words (punctuation stays attached, so it counts as a change)."""
    return text.split()


def words_changed(reference: str, output: str) -> float:
    """Word-level edit distance from ``reference`` to ``output``, as a share of the reference's
    words (0 = same words; can exceed 1 when the output is much longer)."""
    ref = words(reference)
    dist = Levenshtein.distance(ref, words(output))
    if not ref:
        return 0.0 if dist == 0 else 1.0
    return dist / len(ref)


def first_departure(ref_ids, out_ids) -> int:
    """Index of the first generated token where ``out_ids`` departs from ``ref_ids``; the
    length of the shorter when one is a prefix of the other (equal outputs: their length, a
    value censored at the generation length)."""
    for i, (a, b) in enumerate(zip(ref_ids, out_ids, strict=False)):
        if a != b:
            return i
    return min(len(ref_ids), len(out_ids))


def summarize(references: list[str], outputs: list[str], ref_ids=None, out_ids=None) -> dict:
    """Mean per-prompt words changed (bootstrap 95% interval over prompts) and the share of
    outputs identical to the reference (Wilson 95% interval); with token ids, also the mean
    position of the first token that departs from the reference (``first_departure``)."""
    if len(references) != len(outputs) or not references:
        raise ValueError(
            f"need as many outputs as references (>0), got {len(outputs)} and {len(references)}"
        )
    changed = [words_changed(r, o) for r, o in zip(references, outputs, strict=True)]
    if ref_ids is not None:
        same = [list(a) == list(b) for a, b in zip(ref_ids, out_ids, strict=True)]
    else:
        same = [r == o for r, o in zip(references, outputs, strict=True)]
    out = {
        "words_changed": sum(changed) / len(changed),
        "words_changed_ci95": mean_ci95(changed),
        "identical": sum(same) / len(same),
        "identical_ci95": wilson(sum(same), len(same)),
    }
    if ref_ids is not None:
        dep = [first_departure(list(a), list(b)) for a, b in zip(ref_ids, out_ids, strict=True)]
        out["first_departure"] = sum(dep) / len(dep)
        out["first_departure_ci95"] = mean_ci95(dep)
    return out


def corpus_prompts(tokenizer, n: int, passage_tokens: int, *, text_file=None, seed: int = 0):
    """``n`` prompts: an instruction and a passage of ``passage_tokens`` tokens from the
    evaluation split (deterministic in the seed)."""
    wins = token_windows(tokenizer, n, passage_tokens, text_file=text_file, seed=seed + 7919)
    out = []
    for i, w in enumerate(wins):
        passage = tokenizer.decode(w.tolist(), skip_special_tokens=True).strip()
        out.append(f"{INSTRUCTIONS[i % len(INSTRUCTIONS)]}\n\n{passage}")
    return out


def file_prompts(path: str | Path, n: int | None = None) -> list[str]:
    """Prompts from a JSON-lines file, one ``{"prompt": "..."}`` per line."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"prompts file {str(path)!r} does not exist")
    prompts = []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise ValueError(f'{path}:{i}: each line must be an object {{"prompt": "..."}}')
        prompts.append(obj["prompt"])
    if not prompts:
        raise ValueError(f"prompts file {str(path)!r} holds no prompts")
    return prompts[:n] if n else prompts


def prompt_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    return [chat_ids(tokenizer, p) for p in prompts]
