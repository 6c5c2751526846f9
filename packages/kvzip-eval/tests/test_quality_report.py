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


def test_report_from_json_counts_a_residual_window_in_its_capacity(result, tmp_path):
    """A report rebuilt from JSON (no format instances: `kvzip report`) takes NAME+rN names:
    the capacity of `int4+r128` is int4's with the window's bf16 copies."""
    from kvzip_eval.quality.window import Windowed
    from kvzip_formats import get_format
    from kvzip_formats.capacity import DEPLOYMENTS, sessions

    result["formats"]["int4+r128"] = _fmt(4.2656, 0.01, 0.9, 0.5)
    result["formats"]["int4-rot"] = _fmt(4.25, 0.06, 0.9, 0.5)  # one size with int4
    md = write_report(result, tmp_path).read_text()
    dep = DEPLOYMENTS[0]
    m = dep.model
    want = {}
    for n, f in (("int4", get_format("int4")), ("int4+r128", Windowed(get_format("int4"), 128))):
        bits = f.bits_per_element(m.head_dim, m.num_layers, num_kv_heads=m.num_kv_heads)
        want[n] = sessions(bits, dep)
    row = next(ln for ln in md.splitlines() if ln.startswith(f"| {m.name} on {dep.gpu} |"))
    header = next(ln for ln in md.splitlines() if ln.startswith("| deployment |"))
    cells = dict(zip(header.strip("|").split("|"), row.strip("|").split("|"), strict=True))
    assert int(cells[" int4 "]) == want["int4"] and int(cells[" int4+r128 "]) == want["int4+r128"]
    assert want["int4+r128"] <= want["int4"]


def test_frontier_labels_do_not_overlap():
    """The 12 formats of the default run (bits and KL of results/quality/first_run_s7 at commit
    7fa2a4a, since superseded by results/quality/default_run_cpu/, whose KLs differ by at most
    0.0022): every label drawn clear of every other label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    from kvzip_eval.quality.report import _label_points

    pts = [
        (16, 1e-3, "bf16"),
        (8, 0.0118, "fp8"),
        (4.25, 0.1410, "int4"),
        (4.25, 0.0618, "int4-rot"),
        (4.125, 0.0726, "turbo4"),
        (4.1251, 0.0605, "4bit"),
        (3.625, 0.0787, "3.5bit"),
        (3.125, 0.1505, "3bit"),
        (4.2656, 0.0044, "int4-rot+r128"),
        (4.1407, 0.0034, "4bit+r128"),
        (3.6407, 0.0048, "3.5bit+r128"),
        (3.1406, 0.0084, "3bit+r128"),
    ]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for b, k, _ in pts:
        ax.scatter(b, k)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    fig.tight_layout()
    _label_points(ax, sorted(pts))
    fig.canvas.draw()
    # the texts themselves (an annotation's own extent includes its leader line)
    boxes = [(t.get_text(), Text.get_window_extent(t)) for t in ax.texts]
    assert len(boxes) == len(pts)
    for i, (n, a) in enumerate(boxes):
        for m, b in boxes[i + 1 :]:
            assert not a.overlaps(b), (n, m)
    plt.close(fig)
