"""Real weights in vLLM on a GPU: SmolLM2-135M through vLLM with each compact format, its KL
against vLLM's bf16 run next to what `kvzip eval` (transformers) measures on the same windows
in the same run (``benchmarks/vllm_quality.py``, one process per engine).

The model comes as the pieces ``benchmarks/carry_model.py`` packs (default
``.carry/smollm2/p0`` and ``p1``) or as a folder (``KVZIP_SMOLLM2=DIR``, or a comma-separated
list of piece folders), the calibration from ``KVZIP_SMOLLM2_CALIBRATION`` (default
``.carry/smollm2/calibration``):

    KVZIP_RESULTS_DIR=results/vllm python -m pytest -m gpu \\
        packages/kvzip-vllm/tests/test_vllm_quality_gpu.py
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

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "packages" / "kvzip-vllm" / "benchmarks" / "vllm_quality.py"
FORMATS = ("int4", "4bit", "3.5bit", "3bit")
#: with the residual window the README recommends (compared at decode positions)
WINDOWED = ("4bit+r128",)


def _model_args() -> list[str]:
    spec = os.environ.get("KVZIP_SMOLLM2")
    if spec:
        paths = [Path(p) for p in spec.split(",") if p]
    else:
        paths = [ROOT / ".carry" / "smollm2" / "p0", ROOT / ".carry" / "smollm2" / "p1"]
    if len(paths) == 1 and (paths[0] / "config.json").is_file():
        return ["--model", str(paths[0])]
    missing = [str(p) for p in paths if not (p / "manifest.json").is_file()]
    if missing:
        pytest.skip(f"SmolLM2 not carried to this machine (no pieces in {missing})")
    return ["--pieces", *map(str, paths)]


def test_vllm_logprobs_cost_of_each_format_matches_kvzip_eval(tmp_path):
    calib = os.environ.get("KVZIP_SMOLLM2_CALIBRATION") or str(
        ROOT / ".carry" / "smollm2" / "calibration"
    )
    if not (Path(calib) / "calibration.json").is_file():
        pytest.skip(f"no SmolLM2 calibration at {calib}")
    out = Path(os.environ.get("KVZIP_RESULTS_DIR") or tmp_path)
    cmd = [
        sys.executable,
        str(SCRIPT),
        *_model_args(),
        "--calibration",
        calib,
        "--out",
        str(out),
        "--formats",
        ",".join(FORMATS + WINDOWED),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=560)
    (out / "vllm_quality_test.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"{cmd} failed:\n{proc.stderr[-4000:]}"
    res = json.loads(lines[-1][len("RESULT ") :])
    rows = {r["format"]: r for r in res["rows"]}
    assert sorted(rows) == sorted(FORMATS)
    noise = res["noise"]
    for fmt, r in rows.items():
        # vLLM ran the compact cache: the same KV bytes held more blocks than bf16's
        assert r["kv_blocks_vs_bf16"] > 1.5, r
        # the format costs something measurable in vLLM, more than vLLM's own bf16 noise
        assert r["vllm_kl_topk"] > 4 * max(noise["vllm_bf16_alone_vs_batched"], 1e-6), r
        # and as much as kvzip eval says: within what changing HF's attention kernel alone
        # moves the same measurement, plus two paired standard errors
        assert r["within_impl_change"], (fmt, r)
        assert r["within_noise"], (fmt, r)
    windowed = {r["format"]: r for r in res["window_rows"]}
    assert sorted(windowed) == sorted(WINDOWED)
    for fmt, r in windowed.items():
        assert r["kv_blocks_vs_bf16"] > 1.5, r
        # every window kept its slot: the decode read its last R + 1 tokens in bf16
        assert r["window_pool"]["unplaced"] == 0 and r["window_pool"]["misses"] == 0, r
        assert r["decode_positions"] > 0, r
        # served as the backend serves it, within the two implementations' noise
        assert r["within_noise_served"], (fmt, r)
        # the window is what kvzip eval says it is: well under the format without it
        base = rows[fmt.split("+")[0]]
        assert r["vllm_decode_kl_topk"] < base["vllm_kl_topk"] / 2, (r, base)
