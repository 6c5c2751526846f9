"""The lossless capacity tier as a vLLM v1 KV connector (``KvzipConnector``).

Scheduler side: an index of the block keys the worker holds (kept current by the worker's
per-step report), the prefix hit count for each new request, and the plan of loads and stores
sent to the worker each step. Worker side: a :class:`~kvzip_vllm.store.BlockStore` of
kvzip-lossless blobs in CPU memory; loads decode straight into the paged cache before the
forward, stores copy the blocks that became full after it. A block the worker no longer holds
(evicted, or failing its checksum) is reported through ``get_block_ids_with_load_errors`` and
vLLM recomputes it: a wrong prefix is never served.

Use::

    --kv-transfer-config '{"kv_connector": "KvzipConnector",
        "kv_connector_module_path": "kvzip_vllm.connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"budget_bytes": 8000000000,
                                      "stats_path": "/tmp/kvzip-stats.json"}}'
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger

import kvzip_lossless
from kvzip_vllm import blocks, support
from kvzip_vllm.store import BlockStore, block_key, namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger("vllm.kvzip.connector")

DEFAULT_BUDGET_BYTES = 4 << 30


@dataclass
class KvzipConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, one step: blocks to restore before the forward, to store after."""

    loads: list[tuple[str, bytes, int]] = field(default_factory=list)  # (req_id, key, block_id)
    stores: list[tuple[bytes, int]] = field(default_factory=list)  # (key, block_id)
    clear: bool = False


