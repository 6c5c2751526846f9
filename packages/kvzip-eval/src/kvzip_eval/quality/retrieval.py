"""Needle-in-a-haystack retrieval, generated here deterministically from (task, length,
index, seed), with a haystack of corpus prose.

Keyed tasks: needles with plain-noun keys at random depths of the prose; the question comes
before the text and after it, and the model's turn starts with the answer's prefix ("The
pass key for the <key> is"). The protocol runs the two the bf16 SmolLM2-135M passes (>= 0.9,
``DEFAULT_TASKS``; measured in results/quality/retrieval_bf16.md):

- ``passkey_1``: one needle "The pass key for the <key> is <5-digit number>." (single
  needle, number value).
- ``mixed_3``: three needles of three kinds, "The pass key for the <key> is <number>.",
  "The color of the <key> is <color>.", "The <key> is kept in <city>."; one is asked for, the
  other two are distractors (multi-key, number or word values).

Harder ones, which the 135M model fails (bf16 at 1,024 tokens on 16 samples: 0.56 and 0.38):
``passkey_3`` (three pass-key needles, one asked for) and ``color_3`` (three colors).
And in the manner of RULER's ``niah_multikey_1..3`` (bf16 0.0-0.3 past 1,024 tokens):

- ``niah_multikey_1``: a haystack of corpus prose with 4 needles "One of the special magic
  numbers for <key> is: <value>." at random depths; word keys (two corpus words joined by a
  hyphen), 7-digit number values; one needle is asked for, the other 3 are distractors.
- ``niah_multikey_2``: the haystack is made of needles only (word keys, number values).
- ``niah_multikey_3``: the haystack is made of needles only, with UUID keys and UUID values.

A sample is scored correct when the expected value appears in the generated answer as a
whole word.
"""

from __future__ import annotations

import functools
import random
import re
import uuid
from dataclasses import dataclass

from kvzip_eval.corpus import corpus_tokens, load_text
from kvzip_eval.quality.generate import chat_ids

#: Keyed needle tasks: the kind of each needle (a key is asked for one of them).
KEYED = {
    "passkey_1": ("number",),
    "mixed_3": ("number", "color", "city"),
    "passkey_3": ("number", "number", "number"),
    "color_3": ("color", "color", "color"),
}
#: What the protocol runs: the tasks bf16 passes (>= 0.9; results/quality/retrieval_bf16.md).
DEFAULT_TASKS = ("passkey_1", "mixed_3")
TASKS = (*KEYED, "niah_multikey_1", "niah_multikey_2", "niah_multikey_3")
#: New tokens allowed for the answer: SmolLM2 writes a digit per token, a UUID in ~25.
ANSWER_TOKENS = {
    "passkey_1": 8,
    "mixed_3": 8,
    "passkey_3": 8,
    "color_3": 4,
    "niah_multikey_1": 16,
    "niah_multikey_2": 16,
    "niah_multikey_3": 40,
}
#: Keys of the keyed tasks: plain nouns, which the small model tells apart better than the
#: corpus's own words (bf16 on passkey_3 at 2,048 tokens: 4 of 6 with corpus-word keys).
NOUNS = (
    "apple",
    "river",
    "stone",
    "garden",
    "window",
    "candle",
    "forest",
    "bridge",
    "mountain",
    "kitchen",
    "lantern",
    "harbor",
    "pencil",
    "violin",
    "tiger",
    "rabbit",
    "castle",
    "meadow",
    "island",
    "saddle",
    "anchor",
    "basket",
    "feather",
    "hammer",
    "jacket",
    "ladder",
    "mirror",
    "needle",
    "orchard",
    "pillow",
    "rocket",
    "shovel",
    "teapot",
    "tunnel",
    "wagon",
    "whistle",
    "barrel",
    "blanket",
    "button",
    "carpet",
    "cherry",
    "dolphin",
    "engine",
    "falcon",
    "glove",
    "helmet",
    "kettle",
    "lemon",
    "magnet",
    "napkin",
    "oyster",
    "parrot",
    "pepper",
    "rope",
    "sandal",
    "spoon",
    "tractor",
    "umbrella",
    "walnut",
    "zebra",
)
COLORS = ("red", "blue", "green", "yellow", "purple", "orange", "black", "white", "brown", "pink")
CITIES = ("Paris", "London", "Tokyo", "Cairo", "Lima", "Oslo", "Madrid", "Berlin", "Rome", "Dublin")
KEYED_INTRO = (
    "There is important information hidden inside a lot of irrelevant text. Find it and "
    "memorize it. {question}"
)
#: Per needle kind: the needle, the question, and the answer prefix of the model's turn.
KEYED_TEXT = {
    "number": (
        "The pass key for the {key} is {value}.",
        "What is the pass key for the {key}?",
        "The pass key for the {key} is",
    ),
    "color": (
        "The color of the {key} is {value}.",
        "What is the color of the {key}?",
        "The color of the {key} is",
    ),
    "city": (
        "The {key} is kept in {value}.",
        "In which city is the {key} kept?",
        "The {key} is kept in",
    ),
}
MK1_NEEDLES = 4

