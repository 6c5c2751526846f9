"""A batched decode split at its launches (:func:`kvzip_lossless.prepare_decode_batch`): the
object both the CPU path (``batch``) and the GPU path (``gpu_batch``) return."""

from __future__ import annotations

import torch


class PreparedDecode:
    """A :func:`~kvzip_lossless.decode_batch` whose host work is done and whose descriptors
    are ready (uploaded on the stream current at the prepare, or left in page-locked host
    memory for the CUDA decoder to read): :meth:`run` only launches the kernels, on the stream
    current then, reading ``data`` at that point. Keep the object (or the stream's work) alive
    until the kernels have run."""

    def __init__(self, out: torch.Tensor, launch, keep=()):
        self.out = out
        self._launch = launch
        self._keep = keep  # host buffers the kernels read: alive as long as this object
        self._ran = False

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Launch the decode; returns ``(out, bad)`` as ``decode_batch`` does. Once only."""
        if self._ran:
            raise RuntimeError("this prepared decode has run already: prepare it again")
        self._ran = True
        return self.out, self._launch()
