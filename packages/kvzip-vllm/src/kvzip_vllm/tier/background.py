"""Moved to :mod:`kvzip_vllm.core.background` (the tier core, importable without vLLM).

This name is the same module object, so imports and monkeypatching through it reach the core's.
"""

import sys

from kvzip_vllm.core import background as _core

sys.modules[__name__] = _core
