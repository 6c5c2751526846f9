"""Moved to ``kvzip_kernels.window`` (it needs no vLLM); this module re-exports it for imports
of ``kvzip_vllm.window``."""

from kvzip_kernels.window import (  # noqa: F401
    DEFAULT_SLOT_TOKENS,
    StepWindow,
    WindowPool,
    plan_window,
    window_reserve_bytes,
)
