"""Moved to :mod:`kvzip_vllm.core.cuda_pipeline` (the tier core, importable without vLLM).

This name is the same module object, so imports and monkeypatching through it reach the core's.
"""

import sys

from kvzip_vllm.core import cuda_pipeline as _core

sys.modules[__name__] = _core
