"""``benchmarks/gpu_e2e.py`` under tensor parallelism: the tier's per-rank files (``stats.json``
-> ``stats.rank<r>.json``, as ``tier.worker`` names them) merged so that the scenario waits for
and asserts on the weakest rank, and every rank's own figures are kept."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_e2e  # noqa: E402


@pytest.fixture
def tp2(monkeypatch):
    monkeypatch.setattr(gpu_e2e, "TP", 2)


def test_one_rank_reads_the_file_itself(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_e2e, "TP", 1)
    (tmp_path / "s.json").write_text(json.dumps({"blocks_held": 3}))
    assert gpu_e2e._ranks(tmp_path / "s.json") == {"blocks_held": 3}


def test_two_ranks_merge_to_the_weakest_and_the_sums(tmp_path, tp2):
    (tmp_path / "s.rank0.json").write_text(
        json.dumps({"blocks_held": 8, "tokens_restored": 100, "differ": 0, "raw_bytes_held": 5})
    )
    (tmp_path / "s.rank1.json").write_text(
        json.dumps({"blocks_held": 6, "tokens_restored": 120, "differ": 1, "raw_bytes_held": 7})
    )
    got = gpu_e2e._ranks(tmp_path / "s.json")
    assert got["blocks_held"] == 6 and got["tokens_restored"] == 100
    assert got["differ"] == 1 and got["raw_bytes_held"] == 12
    assert [r["blocks_held"] for r in got["ranks"]] == [8, 6]


def test_a_rank_without_its_file_counts_as_nothing_held(tmp_path, tp2):
    (tmp_path / "v.rank0.json").write_text(json.dumps({"checked": 4, "equal": 4}))
    got = gpu_e2e._ranks(tmp_path / "v.json")
    assert got["checked"] == 0 and got["equal"] == 0 and got["ranks"][1] == {}
