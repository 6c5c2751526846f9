"""The tier under faults on the GPU path (the H200 with vLLM 0.26): ``benchmarks/gpu_faults.py``
in its own process, its result written to ``$KVZIP_RESULTS_DIR``.

    KVZIP_RESULTS_DIR=results/vllm/tier_faults/h200_defaults python -m pytest -m gpu \
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


def test_faults_on_the_gpu_tier_with_vllms_defaults(tmp_path):
    """With every vLLM default on (asynchronous scheduling, compiled with CUDA graphs) and the
    tier's asynchronous loads: a damaged block, an eviction race, a failed store, the tier
    emptied and a request aborted while a load is pending, each recovered exactly."""
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
    e = r["engine"]  # vLLM's settings as the engine used them: its defaults
    assert e["async_scheduling"] is True and e["enforce_eager"] is False, e
    assert e["kv_connector_extra_config"].get("load_mode", "async") == "async", e
    names = {c["case"] for c in r["cases"]}
    for want in ("store fails", "tier reset while its load is pending",
                 "request aborted while its load is pending"):  # fmt: skip
        assert want in names, names
    bad = [c for c in r["cases"] if not c["ok"]]
    assert not bad, bad
    assert proc.returncode == 0, proc.stderr[-4000:]
