"""The tier under faults on the GPU path (the H200 with vLLM 0.26): ``benchmarks/gpu_faults.py``
in its own process, its result written to ``$KVZIP_RESULTS_DIR``.

    KVZIP_RESULTS_DIR=results/vllm python -m pytest -m gpu \
        packages/kvzip-vllm/tests/test_gpu_faults.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and vLLM"),
]

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_faults.py"


def test_damage_and_eviction_race_on_the_gpu_tier(tmp_path):
    """vLLM's defaults refused (asynchronous scheduling), then each fault recovered exactly."""
    out = Path(os.environ.get("KVZIP_RESULTS_DIR") or tmp_path)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    (out / "gpu_faults.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert (out / "gpu_faults.json").exists(), proc.stderr[-4000:]
    r = json.loads((out / "gpu_faults.json").read_text())
    assert r["policy"] == "recompute" and r["recompute_kv_load_failures"], r
    # vLLM's default scheduling (asynchronous on CUDA) refused at start-up with the remedy;
    # the faults run with vLLM's defaults but for that one setting
    assert r["async_default"]["refused"], r["async_default"]
    assert r["async_scheduling"] is False
    bad = [c for c in r["cases"] if not c["ok"]]
    assert not bad, bad
    assert proc.returncode == 0, proc.stderr[-4000:]
