"""The tier's worker half: vLLM's steps mapped onto the tier core's transfer jobs
(:class:`~kvzip_vllm.core.transfer.KvTier`: the store, the cache layout's gather / scatter, the
CPU path or the CUDA pipeline, the shared store), loads before the forward, stores after it.
The unit is a chunk of ``chunk_tokens`` tokens (``chunk_tokens / block_size`` paged-cache
blocks, coded as one blob per layer and kind, or with the compact backend stored as its pages);
a load or a store names the chunk's block ids. What stays here is vLLM's: shard keys, the
refusals after a failed load, the report to the scheduler.

A load that fails (the entry was evicted since the scheduler counted it, or fails its
checksum) is reported through ``get_block_ids_with_load_errors``: vLLM recomputes the request
from that block (the connector sets ``kv_load_failure_policy='recompute'``). Every block of
that request from the failed one on, and of any request whose earlier blocks include the failed
physical block, was computed this step on top of KV that was not restored: the worker refuses
to store it (``stores_refused_after_load_error``) and reports it, and keeps refusing until the
scheduler has seen the failure (vLLM then recomputes those blocks, and they are stored from the
recomputation). The failures are known before any store of the step runs (CPU: loads finish in
``start_load_kv``; CUDA: ``wait_for_save`` finishes them first), so a block computed on a
failed one is never in the store, and a wrong prefix is never served.

Stores leave the step as soon as their pages are copied out (CPU: the core's coder thread;
CUDA: the pipeline's store stream): a later step's ``build_connector_worker_meta`` reports
them held or dropped; a load of a chunk still in flight waits for it in the core.

With tensor parallelism each worker holds its own KV heads (its paged caches hold only
those): it stores and restores its shard of each block under the scheduler's key made
specific to its rank and world size (:meth:`KvzipWorker.shard_key`: the step's keys are
turned into shard keys as the step arrives, and back in the report), so a shard is never
restored on another rank or layout; its reports carry its rank.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger

import kvzip_lossless
from kvzip_vllm import support
from kvzip_vllm.core import pages
from kvzip_vllm.core.store import BlockStore, shard_key
from kvzip_vllm.core.transfer import ChunkLoad, ChunkStore, KvTier, TransferResult
from kvzip_vllm.tier.metadata import (
    KvzipConnectorMetadata,
    KvzipWorkerMetadata,
    Load,
    Refusal,
    Store,
    as_ids,
)

if TYPE_CHECKING:
    from kvzip_vllm.settings import ConnectorSettings

logger = init_logger("vllm.kvzip.connector")


def layer_index(name: str) -> int:
    """The layer number in a KV cache layer name (``model.layers.7.self_attn.attn`` -> 7): its
    first dot-separated part made of digits. A name without one is refused: the tier's
    entries hold the layers in this order, so a guess would mix up layers."""
    digits = [p for p in name.split(".") if p.isdigit()]
    if not digits:
        raise support.UnsupportedConfigError(
            f"kvzip-vllm connector: KV cache layer {name!r} has no layer number; supported: "
            "names with a dot-separated layer index, such as 'model.layers.0.self_attn.attn'"
        )
    return int(digits[0])


def order_layers(kv_caches: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The caches by layer number; refuses names without one, repeats and gaps."""
    indexed = sorted(((layer_index(n), n, c) for n, c in kv_caches.items()), key=lambda t: t[0])
    got = [i for i, _, _ in indexed]
    if got != list(range(len(got))):
        names = {i: n for i, n, _ in indexed}
        raise support.UnsupportedConfigError(
            f"kvzip-vllm connector: KV cache layers numbered {got} (names {list(names.values())}); "
            "supported: one cache per layer, numbered 0 to n-1"
        )
    return [(n, c) for _, n, c in indexed]


#: torch's caching-allocator counters the stats file carries (CUDA; the whole process's):
#: device allocations and frees, and the retries after freeing the cache, each of which
#: synchronises the device (a tier thread allocating then waits for vLLM's forward)
ALLOCATOR_COUNTS = {"num_alloc_retries": "cuda_alloc_retries",
                    "num_device_alloc": "cuda_device_allocs",
                    "num_device_free": "cuda_device_frees"}  # fmt: skip


