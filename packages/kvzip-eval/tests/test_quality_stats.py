import pytest

from kvzip_eval.quality.stats import disjoint, mcnemar_p, mean_ci95, wilson


def test_wilson_known_values():
    # Wilson (1927) score interval, z = 1.96: textbook values (e.g. Newcombe 1998, Table I:
    # 81/263 -> 0.2553-0.3662; 0/10 -> 0-0.2775; 10/10 -> 0.7225-1).
    lo, hi = wilson(81, 263)
    assert lo == pytest.approx(0.2553, abs=1e-4) and hi == pytest.approx(0.3662, abs=1e-4)
    assert wilson(0, 10) == pytest.approx([0.0, 0.2775], abs=1e-4)
    assert wilson(10, 10) == pytest.approx([0.7225, 1.0], abs=1e-4)
    a, b = wilson(45, 100), wilson(450, 1000)  # narrows with n, around p
    assert a[0] < b[0] < 0.45 < b[1] < a[1]


def test_wilson_bad_input():
    for k, n in ((1, 0), (-1, 5), (6, 5)):
        with pytest.raises(ValueError, match="0 <= k <= n"):
            wilson(k, n)


def test_mcnemar_exact():
    # 10 discordant pairs all one way: two-sided p = 2 / 2**10
    a = [True] * 10 + [True] * 5
    b = [False] * 10 + [True] * 5
    assert mcnemar_p(a, b) == pytest.approx(2 / 1024)
    assert mcnemar_p(a, a) == 1.0
    # 6 vs 4 discordant: p = 2 * P(X <= 4 | n=10) = 2 * 386/1024, capped at 1
    a = [True] * 6 + [False] * 4
    b = [False] * 6 + [True] * 4
    assert mcnemar_p(a, b) == pytest.approx(min(1.0, 2 * 386 / 1024))
    with pytest.raises(ValueError, match="unequal length"):
        mcnemar_p([True], [True, False])


def test_mean_ci_and_disjoint():
    lo, hi = mean_ci95([1.0, 2.0, 3.0, 4.0] * 10)
    assert lo < 2.5 < hi and mean_ci95([1.0, 2.0, 3.0, 4.0] * 10) == [lo, hi]
    assert disjoint([0.1, 0.2], [0.3, 0.4]) and not disjoint([0.1, 0.3], [0.2, 0.4])
