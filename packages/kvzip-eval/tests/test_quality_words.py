import json

import pytest

from kvzip_eval.quality.words import (
    file_prompts,
    first_departure,
    mean_ci95,
    summarize,
    words_changed,
)


@pytest.mark.parametrize(
    ("ref", "out", "expected"),
    [
        ("the cat sat down", "the cat sat down", 0.0),
        ("the cat sat down", "the dog sat down", 0.25),  # one substitution in 4 words
        ("the cat sat down", "the cat sat", 0.25),  # one deletion
        ("the cat sat down", "the big cat sat down", 0.25),  # one insertion
        ("the cat sat down", "down sat cat the", 1.0),  # reversed: 4 edits
        ("a b", "x y z w", 2.0),  # longer output: may exceed 1
        ("the cat.", "the cat", 0.5),  # punctuation is part of the word
        ("  the\ncat \t sat ", "the cat sat", 0.0),  # whitespace only: no change
    ],
)
def test_words_changed_known_strings(ref, out, expected):
    assert words_changed(ref, out) == pytest.approx(expected)


def test_words_changed_empty_reference():
    assert words_changed("", "") == 0.0
    assert words_changed("", "something") == 1.0


def test_summarize_shares():
    s = summarize(["a b c d", "x y"], ["a b c d", "x z"], [[1, 2], [3, 4]], [[1, 2], [3, 5]])
    assert s["words_changed"] == pytest.approx((0 + 0.5) / 2) and s["identical"] == 0.5
    assert s["first_departure"] == (2 + 1) / 2  # identical: its length; then position 1
    for key in ("words_changed", "identical", "first_departure"):
        lo, hi = s[f"{key}_ci95"]
        assert lo <= s[key] <= hi
    with pytest.raises(ValueError, match="as many outputs"):
        summarize(["a"], [])


@pytest.mark.parametrize(
    ("ref", "out", "expected"),
    [
        ([1, 2, 3], [1, 2, 3], 3),  # identical: censored at the length
        ([1, 2, 3], [9, 2, 3], 0),
        ([1, 2, 3], [1, 2, 9, 9], 2),
        ([1, 2, 3], [1, 2], 2),  # stopped early (end of sequence): departs where it stops
        ([], [], 0),
    ],
)
def test_first_departure(ref, out, expected):
    assert first_departure(ref, out) == expected


def test_mean_ci95_covers_and_narrows():
    import numpy as np

    x = np.random.default_rng(1).normal(10.0, 2.0, size=400)
    lo, hi = mean_ci95(x)
    assert lo < 10.0 < hi and hi - lo < 0.6  # ~4 standard errors of 0.1
    lo4, hi4 = mean_ci95(x[:25])
    assert hi4 - lo4 > hi - lo  # fewer prompts, wider interval
    assert mean_ci95([3.0, 3.0]) == [3.0, 3.0]
    assert mean_ci95(x) == [lo, hi]  # seeded: reproducible
    with pytest.raises(ValueError, match="no values"):
        mean_ci95([])


def test_file_prompts(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "one"}) + "\n\n" + json.dumps({"prompt": "two"}) + "\n")
    assert file_prompts(f) == ["one", "two"]
    assert file_prompts(f, 1) == ["one"]
    f.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match=r'p.jsonl:1: each line must be an object \{"prompt"'):
        file_prompts(f)
    f.write_text("not json\n")
    with pytest.raises(ValueError, match="not valid JSON"):
        file_prompts(f)
    with pytest.raises(ValueError, match="does not exist"):
        file_prompts(tmp_path / "none.jsonl")
