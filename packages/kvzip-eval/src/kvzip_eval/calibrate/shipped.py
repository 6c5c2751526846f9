"""Calibrations shipped with kvzip-eval, so the first `kvzip eval` need not calibrate.

``kvzip_eval/data/calibration/<model identity>/`` holds the calibration that `kvzip calibrate`
writes for a model (today: the embedded SmolLM2-135M-Instruct), made with the command its
``calibration.json`` records under ``fit``. It is found by the model's identity (a hash of the
config and the weights' contents, ``kvzip_eval.model.model_identity``): a model whose weights
differ in any byte does not match, and is calibrated as before.
"""

from __future__ import annotations

from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parents[1] / "data" / "calibration"
#: How the shipped calibration of the embedded model was made (reproduce it with this).
COMMAND = "kvzip calibrate --out packages/kvzip-eval/src/kvzip_eval/data/calibration/<identity>"


def shipped_calibration(identity: str) -> Path | None:
    """The shipped calibration directory for a model identity, or None."""
    d = SHIPPED_DIR / identity
    return d if (d / "calibration.json").is_file() else None
