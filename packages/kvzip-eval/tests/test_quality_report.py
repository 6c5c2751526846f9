"""The report's retrieval statistics and its main figure, on a made-up result (no model)."""

import pytest

from kvzip_eval.quality.report import leaves_bf16, retrieval_pooled, retrieval_rows, write_report
from kvzip_eval.quality.stats import wilson
from kvzip_eval.results import provenance


def _fmt(bits, kl, acc, p):
    cell = {"passkey_1": {"1024": acc}}
    return {
        "bits": bits,
        "kl_mean": kl,
        "kl_median": kl,
        "kl_p99": kl,
        "top1_agree": 1 - kl,
        "words_changed": None,
        "identical": None,
        "retrieval": cell,
        "retrieval_ci95": {"passkey_1": {"1024": wilson(round(acc * 100), 100)}},
        "retrieval_n": {"passkey_1": {"1024": 100}},
        "retrieval_p_vs_bf16": {"passkey_1": {"1024": p}},
        "kl_by_position": [kl] * 8,
    }


@pytest.fixture
def result():
    return {
        "model": {"name": "tiny", "source": "-", "identity": "x"},
        "text": "pydoc_data.topics",
        "settings": {
            "kl_windows": 1,
            "kl_length": 8,
            "prompts": 0,
            "new_tokens": 4,
            "retrieval_samples": 100,
            "retrieval_lengths": [1024],
            "tasks": ["passkey_1"],
            "seed": 0,
        },
        "formats": {
            "bf16": _fmt(16, 0.0, 0.95, 1.0),
            "fp8": _fmt(8, 0.01, 0.94, 1.0),
            "int4": _fmt(4.25, 0.13, 0.70, 1e-5),
        },
        "reference": {"retrieval": {"passkey_1": {"1024": 0.95}}},
        "provenance": provenance(),
    }


def test_pooled_and_leaves(result):
    acc, ci = retrieval_pooled(result["formats"]["int4"])
    assert acc == pytest.approx(0.70) and ci == pytest.approx(wilson(70, 100))
    lines = leaves_bf16(result)
    assert len(lines) == 1 and lines[0].startswith("int4 leaves bf16 on passkey_1 at 1024")
    rows = {r["format"]: r["1024"] for r in retrieval_rows(result)}
    assert rows["int4"].startswith("0.70* [") and rows["fp8"].startswith("0.94 [")
    assert retrieval_pooled({"retrieval": {}}) is None  # results without retrieval


def test_report_has_every_format_in_the_frontier(result, tmp_path):
    md = write_report(result, tmp_path).read_text()
    assert (tmp_path / "frontier.png").stat().st_size > 10_000
    assert "int4 leaves bf16 on passkey_1 at 1024 tokens: 0.70 vs 0.95" in md
    assert "100 samples per task and length" in md
