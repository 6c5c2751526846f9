"""The tier's scheduler half: which prompt chunks the worker holds, what to load and store.

The tier's unit is a chunk of ``chunk_tokens`` tokens (a whole number of vLLM blocks), keyed by
the chained prefix hash of its last block. The scheduler keeps the set of chunk keys the worker
holds (kept current by the worker's per-step report), counts each new request's leading whole
chunks held (its external prefix hit: only whole restored chunks are reported to vLLM, so a
prefix that ends mid-chunk is computed from the last whole chunk on), and plans each step's
loads (before the forward; a chunk partly in vLLM's own prefix cache is loaded into its other
blocks only) and stores (chunks whose every block is computed after it). A store the worker
refused (a load it depends on failed) or a failed load moves the request's store frontier
back, so the chunks vLLM recomputes are stored then, from correct values.

Loads are asynchronous by default (``async_loads``): a hit is reported to vLLM as
``(tokens, True)``, vLLM allocates the request's blocks and parks it in
``WAITING_FOR_REMOTE_KVS``, the step's plan carries its loads to the worker, whose load thread
restores them off the step and reports the request through ``get_finished`` (a chunk that
failed through ``get_block_ids_with_load_errors`` in the same step), and only then is the
request scheduled, from its first failed block if any. Nothing is computed on a load that may
still fail, so nothing has to be rewound: vLLM's asynchronous scheduling and model runner V2
are safe. With ``async_loads=False`` the request computes in the step that restores it.

With tensor parallelism each rank stores its own KV heads of a block and reports it; the
scheduler's keys carry no rank, and a block counts as held only once every rank has reported
it stored (and none has dropped it since). A store any rank refused is dropped on every rank
in the next step (``drop``): the other ranks computed it on the same failed load, so their
shards may be wrong too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvzip_vllm import support
from kvzip_vllm.core.store import block_key, shard_key
from kvzip_vllm.tier.metadata import KvzipConnectorMetadata, KvzipWorkerMetadata, Load, Store

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@dataclass
class _ReqState:
    request: Request
    block_ids: list[int] = field(default_factory=list)
    num_stored_blocks: int = 0  # chunks [0, n) already considered for storing
    local_tokens: int = 0  # block-aligned local hit seen by get_num_new_matched_tokens


class KvzipScheduler:
    """Scheduler side of ``KvzipConnector`` (one per engine)."""

    def __init__(
        self,
        vllm_config,
        kv_cache_config,
        namespace: bytes,
        shared=None,
        chunk_tokens=None,
        async_loads: bool = True,
    ):
        from kvzip_vllm.settings import blocks_per_chunk

        self.block_size = vllm_config.cache_config.block_size
        self.chunk_tokens = chunk_tokens or self.block_size
        self.bpc = blocks_per_chunk(self.chunk_tokens, self.block_size)  # blocks per chunk
        self.namespace = namespace
        #: hits are loaded asynchronously (the request waits in WAITING_FOR_REMOTE_KVS until
        #: the worker reports its load finished) or, False, in the step that computes it
        self.async_loads = async_loads
        #: the shared tier's store (tier/shared.py), queried for the blocks not held locally
        self.shared = shared
        self._held: set[bytes] = set()  # keys every rank holds
        self.world = getattr(vllm_config.parallel_config, "tensor_parallel_size", 1)
        self._holders: dict[bytes, set[int]] = {}  # TP > 1: the ranks holding a key not held
        self._drop: list[bytes] = []  # keys every rank drops next step
        self._seen: dict[int, int] = {}  # per rank, the last report taken in
        self._pending: set[bytes] = set()
        self._reqs: dict[str, _ReqState] = {}
        self._loads: list[Load] = []
        self._finished: list[str] = []
        self._clear = False
        self._seen_report = 0
        self._hash_ratio = self._resolve_hash_ratio(vllm_config, kv_cache_config)

    def _resolve_hash_ratio(self, vllm_config, kv_cache_config) -> int:
        """KV blocks per vLLM hash block (>1 when hashes are finer than blocks)."""
        try:
            from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

            _, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        except (ImportError, TypeError, AttributeError):
            hash_block_size = self.block_size
        if self.block_size % hash_block_size:
            raise support.UnsupportedConfigError(
                f"kvzip-vllm connector: block_size {self.block_size} is not a multiple of the "
                f"prefix-hash block size {hash_block_size}"
            )
        return self.block_size // hash_block_size

    def keys_of(self, request: Request, num_chunks: int | None = None) -> list[bytes]:
        """The store keys of the request's first ``num_chunks`` whole chunks (all if None):
        each the chained hash of the chunk's last block, so it stands for the whole prefix."""
        hashes = request.block_hashes
        r = self._hash_ratio * self.bpc  # hashes per chunk
        n = len(hashes) // r if num_chunks is None else min(num_chunks, len(hashes) // r)
        return [block_key(self.namespace, hashes[(j + 1) * r - 1]) for j in range(n)]

    def held(self, key: bytes) -> bool:
        return key in self._held

    # -- vLLM's scheduler-side connector calls ---------------------------------------------
    def on_new_request(self, request: Request) -> None:
        self._reqs.setdefault(request.request_id, _ReqState(request))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        state = self._reqs.setdefault(request.request_id, _ReqState(request))
        state.local_tokens = num_computed_tokens
        # At least one prompt token must be computed to produce the next token's logits.
        max_chunks = (request.num_tokens - 1) // self.chunk_tokens
        hit = 0
        keys = self.keys_of(request, max_chunks)
        for key in keys:
            if not self._servable(key):
                break
            hit += 1
        if self.shared is not None:
            hit = self._shared_hit(keys, hit, num_computed_tokens)
        hit_tokens = hit * self.chunk_tokens  # whole chunks only
        if hit_tokens <= num_computed_tokens:
            return 0, False
        return hit_tokens - num_computed_tokens, self.async_loads

    def _servable(self, key: bytes) -> bool:
        """The worker can restore ``key``: held, or stored by an earlier step and still in
        flight there. The GPU pipeline codes stores in the background and reports them with a
        later step, and an idle server takes no step, so a prompt returning to an idle server
        would find none of its chunks held; the worker's load of a chunk still in flight waits
        for its store (``CudaTierPipeline.start_loads``), and a store that fails after all
        fails the load, which vLLM recomputes. (An asynchronous load waits on the tier's load
        thread, not in the step.)"""
        return key in self._held or key in self._pending

    def _shared_hit(self, keys: list[bytes], hit: int, num_computed_tokens: int) -> int:
        """The leading blocks available from the local tier or the shared store: one
        pipelined EXISTS for those after the local hit and vLLM's own prefix (a server down
        or slow answers none within its timeout: only the local blocks count)."""
        start = max(hit, num_computed_tokens // self.chunk_tokens)
        rest = keys[start:]
        ask = [k for k in rest if not self._servable(k)]
        if not ask:
            return hit
        # with tensor parallelism, a block counts once every rank's shard is there
        w = self.world
        got = self.shared.contains_many([shard_key(k, r, w) for k in ask for r in range(w)])
        found = {k: all(got[i * w : (i + 1) * w]) for i, k in enumerate(ask)}
        n = 0
        for key in rest:
            if not self._servable(key) and not found[key]:
                break
            n += 1
        return start + n if n else hit

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        state = self._reqs[request.request_id]
        block_ids = blocks.get_block_ids()[0]
        first = state.local_tokens // self.block_size  # blocks vLLM holds itself
        last = (state.local_tokens + num_external_tokens) // self.chunk_tokens  # chunks
        keys = self.keys_of(request, last)
        b = self.bpc
        for c in range(first // b, last):
            ids = tuple(block_ids[c * b : (c + 1) * b])
            skip = max(0, first - c * b)
            self._loads.append(Load(request.request_id, keys[c], ids, c, skip))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvzipConnectorMetadata:
        meta = KvzipConnectorMetadata(
            loads=self._loads,
            clear=self._clear,
            seen_report=self._seen_report,
            seen_by_rank=dict(self._seen),
            drop=self._drop,
            finished=self._finished,
            idle=scheduler_output.total_num_scheduled_tokens == 0,
        )
        self._loads, self._clear, self._finished, self._drop = [], False, [], []
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
        """Store the chunks whose every block is computed once this step's tokens are."""
        b = self.bpc
        full = min(done // self.chunk_tokens, len(state.block_ids) // b)
        if full <= state.num_stored_blocks:
            return
        keys = self.keys_of(state.request, full)
        req_id = state.request.request_id
        last = -1
        for j in range(state.num_stored_blocks, len(keys)):
            key = keys[j]
            if key in self._held or key in self._pending:
                continue
            self._pending.add(key)
            meta.stores.append(Store(req_id, key, tuple(state.block_ids[j * b : (j + 1) * b]), j))
            last = j
        if last >= 0:
            meta.req_blocks[req_id] = state.block_ids[: (last + 1) * b]
        state.num_stored_blocks = len(keys)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(report, KvzipWorkerMetadata):
            return
        parts = report.by_rank()
        # a rank's clear (reset_cache) came before everything its report lists
        for part in parts:
            if part.cleared:
                self._cleared(part.rank)
        # every rank's stores first: a rank's refusal or drop of a key wins over another
        # rank's store of it in the same step
        for part in parts:
            for key in part.stored:
                holders = self._holders.setdefault(key, set())
                holders.add(part.rank)
                if len(holders) >= self.world:
                    del self._holders[key]
                    self._pending.discard(key)
                    self._held.add(key)
        for part in parts:
            self._take_losses(part)

    def _cleared(self, rank: int) -> None:
        """Rank ``rank`` emptied its store: it holds none of the keys it reported before (the
        scheduler forgot them when it sent the clear; reports of stores from before the clear
        that came in since are undone here)."""
        for key in self._held:
            self._holders[key] = set(range(self.world))
        self._held.clear()
        for key in list(self._holders):
            self._holders[key].discard(rank)
            if not self._holders[key]:
                del self._holders[key]

    def _take_losses(self, report: KvzipWorkerMetadata) -> None:
        """One rank's keys no longer held, refused stores and failed loads."""
        for key in report.dropped:
            self._forget(key)
        # vLLM recomputes a request from its first failed block: store from there again
        for req_id, pos, key in report.refused:
            self._forget(key)
            if self.world > 1:
                self._drop.append(key)  # the other ranks' shards of it may be wrong
            self._rewind(req_id, pos)
        for req_id, pos in report.failed_loads:
            self._rewind(req_id, pos)
        seen = max(self._seen.get(report.rank, 0), report.seq)
        self._seen[report.rank] = seen
        if report.rank == 0:
            self._seen_report = seen

    def _forget(self, key: bytes) -> None:
        """Some rank no longer holds ``key``: not held, and storable again."""
        self._pending.discard(key)
        self._held.discard(key)
        self._holders.pop(key, None)

    def _rewind(self, req_id: str, pos: int) -> None:
        state = self._reqs.get(req_id)
        if state is not None:
            state.num_stored_blocks = min(state.num_stored_blocks, pos)

    def request_finished(self, request: Request, block_ids: list[int]):
        if self._reqs.pop(request.request_id, None) is not None:
            self._finished.append(request.request_id)
        return False, None

    def reset_cache(self) -> bool:
        """``LLM.reset_prefix_cache(reset_connector=True)``: empty the tier as well."""
        self._held.clear()
        self._pending.clear()
        self._holders.clear()
        self._drop = []
        self._clear = True
        return True
