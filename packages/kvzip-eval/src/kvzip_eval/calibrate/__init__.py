"""The one-time calibration of the compact formats: ``fit(loaded, windows) -> Calibration``.

Streams token windows through the model with an attention hook that sees each layer's
queries, keys (both after RoPE) and values, and accumulates the per-channel statistics that
``kvzip_formats.calibration`` stores (spec/calibration.md).
"""

from kvzip_eval.calibrate.fit import fit, model_record

__all__ = ["fit", "model_record"]
