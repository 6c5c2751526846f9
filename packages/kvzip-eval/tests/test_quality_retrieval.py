import re

import pytest
from _formats import Damaged

from kvzip_eval.quality.generate import generate
from kvzip_eval.quality.retrieval import (
    ANSWER_TOKENS,
    CITIES,
    COLORS,
    DEFAULT_TASKS,
    KEYED,
    KEYED_TEXT,
    NOUNS,
    TASKS,
    Sample,
    make_sample,
    make_samples,
    score,
)
from kvzip_formats import get_format

UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"


@pytest.mark.parametrize("task", TASKS)
def test_deterministic_and_sized(loaded, task):
    tok = loaded.tokenizer
    a = make_sample(tok, task, 600, 0, seed=1)
    assert a == make_sample(tok, task, 600, 0, seed=1)
    assert a.prompt_ids != make_sample(tok, task, 600, 0, seed=2).prompt_ids
    assert a.prompt_ids != make_sample(tok, task, 600, 1, seed=1).prompt_ids
    assert 0.85 * 600 <= len(a.prompt_ids) <= 600
    text = tok.decode(list(a.prompt_ids))
    if task in KEYED:
        assert text.count(f"{a.key} is") >= 2  # the needle is in the haystack
        assert text.count(f" {a.answer}.") >= 1  # with its value
        assert text.rstrip().endswith(f"{a.key} is") or text.rstrip().endswith("kept in")
    else:
        assert f"for {a.key} is: {a.answer}." in text  # the needle is in the haystack
        assert text.count(f"for {a.key} is:") == 1  # and its key is unique


def test_task_shapes(loaded):
    tok = loaded.tokenizer
    mk1 = tok.decode(list(make_sample(tok, "niah_multikey_1", 800, 0).prompt_ids))
    assert mk1.count("One of the special magic numbers for") == 4  # 1 target + 3 distractors
    mk2 = make_sample(tok, "niah_multikey_2", 800, 0)
    assert re.fullmatch(r"[a-z]+-[a-z]+", mk2.key) and re.fullmatch(r"\d{7}", mk2.answer)
    assert tok.decode(list(mk2.prompt_ids)).count("One of the special magic numbers") > 10
    mk3 = make_sample(tok, "niah_multikey_3", 800, 0)
    assert re.fullmatch(UUID, mk3.key) and re.fullmatch(UUID, mk3.answer)


def test_keyed_task_shapes(loaded):
    tok = loaded.tokenizer
    for task, kinds in KEYED.items():
        smp = make_sample(tok, task, 700, 3)
        text = tok.decode(list(smp.prompt_ids))
        needles = [KEYED_TEXT[k][0].split("{key}")[0] for k in kinds]
        for k in set(kinds):  # each kind's needles, plus the asked one's answer prefix
            stem = KEYED_TEXT[k][2].split("{key}")[0]
            asked = text.rstrip().endswith(KEYED_TEXT[k][2].format(key=smp.key))
            assert text.count(stem) >= kinds.count(k) + asked, (task, k)
        assert smp.key in NOUNS and len(needles) == len(kinds)
        assert re.fullmatch(r"\d{5}", smp.answer) or smp.answer in COLORS + CITIES
    assert set(DEFAULT_TASKS) <= set(KEYED)


def test_errors(loaded):
    with pytest.raises(ValueError, match="unknown retrieval task"):
        make_sample(loaded.tokenizer, "niah_single_1", 512, 0)
    with pytest.raises(ValueError, match="too short"):
        make_sample(loaded.tokenizer, "niah_multikey_1", 64, 0)


def test_score():
    s = Sample("niah_multikey_1", 512, 0, "a-b", "1234567", ())
    assert score(s, " 1234567.") and score(s, "It is 1234567")
    assert not score(s, " 1234568.") and not score(s, "")
    assert not score(s, " 12345678.")  # a whole number, not a part of a longer one
    c = Sample("color_3", 512, 0, "lamp", "red", ())
    assert score(c, " red.") and score(c, " Red") and not score(c, " reddish")


def test_bf16_answers_scored_and_damaged_format_lower(loaded):
    # On 400-token mixed_3 the bf16 model answers these seeds correctly (checked by
    # reading its answers); a codec that keeps only signs loses them.
    samples = make_samples(loaded.tokenizer, ["mixed_3"], [400], 2, seed=0)
    prompts = [list(s.prompt_ids) for s in samples]
    new = ANSWER_TOKENS["mixed_3"]

    def accuracy(fmt):
        outs, _ = generate(loaded, prompts, fmt, max_new_tokens=new, batch_size=2)
        texts = [loaded.tokenizer.decode(o, skip_special_tokens=True) for o in outs]
        return sum(score(s, t) for s, t in zip(samples, texts, strict=True)) / len(samples), texts

    ref, texts = accuracy(None)
    assert ref == 1.0, texts
    assert accuracy(get_format("bf16"))[0] == 1.0
    bad, bad_texts = accuracy(Damaged())
    assert bad < ref, bad_texts