INTRO = (
    "Some special magic {plural} are hidden in the text below. Memorize them: afterwards "
    "you will be asked for one of them."
)
NEEDLE = "One of the special magic {plural} for {key} is: {value}."
QUESTION = "What is the special magic {singular} for {key} mentioned in the text above?"
ANSWER_PREFIX = "The special magic {singular} for {key} mentioned in the text is:"


@dataclass(frozen=True)
class Sample:
    task: str
    length: int
    index: int
    key: str
    answer: str
    prompt_ids: tuple[int, ...]


@functools.lru_cache(maxsize=4)
def _key_words(text_file) -> tuple[str, ...]:
    """Distinct lowercase alphabetic corpus words of 4-10 letters, sorted (deterministic)."""
    found = set(re.findall(r"\b[a-z]{4,10}\b", load_text(text_file)))
    if len(found) < 50:
        raise ValueError(
            f"the text has only {len(found)} distinct lowercase words of 4-10 letters; "
            "retrieval keys need at least 50"
        )
    return tuple(sorted(found))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _word_key(rng: random.Random, words: tuple[str, ...]) -> str:
    return f"{rng.choice(words)}-{rng.choice(words)}"


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _render(tok, task: str, body: str, key: str) -> list[int]:
    plural, singular = ("uuids", "uuid") if task == "niah_multikey_3" else ("numbers", "number")
    user = "\n\n".join(
        [INTRO.format(plural=plural), body, QUESTION.format(singular=singular, key=key)]
    )
    return chat_ids(tok, user, " " + ANSWER_PREFIX.format(singular=singular, key=key))


def _needle(task: str, key: str, value: str) -> str:
    plural = "uuids" if task == "niah_multikey_3" else "numbers"
    return NEEDLE.format(plural=plural, key=key, value=value)


