import json

import pytest

from kvzip_eval.quality.words import file_prompts, summarize, words_changed


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
    assert s == {"words_changed": pytest.approx((0 + 0.5) / 2), "identical": 0.5}
    with pytest.raises(ValueError, match="as many outputs"):
        summarize(["a"], [])


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