@dataclass
class KvzipWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, one step: keys now held, keys no longer held."""

    stored: list[bytes] = field(default_factory=list)
    dropped: list[bytes] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvzipWorkerMetadata)
        return KvzipWorkerMetadata(self.stored + other.stored, self.dropped + other.dropped)


@dataclass
class _ReqState:
    request: Request
    block_ids: list[int] = field(default_factory=list)
    num_stored_blocks: int = 0  # blocks [0, n) already considered for storing
    local_tokens: int = 0  # block-aligned local hit seen by get_num_new_matched_tokens


def _extra(vllm_config: VllmConfig, name: str, default: Any) -> Any:
    cfg = vllm_config.kv_transfer_config
    return cfg.get_from_extra_config(name, default) if cfg is not None else default


def _model_identity(vllm_config: VllmConfig) -> str:
    """The model part of the key: path/name, revision and a hash of its HF config."""
    mc = vllm_config.model_config
    cfg = mc.hf_config.to_json_string(use_diff=False) if mc.hf_config is not None else ""
    digest = hashlib.sha256(cfg.encode()).hexdigest()[:16]
    return f"{mc.model}@{mc.revision or ''}#{digest}"


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
        self._block_size = vllm_config.cache_config.block_size
        budget = int(
            _extra(
                vllm_config,
                "budget_bytes",
                os.environ.get("KVZIP_TIER_BYTES", DEFAULT_BUDGET_BYTES),
            )
        )
        self._stats_path = _extra(vllm_config, "stats_path", os.environ.get("KVZIP_STATS_PATH"))
        self._namespace = namespace(
            model=_model_identity(vllm_config),
            layout="per-layer-block",
            block_size=self._block_size,
            dtype=str(vllm_config.model_config.dtype),
        )
        if role == KVConnectorRole.SCHEDULER:
            self._held: set[bytes] = set()
            self._pending: set[bytes] = set()
            self._reqs: dict[str, _ReqState] = {}
            self._loads: list[tuple[str, bytes, int]] = []
            self._clear = False
            self._hash_ratio = self._resolve_hash_ratio(vllm_config, kv_cache_config)
        else:
            tables_path = _extra(vllm_config, "tables_path", os.environ.get("KVZIP_TIER_TABLES"))
            tables = kvzip_lossless.TableSet.load(tables_path) if tables_path else None
            fit_tokens = int(_extra(vllm_config, "fit_tokens", 1024))
            self._store = BlockStore(budget, tables=tables, fit_tokens=fit_tokens)
            self._layers: list[tuple[str, torch.Tensor]] = []
            self._load_errors: set[int] = set()
            self._report = KvzipWorkerMetadata()
            self._cuda = None  # set in register_kv_caches when the cache is on a GPU
            logger.info("kvzip tier: budget %.1f MB, stats -> %s", budget / 1e6, self._stats_path)

    # ------------------------------------------------------------------ scheduler side
    def _resolve_hash_ratio(self, vllm_config, kv_cache_config) -> int:
        """KV blocks per vLLM hash block (>1 when hashes are finer than blocks)."""
        try:
            from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

            _, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        except (ImportError, TypeError, AttributeError):
            hash_block_size = self._block_size
        if self._block_size % hash_block_size:
            raise support.UnsupportedConfigError(
                f"kvzip-vllm connector: block_size {self._block_size} is not a multiple of the "
                f"prefix-hash block size {hash_block_size}"
            )
        return self._block_size // hash_block_size

    def _keys(self, request: Request, num_blocks: int) -> list[bytes]:
        hashes = request.block_hashes
        r = self._hash_ratio
        n = min(num_blocks, len(hashes) // r)
        return [block_key(self._namespace, hashes[(j + 1) * r - 1]) for j in range(n)]

    def on_new_request(self, request: Request) -> None:
        self._reqs.setdefault(request.request_id, _ReqState(request))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        state = self._reqs.setdefault(request.request_id, _ReqState(request))
        state.local_tokens = num_computed_tokens
        # At least one prompt token must be computed to produce the next token's logits.
        max_blocks = (request.num_tokens - 1) // self._block_size
        hit = 0
        for key in self._keys(request, max_blocks):
            if key not in self._held:
                break
            hit += 1
        hit_tokens = hit * self._block_size
        if hit_tokens <= num_computed_tokens:
            return 0, False
        return hit_tokens - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ):
        if num_external_tokens <= 0:
            return
        state = self._reqs[request.request_id]
        block_ids = blocks.get_block_ids()[0]
        first = state.local_tokens // self._block_size
        last = first + num_external_tokens // self._block_size
        keys = self._keys(request, last)
        for j in range(first, last):
            self._loads.append((request.request_id, keys[j], block_ids[j]))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvzipConnectorMetadata(loads=self._loads, clear=self._clear)
        self._loads, self._clear = [], False
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            state.num_stored_blocks = 0
            self._plan_stores(meta, state, new.num_computed_tokens + sched.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
                state.num_stored_blocks = 0
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            self._plan_stores(meta, state, cached.num_computed_tokens[i] + sched.get(req_id, 0))
        return meta

    def _plan_stores(self, meta: KvzipConnectorMetadata, state: _ReqState, done: int) -> None:
        """Store the blocks that are full once this step's tokens are computed."""
        full = min(done // self._block_size, len(state.block_ids))
        if full <= state.num_stored_blocks:
            return
        keys = self._keys(state.request, full)
        for j in range(state.num_stored_blocks, len(keys)):
            key = keys[j]
            if key in self._held or key in self._pending:
                continue
            self._pending.add(key)
            meta.stores.append((key, state.block_ids[j]))
        state.num_stored_blocks = len(keys)

    def update_connector_output(self, connector_output: KVConnectorOutput):
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(report, KvzipWorkerMetadata):
            return
        for key in report.stored:
            self._pending.discard(key)
            self._held.add(key)
        for key in report.dropped:
            self._pending.discard(key)
            self._held.discard(key)

    def request_finished(self, request: Request, block_ids: list[int]):
        self._reqs.pop(request.request_id, None)
        return False, None

    def reset_cache(self) -> bool | None:
        """``LLM.reset_prefix_cache(reset_connector=True)``: empty the tier as well."""
        self._held.clear()
        self._pending.clear()
        self._clear = True
        return True

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        def layer_index(name: str) -> int:
            digits = [p for p in name.split(".") if p.isdigit()]
            return int(digits[0]) if digits else 0

        for name, cache in kv_caches.items():
            try:
                blocks.check_paged_cache(name, cache)
            except ValueError as e:
                raise support.UnsupportedConfigError(f"kvzip-vllm connector: {e}") from None
        self._layers = sorted(kv_caches.items(), key=lambda kv: layer_index(kv[0]))
        device = self._layers[0][1].device
        _, h, n, c = self._layers[0][1].shape
        self._page_shape = (n, c // 2)
        if device.type == "cpu":
            from kvzip_vllm.cpu_layout import probe_orders

            cfg = self._vllm_config
            orders = probe_orders(n, c // 2, cfg.model_config.dtype, cfg.cache_config.cache_dtype)
            identity = torch.arange(n * c // 2)
            self._orders = orders or (identity, identity)
            logger.info("kvzip tier: CPU page order %s", "probed" if orders else "as stored")
        if device.type == "cuda":
            from kvzip_vllm.cuda_pipeline import CudaTierPipeline

            caches = [cache for _, cache in self._layers]
            self._cuda = CudaTierPipeline(self._store, caches, self._block_size)

    def _halves(self, block_id: int):
        """CPU: per layer, the flat K and V halves ``[kv_heads, block_size * head]`` of each
        head's page (``CPU_ATTN`` keeps K's rows, then V's, per (block, head))."""
        for _, cache in self._layers:
            blk = cache[block_id]
            h, n, c = blk.shape
            page = blk.view(h, 2, n * c // 2)
            yield page[:, 0], page[:, 1]

    def _gather(self, block_id: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """CPU: per layer (K, V) of one block, token-major ``[block_size, kv_heads, head_size]``."""
        n, d = self._page_shape
        out = []
        for k, v in self._halves(block_id):
            h = k.shape[0]
            out.append(
                tuple(
                    half[:, order].view(h, n, d).permute(1, 0, 2).contiguous()
                    for half, order in zip((k, v), self._orders, strict=True)
                )
            )
        return out

    def _scatter(self, block_id: int, outs: list[torch.Tensor]) -> None:
        for layer, halves in enumerate(self._halves(block_id)):
            for i, (half, order) in enumerate(zip(halves, self._orders, strict=True)):
                x = outs[2 * layer + i]  # [N, H, D]
                half[:, order] = x.permute(1, 0, 2).reshape(half.shape)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvzipConnectorMetadata)
        if meta.clear:
            if self._cuda is not None:
                self._cuda.drain()  # the store thread is done writing to the store
            self._report.dropped.extend(k for k in list(self._store._entries))
            self._store.clear()
        if not meta.loads:
            return
        if self._cuda is not None:
            self._cuda.start_loads(meta.loads)
            self._stats_dirty = True
            return
        t0 = time.perf_counter()
        reqs_hit: dict[str, int] = {}
        h, n, c = self._layers[0][1].shape[1:]
        outs = [
            torch.empty(n, h, c // 2, dtype=torch.bfloat16) for _ in range(2 * len(self._layers))
        ]
        for req_id, key, block_id in meta.loads:
            if self._store.get(key, outs):
                self._scatter(block_id, outs)
                reqs_hit[req_id] = reqs_hit.get(req_id, 0) + 1
            else:
                self._load_errors.add(block_id)
                self._report.dropped.append(key)
                self._store.stats.load_errors += 1
        s = self._store.stats
        s.restore_seconds += time.perf_counter() - t0
        s.restore_hits += len(reqs_hit)
        s.blocks_restored += sum(reqs_hit.values())
        s.tokens_restored += sum(reqs_hit.values()) * self._block_size
        logger.info(
            "kvzip tier: restored %d blocks for %d requests in %.3f s",
            sum(reqs_hit.values()),
            len(reqs_hit),
            time.perf_counter() - t0,
        )
        self._write_stats()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._cuda is not None:
            self._load_errors |= self._cuda.wait_loads()

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any
    ) -> None:
        # Stores copy whole blocks (all layers) after the forward, in wait_for_save.
        return

    def wait_for_save(self):
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvzipConnectorMetadata)
        if not meta.stores:
            return
        if self._cuda is not None:
            self._cuda.start_stores(meta.stores)
            return
        for key, block_id in meta.stores:
            nbytes, evicted = self._store.put(key, self._gather(block_id))
            self._report.dropped.extend(evicted)
            (self._report.stored if nbytes else self._report.dropped).append(key)
        s = self._store.stats
        logger.info(
            "kvzip tier: %d blocks held, %.2f MB (raw %.2f MB, ratio %.3f, %.3f with "
            "the %.2f MB table set), %d evictions",
            s.blocks_held,
            s.bytes_held / 1e6,
            s.raw_bytes_held / 1e6,
            s.ratio,
            s.ratio_with_tables,
            s.table_bytes / 1e6,
            s.evictions,
        )
        self._write_stats()

    def get_block_ids_with_load_errors(self) -> set[int]:
        if getattr(self, "_cuda", None) is not None:  # loads no layer waited for
            self._load_errors |= self._cuda.wait_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._cuda is not None:
            stored, dropped = self._cuda.collect()
            self._report.stored.extend(stored)
            self._report.dropped.extend(dropped)
            if stored or dropped or getattr(self, "_stats_dirty", False):
                self._stats_dirty = False
                self._write_stats()
        if not self._report.stored and not self._report.dropped:
            return None
        report, self._report = self._report, KvzipWorkerMetadata()
        return report

    def stats(self) -> dict:
        """The tier's counters (also written to ``stats_path`` when set)."""
        return self._store.stats.as_dict()

    def _write_stats(self) -> None:
        if not self._stats_path:
            return
        tmp = f"{self._stats_path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.stats(), f, indent=1)
        os.replace(tmp, self._stats_path)

    def shutdown(self):
        if getattr(self, "_cuda", None) is not None:
            self._cuda.close()
        if self._role == KVConnectorRole.WORKER:
            self._write_stats()