def make_sample(
    tokenizer, task: str, length: int, index: int, *, seed: int = 0, text_file=None
) -> Sample:
    """One sample whose prompt is at most ``length`` tokens (and close to it)."""
    if task not in TASKS:
        raise ValueError(f"unknown retrieval task {task!r}; tasks: {', '.join(TASKS)}")
    rng = random.Random(f"{seed}/{task}/{length}/{index}")
    words = _key_words(text_file)
    if task in KEYED:
        return _keyed_sample(tokenizer, task, length, index, rng, NOUNS, text_file)
    if task == "niah_multikey_3":
        new_pair = lambda: (_uuid(rng), _uuid(rng))  # noqa: E731
    else:
        new_pair = lambda: (_word_key(rng, words), _number(rng))  # noqa: E731

    if task == "niah_multikey_1":
        pairs = {}
        while len(pairs) < MK1_NEEDLES:
            k, v = new_pair()
            pairs[k] = v
        key = rng.choice(list(pairs))
        needles = [_needle(task, k, v) for k, v in pairs.items()]
        stream = corpus_tokens(tokenizer, text_file=text_file, split="eval")
        probe = _render(tokenizer, task, "\n".join(needles), key)
        budget = length - len(probe) - 8
        if budget < MK1_NEEDLES * 4:
            raise ValueError(f"length {length} is too short for {task} (needs > {len(probe) + 24})")
        if budget > len(stream):
            raise ValueError(
                f"text too short: {task} at length {length} needs {budget} haystack tokens, "
                f"the evaluation split has {len(stream)}"
            )
        start = rng.randint(0, len(stream) - budget)
        cuts = sorted(rng.randint(0, budget) for _ in range(MK1_NEEDLES))
        for _ in range(4):
            seg = stream[start : start + budget].tolist()
            bounds = [0, *[min(c, budget) for c in cuts], budget]
            parts = [
                tokenizer.decode(seg[a:b], skip_special_tokens=True)
                for a, b in zip(bounds, bounds[1:], strict=False)
            ]
            body = parts[0]
            for needle, part in zip(needles, parts[1:], strict=True):
                body += f" {needle} " + part
            ids = _render(tokenizer, task, body.strip(), key)
            if len(ids) <= length:
                break
            budget -= len(ids) - length
            cuts = [min(c, budget) for c in cuts]
        answer = pairs[key]
    else:
        pairs: dict[str, str] = {}
        k0, v0 = new_pair()
        per = len(tokenizer(_needle(task, k0, v0) + "\n", add_special_tokens=False)["input_ids"])
        base = len(_render(tokenizer, task, "", k0))
        count = max(2, (length - base) // per)
        while True:
            while len(pairs) < count:
                k, v = new_pair()
                pairs[k] = v
            keys = list(pairs)[:count]
            key = keys[rng.randrange(len(keys))] if index >= 0 else keys[0]
            body = "\n".join(_needle(task, k, pairs[k]) for k in keys)
            ids = _render(tokenizer, task, body, key)
            if len(ids) <= length or count <= 2:
                break
            count -= max(1, (len(ids) - length) // per + 1)
        answer = pairs[key]
    if len(ids) > length:
        raise ValueError(f"length {length} is too short for {task}")
    return Sample(task, length, index, key, answer, tuple(ids))


def _value(rng: random.Random, kind: str) -> str:
    if kind == "number":
        return str(rng.randint(10_000, 99_999))
    return rng.choice(COLORS if kind == "color" else CITIES)


def _keyed_sample(tokenizer, task, length, index, rng, words, text_file) -> Sample:
    kinds = KEYED[task]
    keys: list[str] = []
    while len(keys) < len(kinds):
        k = rng.choice(words)
        if k not in keys:
            keys.append(k)
    values = [_value(rng, kind) for kind in kinds]
    j = rng.randrange(len(kinds))
    key, answer, kind = keys[j], values[j], kinds[j]
    needles = [
        KEYED_TEXT[kd][0].format(key=k, value=v)
        for kd, k, v in zip(kinds, keys, values, strict=True)
    ]
    rng.shuffle(needles)  # the kinds at random depths, not in a fixed order
    question = KEYED_TEXT[kind][1].format(key=key)

    def render(body: str) -> list[int]:
        user = "\n\n".join([KEYED_INTRO.format(question=question), body, question])
        return chat_ids(tokenizer, user, " " + KEYED_TEXT[kind][2].format(key=key))

    stream = corpus_tokens(tokenizer, text_file=text_file, split="eval")
    budget = length - len(render("\n".join(needles))) - 8
    if budget < 16:
        raise ValueError(f"length {length} is too short for {task}")
    if budget > len(stream):
        raise ValueError(
            f"text too short: {task} at length {length} needs {budget} haystack tokens, "
            f"the evaluation split has {len(stream)}"
        )
    start = rng.randint(0, len(stream) - budget)
    cuts = sorted(rng.randint(0, budget) for _ in needles)
    for _ in range(4):
        seg = stream[start : start + budget].tolist()
        bounds = [0, *[min(c, budget) for c in cuts], budget]
        parts = [
            tokenizer.decode(seg[a:b], skip_special_tokens=True)
            for a, b in zip(bounds, bounds[1:], strict=False)
        ]
        body = parts[0]
        for needle, part in zip(needles, parts[1:], strict=True):
            body += f" {needle} " + part
        ids = render(body.strip())
        if len(ids) <= length:
            break
        budget -= len(ids) - length
    if len(ids) > length:
        raise ValueError(f"length {length} is too short for {task}")
    return Sample(task, length, index, key, answer, tuple(ids))


def make_samples(tokenizer, tasks, lengths, n: int, *, seed: int = 0, text_file=None):
    return [
        make_sample(tokenizer, t, L, i, seed=seed, text_file=text_file)
        for t in tasks
        for L in lengths
        for i in range(n)
    ]


def score(sample: Sample, answer_text: str) -> bool:
    """Correct when the expected value appears in the answer as a whole word
    (case-insensitive): "12345" is not found in "123456", "red" not in "reddish"."""
    pat = r"(?<![0-9A-Za-z])" + re.escape(sample.answer.lower()) + r"(?![0-9A-Za-z])"
    return re.search(pat, answer_text.lower()) is not None
