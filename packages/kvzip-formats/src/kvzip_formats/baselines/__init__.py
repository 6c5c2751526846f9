"""Baseline formats: bf16 (reference), fp8, plain int4, rotated int4, TurboQuant-style turbo4."""

from kvzip_formats.base import register_format
from kvzip_formats.baselines.bf16 import BF16
from kvzip_formats.baselines.fp8 import FP8
from kvzip_formats.baselines.int4 import INT4, INT4Rot
from kvzip_formats.baselines.turbo4 import Turbo4

register_format("bf16", lambda calibration=None: BF16())
register_format("fp8", lambda calibration=None: FP8())
register_format("int4", lambda calibration=None: INT4())
register_format("int4-rot", lambda calibration=None: INT4Rot())
register_format("turbo4", lambda calibration=None: Turbo4())

__all__ = ["BF16", "FP8", "INT4", "INT4Rot", "Turbo4"]
