"""The one-time calibration of the compact formats: ``fit(loaded, windows) -> Calibration``.

Streams token windows through the model's layers in a float64 forward that gives the same
bits on any CPU (``kvzip_eval.calibrate.exact``), and accumulates from each layer's queries,
keys (both after RoPE) and values the per-channel statistics that
``kvzip_formats.calibration`` stores (spec/calibration.md).
"""

from kvzip_eval.calibrate.fit import fit, model_record

__all__ = ["fit", "model_record"]
