"""benchmarks/restore_host_ops.py counts the host work of a tier restore on the CPU (the H200's
host path, the decoder's launches stubbed). At a tiny shape: the load path launches no kernel
and takes no host synchronisation per chunk (launches grow with the decode groups only, two
synchronisation points per load), and the result files name what a result file must."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the pipeline's decode kernels are Triton kernels here")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "restore_host_ops.py"


def test_restore_host_ops_scale_with_groups_not_chunks(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    args = ["--shapes", "tiny", "--chunks", "4", "16", "32", "--reps", "1", "--no-checker",
            "--out", str(tmp_path), "--name", "r"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((tmp_path / "r.json").read_text())
    for key in ("device", "date", "versions", "command"):
        assert doc[key], key
    rows = {r["chunks"]: r for r in doc["loads"]}
    assert sorted(rows) == [4, 16, 32]
    groups = {4: 1, 16: 1, 32: 2}  # cuda_pipeline: 16 chunks a group
    for n, r in rows.items():
        want = dict.fromkeys(("batch_check", "batch_decode", "batch_fold"), groups[n])
        assert r["decoder_launches"] == want, r
        assert r["host_syncs_total"] == 2, r["host_syncs"]
        assert r["h2d_record_copies"] == groups[n]  # records back to back: one copy a group
        # the scatter: two writes per layer (K and V), whatever the chunks
        assert r["torch_ops"]["index_copy_"] == 2 * r["layers"]
    # 4 and 16 chunks, one group: the same launches; a second group adds a group's few
    assert rows[4]["launches_total"] == rows[16]["launches_total"]
    assert 0 < rows[32]["launches_total"] - rows[16]["launches_total"] < 16
    assert "| tiny | 32 |" in (tmp_path / "r.md").read_text()
