"""A calibration directory for the tests' compact formats (made once, then cached)."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import cache


@cache
def calibration(fmt: str) -> str | None:
    """A calibration directory for ``fmt`` if it needs one: ``KVZIP_TEST_CALIBRATION``, else
    ``kvzip calibrate`` on the embedded model (4 windows of 1,024 tokens: the fitted statistics
    are per-channel means and second moments), made once into ~/.cache/kvzip/calibration."""
    import kvzip_formats
    from kvzip_formats.calibration import CalibrationError

    if not kvzip_formats.get_format(fmt).needs_calibration:
        return None
    given = os.environ.get("KVZIP_TEST_CALIBRATION")
    if given:
        return given
    from kvzip_eval.model import cache_dir

    out = cache_dir() / "calibration" / "vllm-test"
    try:
        kvzip_formats.get_format(fmt, calibration=out).encode(_probe(), kind="k", layer=0)
    except (CalibrationError, OSError, ValueError):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "kvzip_eval.cli",
                "calibrate",
                "--windows",
                "4",
                "--length",
                "1024",
                "--out",
                str(out),
            ],
            check=True,
            timeout=600,
        )
        kvzip_formats.get_format(fmt, calibration=out).encode(_probe(), kind="k", layer=0)
    return str(out)


def _probe():
    import torch

    return torch.ones(1, 3, 64, dtype=torch.bfloat16)  # the embedded model's KV heads, d
