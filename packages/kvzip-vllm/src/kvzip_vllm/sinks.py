"""Moved to ``kvzip_kernels.sinks`` (it needs no vLLM); this module re-exports it for imports of
``kvzip_vllm.sinks``."""

from kvzip_kernels.sinks import (  # noqa: F401
    SINK_SLOT_TOKENS,
    SinkPool,
    StepSinks,
    plan_step,
    sink_plan,
    sink_reserve_bytes,
)
