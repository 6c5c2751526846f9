"""Moved to ``kvzip_kernels.paged`` (it needs no vLLM); this module re-exports it for imports of
``kvzip_vllm.paged``."""

from kvzip_kernels.paged import (  # noqa: F401
    PATH_CALLS,
    SINK_SLOT_TOKENS,
    Geometry,
    PagedAttention,
    SinkPool,
    StepPlan,
    StepSinks,
    VarlenAttention,
    content_bytes,
    plan_step,
    sdpa_varlen,
    sink_plan,
    sink_reserve_bytes,
    triton_runs,
)
