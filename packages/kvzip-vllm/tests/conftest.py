"""CPU runs interpret the Triton kernels: TRITON_INTERPRET=1 must be set before anything
(vLLM included) imports triton, so it is set here, before the test modules are imported."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