def allocator_counts(device: torch.device) -> dict[str, int]:
    """``ALLOCATOR_COUNTS`` of ``device`` (nothing off CUDA)."""
    if device.type != "cuda":
        return {}
    st = torch.cuda.memory_stats(device)
    return {name: int(st.get(key, 0)) for key, name in ALLOCATOR_COUNTS.items()}


def _tp_rank(vllm_config) -> tuple[int, int]:
    """(tensor-parallel world size, this worker's rank)."""
    world = getattr(vllm_config.parallel_config, "tensor_parallel_size", 1)
    if world == 1:
        return 1, 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return world, get_tensor_model_parallel_rank()


def vllm_headroom(cache_config, total: int) -> int | None:
    """The device memory vLLM leaves outside its own budget: ``1 - gpu_memory_utilization`` of
    the device's ``total`` bytes; None where vLLM's KV cache is sized in bytes
    (``kv_cache_memory_bytes``), which states no budget for the rest."""
    if getattr(cache_config, "kv_cache_memory_bytes", None):
        return None
    return int(total * (1.0 - cache_config.gpu_memory_utilization))


class KvzipWorker:
    """Worker side of ``KvzipConnector`` (one per model worker)."""

    def __init__(self, vllm_config, settings: ConnectorSettings):
        self.vllm_config = vllm_config
        self.block_size = vllm_config.cache_config.block_size
        self.settings = settings
        from kvzip_vllm.settings import ConnectorSettingsError, blocks_per_chunk

        try:
            self.bpc = blocks_per_chunk(settings.chunk_tokens, self.block_size)
        except ConnectorSettingsError as e:
            raise support.UnsupportedConfigError(str(e)) from None
        self.chunk_tokens = settings.chunk_tokens
        self.stats_path = settings.stats_path
        path = settings.tables_path
        tables = kvzip_lossless.TableSet.load(path) if path else None
        self.store = BlockStore(
            settings.budget_bytes, tables=tables, fit_tokens=settings.fit_tokens
        )
        # the shared tier (tier/shared.py): None unless shared_url is set
        from kvzip_vllm.tier.shared import SharedWriter, open_shared

        self.shared = open_shared(settings)
        self._shared_writer = SharedWriter(self.shared) if self.shared is not None else None
        self.tier: KvTier | None = None  # the tier core, once the caches are registered
        self.layers: list[tuple[str, torch.Tensor]] = []
        self._load_errors: set[int] = set()  # block ids, until get_block_ids_with_load_errors
        self._report = KvzipWorkerMetadata()
        self._seq = 0  # reports sent
        # failures the scheduler has not seen yet, tagged with the report that carries them
        self._bad_reqs: dict[str, tuple[int, int]] = {}  # req_id -> (first bad pos, report)
        self._bad_blocks: dict[int, int] = {}  # block id -> report
        self._job = 0  # transfer jobs submitted to the core
        #: the restores are asynchronous (``load_mode``): a job per request on the core's load
        #: thread, reported by get_finished; else the step's one load job, finished before
        #: the forward reads the cache
        self.async_loads = settings.load_mode == "async"
        self.idle_wait_s = settings.idle_wait_s
        self._idle_step = False  # this step schedules no tokens (its metadata's ``idle``)
        self._job_loads: dict[int, dict[tuple[str, bytes], Load]] = {}  # load jobs' loads
        self._recving: dict[int, str] = {}  # asynchronous load job -> its request
        self._loads_done: list[TransferResult] = []  # finished, not yet reported finished
        self._load_job: int | None = None  # the step's load job (waited for before the forward)
        self._load_ready = False  # the forward is ordered after the load job's writes
        self._stats_dirty = False
        self._stats_lock = threading.Lock()  # the step's thread and the core's coder thread
        self.world, self.rank = _tp_rank(vllm_config)
        if self.world > 1 and self.stats_path:  # one file per rank: stats.json -> stats.rank1.json
            root, ext = os.path.splitext(self.stats_path)
            self.stats_path = f"{root}.rank{self.rank}{ext}"
        self._logical: dict[bytes, bytes] = {}  # TP > 1: shard key -> the scheduler's key
        logger.info(
            "kvzip tier: budget %.1f MB, stats -> %s", settings.budget_bytes / 1e6, self.stats_path
        )

    # -- keys (tensor parallelism) ---------------------------------------------------------
    def shard_key(self, key: bytes) -> bytes:
        """The store key of this rank's shard of the scheduler's ``key``: the key itself with
        one worker, else hashed with the rank and the world size (``store.shard_key``)."""
        if self.world == 1:
            return key
        skey = shard_key(key, self.rank, self.world)
        self._logical[skey] = key
        return skey

    def _shard_meta(self, meta: KvzipConnectorMetadata) -> KvzipConnectorMetadata:
        """The step with this rank's shard keys in place of the scheduler's keys."""
        if self.world == 1 or meta is None:
            return meta
        sk = self.shard_key
        return dataclasses.replace(
            meta,
            loads=[ld._replace(key=sk(ld.key)) for ld in meta.loads],
            stores=[st._replace(key=sk(st.key)) for st in meta.stores],
            drop=[sk(k) for k in meta.drop],
        )

    def _unshard_report(self, report: KvzipWorkerMetadata) -> None:
        """The report with the scheduler's keys in place of this rank's shard keys."""
        if self.world == 1:
            return
        back = self._logical
        report.stored = [back.get(k, k) for k in report.stored]
        report.refused = [r._replace(key=back.get(r.key, r.key)) for r in report.refused]
        dropped = [back.get(k, k) for k in report.dropped]
        for k in report.dropped:
            if k not in self.store:
                back.pop(k, None)
        report.dropped = dropped

    # -- caches ---------------------------------------------------------------------------
    @property
    def _cuda(self):
        """The core's CUDA pipeline (None on the CPU path)."""
        return None if self.tier is None else self.tier.pipeline

    @_cuda.setter
    def _cuda(self, pipeline) -> None:  # (tests run the pipeline on the CPU device)
        self.tier.pipeline = pipeline

    @property
    def _background(self):
        """The core's CPU coder thread (None on the CUDA path and for compact pages)."""
        return None if self.tier is None else self.tier.background

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        first = next(iter(kv_caches.values()))
        compact = first.dtype == torch.uint8
        for name, cache in kv_caches.items():
            try:
                if compact:
                    if cache.dtype != torch.uint8 or cache.shape != first.shape:
                        raise ValueError(f"layer {name}: {cache.dtype} {tuple(cache.shape)}")
                else:
                    pages.check_bf16(cache, name)
            except ValueError as e:
                raise support.UnsupportedConfigError(f"kvzip-vllm connector: {e}") from None
        self.layers = order_layers(kv_caches)
        device = self.layers[0][1].device
        _, h, n, c = self.layers[0][1].shape
        self._page_shape = (n, c // 2)
        if compact:
            layout = self._compact_layout(self.layers[0][1])
        elif device.type == "cpu":
            from kvzip_vllm.core.cpu_layout import probe_orders

            cfg = self.vllm_config
            orders = probe_orders(n, c // 2, cfg.model_config.dtype, cfg.cache_config.cache_dtype)
            identity = torch.arange(n * c // 2)
            self._orders = orders or (identity, identity)
            layout = pages.Bf16Pages.of(self.layers[0][1], self._orders)
            logger.info("kvzip tier: CPU page order %s", "probed" if orders else "as stored")
        else:
            layout = pages.Bf16Pages.of(self.layers[0][1])
        self.tier = KvTier(
            self.store,
            [cache for _, cache in self.layers],
            layout,
            self.bpc,
            queue_bytes=self._queue_bytes(),
            shared=self.shared,
            shared_writer=self._shared_writer,
            on_store_idle=self._write_stats,  # the stats file current on an idle server too
            switch_interval_s=self.settings.switch_interval_s,
            queue_reserved=self.settings.store_queue_reserved,
        )

    def _queue_bytes(self) -> int | None:
        """The store queue's bytes: ``store_queue_bytes``, or by default the tier's share of
        the free device memory (``core.cuda_stores.default_queue_bytes``). A queue reserved
        at start-up (``store_queue_reserved``) takes it from no more than what vLLM leaves
        outside its budget (:func:`vllm_headroom`): vLLM's forward takes back the memory its
        profiling freed."""
        if self.settings.store_queue_bytes is not None or not self.settings.store_queue_reserved:
            return self.settings.store_queue_bytes
        device = self.layers[0][1].device
        if device.type != "cuda":
            return None
        from kvzip_vllm.core.cuda_stores import default_queue_bytes

        total = torch.cuda.mem_get_info(device)[1]
        headroom = vllm_headroom(self.vllm_config.cache_config, total)
        queue = default_queue_bytes(device, headroom=headroom)
        logger.info(
            "kvzip tier: store queue %.2f GB reserved (headroom outside vLLM's budget: %s)",
            queue / 1e9, "unstated" if headroom is None else f"{headroom / 1e9:.2f} GB",
        )  # fmt: skip
        return queue

    def _compact_layout(self, cache: torch.Tensor) -> pages.CompactPages:
        """The compact backend's cache (``KVZIP_KV_FORMAT``): its K and V page bytes."""
        from kvzip_kernels.paged import PagedAttention
        from kvzip_vllm.backend import _active_format, _active_window, sink_pool

        mc = self.vllm_config.model_config
        recent, slot_tokens = _active_window()
        paged = PagedAttention(
            _active_format(),
            num_heads=mc.get_num_attention_heads(self.vllm_config.parallel_config),
            num_kv_heads=cache.shape[1],
            head_size=mc.get_head_size(),
            block_size=self.block_size,
            scale=1.0,
            recent=recent,
            window_slot_tokens=slot_tokens,
        )
        if paged.content_bytes != cache.shape[-1]:
            raise support.UnsupportedConfigError(
                f"kvzip-vllm connector: a uint8 KV cache of {cache.shape[-1]} bytes per token "
                f"and head, the compact format's is {paged.content_bytes}; supported: bf16 "
                "caches, or kvzip's compact backend (KVZIP_KV_FORMAT)"
            )
        pk, pv = paged.layouts["k"].page_bytes, paged.layouts["v"].page_bytes
        sinks = None
        if paged.sink_tokens:  # the backend's sink pool of this cache: carried by first chunks
            sinks = pages.SequenceSinks(paged, lambda c: sink_pool(paged, c))
        return pages.CompactPages.of(cache, pk, pv, sinks)

    def _gather_block(self, block_id: int) -> list[tuple[torch.Tensor, ...]]:
        """Per layer (K, V) of one block, token-major ``[block_size, kv_heads, head_size]``
        (compact caches: per layer its pages)."""
        return self._gather_any((block_id,))

    def _gather_any(self, ids) -> list[tuple[torch.Tensor, ...]]:
        per = self.tier.layout.tensors_per_layer
        flat = self.tier.gather(ids)
        return [tuple(flat[i : i + per]) for i in range(0, len(flat), per)]

    def _gather(self, block_ids) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V) of one chunk (its blocks ``block_ids`` in order), token-major
        ``[chunk_tokens, kv_heads, head_size]`` (compact caches: per layer the pages)."""
        ids = as_ids(block_ids)
        if len(ids) != self.bpc:
            raise ValueError(f"a chunk is {self.bpc} blocks, {len(ids)} block ids given")
        return self._gather_any(ids)

    def read_block(self, key: bytes, device="cpu") -> list[torch.Tensor] | None:
        """The decoded tensors of ``key`` (layer 0 K, layer 0 V, ...) token-major, decoded by
        kvzip_lossless on ``device`` (the CPU by default: independent of the GPU restore path),
        or None if not held or damaged (for tests and inspection; a damaged entry is dropped).
        With the CUDA pipeline, call it with no store in flight (``drain``)."""
        return self.tier.read(self.shard_key(key), device)

    # -- the step -------------------------------------------------------------------------
    def start_load_kv(self, meta: KvzipConnectorMetadata) -> None:
        self._idle_step = meta.idle
        if meta.clear:
            self._clear()
        meta = self._shard_meta(meta)
        self._forget_seen(meta)
        if meta.drop:  # a rank refused these stores: this rank's shards may be wrong too
            if self.tier is not None:
                self.tier.drain()  # no store of a dropped key still in flight
            for key in meta.drop:  # (not reported: the scheduler forgot them as it sent this)
                self.store.drop(key)
                self._logical.pop(key, None)
        if not meta.loads:
            return
        if self.async_loads:
            self._submit_async(meta.loads)
            return
        self._job += 1
        loads = [ChunkLoad(ld.req_id, ld.key, ld.ids, ld.skip, ld.pos == 0) for ld in meta.loads]
        self._job_loads[self._job] = {(ld.req_id, ld.key): ld for ld in meta.loads}
        self._load_job, self._load_ready = self._job, False
        self.tier.submit_load(self._job, loads)
        if self._cuda is not None:
            self._stats_dirty = True
            # the forward is ordered after the restore now, before any of it is launched (on
            # the device, no host wait, where the pipeline writes the chunks there): it does
            # not rest on vLLM calling wait_for_layer_load (a CUDA graph replay does not)
            self._ready_loads()
            return
        self._take_finished()
        self._write_stats()

    def _submit_async(self, loads: list[Load]) -> None:
        """One load job per request on the core's load thread (a request is reported finished
        as soon as its own chunks are written, not behind the step's other requests)."""
        by_req: dict[str, list[Load]] = {}
        for ld in loads:
            by_req.setdefault(ld.req_id, []).append(ld)
        with self.tier.load_batch():  # the step's returns taken up together
            for req_id, lds in by_req.items():
                self._job += 1
                self._job_loads[self._job] = {(ld.req_id, ld.key): ld for ld in lds}
                self._recving[self._job] = req_id
                chunks = [ChunkLoad(ld.req_id, ld.key, ld.ids, ld.skip, ld.pos == 0) for ld in lds]
                self.tier.submit_load(self._job, chunks, asynchronous=True)
                self.store.stats.load_jobs_async += 1
        self._stats_dirty = True

    def get_finished(self, finished_req_ids: set[str]) -> tuple[None, set[str] | None]:
        """vLLM's poll, once a step: the requests whose asynchronous loads have finished
        since the last call (their failed chunks recorded for the
        ``get_block_ids_with_load_errors`` vLLM calls right after). Never waits. A request
        aborted while its load ran is reported too: vLLM frees its blocks then."""
        if not self.async_loads or self.tier is None:
            return None, None
        idle, self._idle_step = self._idle_step, False
        if idle and self.idle_wait_s and not self._loads_done and self.tier.loads_in_flight:
            self._wait_idle()
        self._take_finished()
        done, self._loads_done = self._loads_done, []
        if not done:
            return None, None
        self._loads_finished(done)
        self._stats_dirty = True  # (written with this step's report)
        finished = {self._recving.pop(res.job_id) for res in done}
        return None, finished

    def _wait_idle(self) -> None:
        """A step with nothing to compute while loads are in flight: wait up to
        ``idle_wait_s`` for one of them to finish, the GIL released. vLLM's engine loop polls
        through such steps as fast as it can, holding the GIL that the tier's load thread
        takes back after every stream call or copy; here the loop rests instead, and a load
        that finishes ends the wait, so it is reported no later than without it."""
        t0 = time.perf_counter()
        ended = self.tier.wait_any_load(self.idle_wait_s)
        s = self.store.stats
        s.idle_waits += 1
        s.idle_waits_ended_by_load += int(ended)
        s.idle_wait_seconds += time.perf_counter() - t0

    def _loads_finished(self, results: list[TransferResult]) -> None:
        """Asynchronous load jobs finished (each ``res.loads`` its chunks, ``res.failed`` those
        not restored), on the step's thread, just before their requests are reported to vLLM
        (a hook for checkers: the chunks' blocks are written and nothing reads them yet)."""
        for res in results:
            self._job_loads.pop(res.job_id, None)

    def _take_finished(self) -> None:
        """The core's finished jobs into the step's report: keys held and no longer held,
        failed loads recorded (their stores are refused until the scheduler has seen them)."""
        for res in self.tier.get_finished():
            self._take(res)

    def _take(self, res: TransferResult) -> None:
        self._report.stored.extend(res.stored)
        self._report.dropped.extend(res.dropped)
        if res.job_id in self._recving:
            self._loads_done.append(res)
            loads = self._job_loads.get(res.job_id, {})
        else:
            loads = self._job_loads.pop(res.job_id, {})
        if res.failed_blocks:
            failed = [loads[(f.req_id, f.key)] for f in res.failed if (f.req_id, f.key) in loads]
            self._record_failures(failed)
            self._load_errors |= res.failed_blocks
        if res.hits or res.failed:
            logger.info(
                "kvzip tier: restored %d chunks for %d requests in %.3f s%s",
                sum(res.hits.values()),
                len(res.hits),
                res.transfer_time or 0.0,
                f", {len(res.failed)} failed (recomputed)" if res.failed else "",
            )

    def _clear(self) -> None:
        """Empty the store (``reset_cache``) before the step's loads and stores. The report
        says so (``cleared``) in place of listing every key: what it says stored or dropped
        after that happened after the clear, so the scheduler applies the clear first and a
        store of an equal key in the same step stays held (issue 29)."""
        if self.tier is not None:
            self._wait_for_async_loads("the tier is emptied")
            self.tier.drain()  # the store thread is done writing to the store
            # stores that landed before the clear: cleared with it (loads: still reported)
            for res in self.tier.get_finished():
                if res.job_id in self._recving:
                    self._take(res)
        self.store.clear()
        self._logical.clear()
        self._report.stored, self._report.dropped = [], []
        self._report.cleared = True

    def _wait_for_async_loads(self, why: str) -> None:
        """The step waits for the asynchronous loads in flight (counted in the stats:
        ``step_waits_for_loads``): an emptying of the tier does not free the records they
        read, and their results stay for get_finished."""
        if self.tier is None or not self.tier.loads_in_flight:
            return
        t0 = time.perf_counter()
        self.tier.wait_loads()
        waited = time.perf_counter() - t0
        s = self.store.stats
        s.step_waits_for_loads += 1
        s.step_wait_for_loads_seconds += waited
        logger.info("kvzip tier: the step waited %.3f s for loads in flight: %s", waited, why)

    def flush_shared(self, timeout_s: float = 10.0) -> bool:
        """Wait up to ``timeout_s`` until the queued shared puts are done (tests, shutdown)."""
        return self._shared_writer is None or self._shared_writer.flush(timeout_s)

    def _record_failures(self, failed: list[Load]) -> None:
        """Remember the step's failed loads until the scheduler has seen them."""
        seq = self._seq + 1  # the report this step's failures go out with
        for load in failed:
            logger.warning(
                "kvzip tier: chunk %d of request %s (%s) not restored: vLLM recomputes it",
                load.pos,
                load.req_id,
                load.key[:4].hex(),
            )
            for block_id in load.written:
                self._load_errors.add(block_id)
                self._bad_blocks[block_id] = seq
            pos, _ = self._bad_reqs.get(load.req_id, (load.pos, seq))
            self._bad_reqs[load.req_id] = (min(pos, load.pos), seq)
            self._report.failed_loads.append((load.req_id, load.pos))

    def _forget_seen(self, meta: KvzipConnectorMetadata) -> None:
        """Failures the scheduler has taken in are being recomputed: stop refusing for them."""
        seen = meta.seen_by_rank.get(self.rank, meta.seen_report)
        self._bad_reqs = {
            r: v for r, v in self._bad_reqs.items() if v[1] > seen and r not in meta.finished
        }
        self._bad_blocks = {b: q for b, q in self._bad_blocks.items() if q > seen}

    def _finish_cuda_loads(self) -> None:
        if self._cuda is None:
            return
        if self._load_job is not None:  # the step's loads written (or failed); never the
            self.tier.wait({self._load_job})  # stores: they are coded in the background
            self._load_job = None
            self._load_ready = False
        self._take_finished()

    def _ready_loads(self) -> None:
        """The compute stream ordered after the step's load job's writes (once a step); the
        failures are taken in wait_for_save, before the step's stores."""
        if self._cuda is not None and self._load_job is not None and not self._load_ready:
            self.tier.ready({self._load_job})
            self._load_ready = True

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._ready_loads()  # (done in start_load_kv already)

    def _admit(self, meta: KvzipConnectorMetadata) -> list[Store]:
        """The step's stores that depend on no failed load; the others are refused."""
        if not self._bad_reqs and not self._bad_blocks:
            return meta.stores
        first_bad: dict[str, int] = {r: pos for r, (pos, _) in self._bad_reqs.items()}
        if self._bad_blocks:
            for req_id, ids in meta.req_blocks.items():
                for j, block_id in enumerate(ids):
                    if block_id in self._bad_blocks:
                        pos = j // self.bpc  # the chunk holding the bad block
                        if pos < first_bad.get(req_id, pos + 1):
                            first_bad[req_id] = pos
                            self._bad_reqs[req_id] = (pos, self._bad_blocks[block_id])
                        break
        keep = []
        for st in meta.stores:
            bad = first_bad.get(st.req_id)
            if bad is not None and st.pos >= bad:
                self._report.refused.append(Refusal(st.req_id, st.pos, st.key))
                self.store.stats.stores_refused_after_load_error += 1
            else:
                keep.append(st)
        if len(keep) < len(meta.stores):
            logger.warning(
                "kvzip tier: %d chunks not stored: computed on top of a block that failed "
                "to load (vLLM recomputes them; they are stored then)",
                len(meta.stores) - len(keep),
            )
        return keep

    def wait_for_save(self, meta: KvzipConnectorMetadata | None) -> None:
        self._finish_cuda_loads()  # this step's failures are known before anything is stored
        meta = self._shard_meta(meta)
        if meta is None or not meta.stores:
            return
        stores = self._admit(meta)
        self._job += 1
        self.tier.submit_store(
            self._job, [ChunkStore(st.key, st.ids, st.pos == 0) for st in stores]
        )
        if self._cuda is not None or self._background is not None:
            return  # reported as they finish (build_connector_worker_meta)
        self._take_finished()
        self._log_held()
        self._write_stats()

    def _log_held(self) -> None:
        s = self.store.stats
        logger.info(
            "kvzip tier: %d chunks held, %.2f MB (raw %.2f MB, ratio %.3f, %.3f with "
            "the %.2f MB table set), %d evictions",
            s.blocks_held,
            s.bytes_held / 1e6,
            s.raw_bytes_held / 1e6,
            s.ratio,
            s.ratio_with_tables,
            s.table_bytes / 1e6,
            s.evictions,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        if not self.async_loads:
            self._finish_cuda_loads()  # loads no layer waited for
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KvzipWorkerMetadata | None:
        if self._cuda is not None or self._background is not None:
            n = len(self._report.stored) + len(self._report.dropped)
            self._take_finished()
            changed = len(self._report.stored) + len(self._report.dropped) > n
            if changed and self._background is not None:
                self._log_held()
            if changed or self._stats_dirty or self._report.refused or self._report.failed_loads:
                self._stats_dirty = False
                self._write_stats()
        elif self._report.refused or self._report.failed_loads:
            self._write_stats()
        if self._report.empty():
            return None
        self._seq += 1
        report, self._report = self._report, KvzipWorkerMetadata()
        report.seq = self._seq
        report.rank = self.rank
        self._unshard_report(report)
        return report

    def stats(self) -> dict:
        """The tier's counters (also written to ``stats_path`` when set); with the shared
        tier, its ``shared_*`` counters too (this worker's calls)."""
        d = self.store.stats.as_dict()
        if self._background is not None or self._cuda is not None:  # copied, being coded
            d["stores_in_flight"] = self.tier.stores_in_flight
        if self._cuda is not None:
            d.update(allocator_counts(self._cuda.device))
        if self.tier is not None:
            d["loads_in_flight"] = self.tier.loads_in_flight
        if self.shared is not None:
            d.update(self.shared.stats)
            d.update(self.tier.shared_counts if self.tier is not None else {})
            d["shared_put_queued"] = self._shared_writer.queued
            d["shared_put_dropped"] = self._shared_writer.dropped
        return d

    def _write_stats(self) -> None:
        if not self.stats_path:
            return
        with self._stats_lock:  # the step's thread and the core's coder thread
            tmp = f"{self.stats_path}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.stats(), f, indent=1)
            os.replace(tmp, self.stats_path)

    def shutdown(self) -> None:
        if self.tier is not None:
            self._wait_for_async_loads("shutdown")
            self.tier.shutdown()
        if self._shared_writer is not None:
            self._shared_writer.close(timeout_s=10.0)  # bounded: puts fail fast when down
            self.shared.close()
            self._shared_writer = None
        self._write_stats()
        self.store.close()
