"""The tier's worker half: a :class:`~kvzip_vllm.store.BlockStore` of kvzip-lossless blobs in
CPU memory, loads decoded into the paged cache before the forward, stores after it. The unit
is a chunk of ``chunk_tokens`` tokens (``chunk_tokens / block_size`` paged-cache blocks, coded
as one blob per layer and kind); a load or a store names the chunk's block ids.

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
from kvzip_vllm import blocks, support
from kvzip_vllm.store import BlockStore, shard_key
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


def _tp_rank(vllm_config) -> tuple[int, int]:
    """(tensor-parallel world size, this worker's rank)."""
    world = getattr(vllm_config.parallel_config, "tensor_parallel_size", 1)
    if world == 1:
        return 1, 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return world, get_tensor_model_parallel_rank()


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
        self._shared_counts = {"shared_blocks_fetched": 0, "shared_blocks_bad": 0}
        self.layers: list[tuple[str, torch.Tensor]] = []
        self._load_errors: set[int] = set()  # block ids, until get_block_ids_with_load_errors
        self._report = KvzipWorkerMetadata()
        self._seq = 0  # reports sent
        # failures the scheduler has not seen yet, tagged with the report that carries them
        self._bad_reqs: dict[str, tuple[int, int]] = {}  # req_id -> (first bad pos, report)
        self._bad_blocks: dict[int, int] = {}  # block id -> report
        self._cuda = None  # set in register_kv_caches when the cache is on a GPU
        self._background = self._decoder = None  # CPU: tier/background.py, at registration
        self._stats_lock = threading.Lock()
        self._background_errors = 0  # the background coder's errors counted so far
        self._stats_dirty = False
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
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name, cache in kv_caches.items():
            try:
                blocks.check_paged_cache(name, cache)
            except ValueError as e:
                raise support.UnsupportedConfigError(f"kvzip-vllm connector: {e}") from None
        self.layers = order_layers(kv_caches)
        device = self.layers[0][1].device
        _, h, n, c = self.layers[0][1].shape
        self._page_shape = (n, c // 2)
        if device.type == "cpu":
            from kvzip_vllm.cpu_layout import probe_orders

            cfg = self.vllm_config
            orders = probe_orders(n, c // 2, cfg.model_config.dtype, cfg.cache_config.cache_dtype)
            identity = torch.arange(n * c // 2)
            self._orders = orders or (identity, identity)
            logger.info("kvzip tier: CPU page order %s", "probed" if orders else "as stored")
            from kvzip_vllm.tier import background

            queue = self.settings.store_queue_bytes or background.DEFAULT_QUEUE_BYTES
            # (looked up at each call: tests wrap the store's put and get)
            self._background = background.BackgroundStores(
                lambda key, layers: self.store.put(key, layers),
                max_bytes=queue,
                on_idle=self._write_stats,  # the stats file current on an idle server too
            )
            self._decoder = background.ChunkDecoder(
                lambda key, outs: self.store.get(key, outs), self._block_outputs
            )
        if device.type == "cuda":
            from kvzip_vllm.cuda_pipeline import CudaTierPipeline

            caches = [cache for _, cache in self.layers]
            self._cuda = CudaTierPipeline(
                self.store,
                caches,
                self.block_size,
                self.bpc,
                queue_bytes=self.settings.store_queue_bytes,
            )

    def _halves(self, block_id: int):
        """CPU: per layer, the flat K and V halves ``[kv_heads, block_size * head]`` of each
        head's page (``CPU_ATTN`` keeps K's rows, then V's, per (block, head))."""
        for _, cache in self.layers:
            blk = cache[block_id]
            h, n, c = blk.shape
            page = blk.view(h, 2, n * c // 2)
            yield page[:, 0], page[:, 1]

    def _gather_block(self, block_id: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
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

    def _gather(self, block_ids) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """CPU: per layer (K, V) of one chunk (its blocks ``block_ids`` in order), token-major
        ``[chunk_tokens, kv_heads, head_size]``."""
        from kvzip_vllm.tier.background import gather_chunk

        ids = as_ids(block_ids)
        if len(ids) != self.bpc:
            raise ValueError(f"a chunk is {self.bpc} blocks, {len(ids)} block ids given")
        idx = torch.tensor(ids, dtype=torch.int64)
        return [gather_chunk(cache, idx, self._orders) for _, cache in self.layers]

    def _scatter(self, block_ids, outs: list[torch.Tensor], skip: int = 0) -> None:
        """CPU: write a decoded chunk into its blocks ``block_ids``, all but the first ``skip``."""
        from kvzip_vllm.tier.background import scatter_chunk

        ids = torch.tensor(as_ids(block_ids)[skip:], dtype=torch.int64)
        t0 = skip * self.block_size
        for layer, (_, cache) in enumerate(self.layers):
            k, v = outs[2 * layer][t0:], outs[2 * layer + 1][t0:]
            scatter_chunk(cache, ids, k, v, self._orders)

    def _block_outputs(self, device="cpu") -> list[torch.Tensor]:
        """One token-major ``[chunk_tokens, kv_heads, head_size]`` buffer per layer and kind."""
        h, n, c = self.layers[0][1].shape[1:]
        return [
            torch.empty(n * self.bpc, h, c // 2, dtype=torch.bfloat16, device=device)
            for _ in range(2 * len(self.layers))
        ]

    def read_block(self, key: bytes, device="cpu") -> list[torch.Tensor] | None:
        """The decoded tensors of ``key`` (layer 0 K, layer 0 V, ...) token-major, decoded by
        kvzip_lossless on ``device`` (the CPU by default: independent of the GPU restore path),
        or None if not held or damaged (for tests and inspection; a damaged entry is dropped).
        With the CUDA pipeline, call it with no store in flight (``drain``)."""
        outs = self._block_outputs(device)
        return outs if self.store.get(self.shard_key(key), outs) else None

    # -- the step -------------------------------------------------------------------------
    def start_load_kv(self, meta: KvzipConnectorMetadata) -> None:
        if meta.clear:
            self._clear()
        meta = self._shard_meta(meta)
        self._forget_seen(meta)
        if meta.drop:  # a rank refused these stores: this rank's shards may be wrong too
            if self._cuda is not None:
                self._cuda.drain()  # no store of a dropped key still in flight
            if self._background is not None:
                self._background.drain()
            for key in meta.drop:  # (not reported: the scheduler forgot them as it sent this)
                self.store.drop(key)
                self._logical.pop(key, None)
        if not meta.loads:
            return
        if self._background is not None:  # (before the shared tier is asked for them)
            self._wait_for_stores(meta.loads)
        fetched = self._fetch_shared(meta.loads) if self.shared is not None else set()
        if self._cuda is not None:
            self._cuda_loads = {b: load for load in meta.loads for b in load.written}
            self._cuda.start_loads([(ld.req_id, ld.key, ld.ids, ld.skip) for ld in meta.loads])
            self._stats_dirty = True
            return
        t0 = time.perf_counter()
        reqs_hit: dict[str, int] = {}
        failed = []
        tokens = 0
        for i, outs in self._decoder.decode([load.key for load in meta.loads]):
            load = meta.loads[i]
            if outs is not None:
                self._scatter(load.ids, outs, load.skip)
                reqs_hit[load.req_id] = reqs_hit.get(load.req_id, 0) + 1
                tokens += len(load.written) * self.block_size
            else:
                failed.append(load)
                self._report.dropped.append(load.key)
                self.store.stats.load_errors += 1
                if load.key in fetched:  # intact value, blobs failing to decode: for all
                    self._shared_counts["shared_blocks_bad"] += 1
                    self.shared.delete(load.key)
        self._record_failures(failed)
        s = self.store.stats
        s.restore_seconds += time.perf_counter() - t0
        s.restore_hits += len(reqs_hit)
        s.blocks_restored += sum(reqs_hit.values())
        s.tokens_restored += tokens
        logger.info(
            "kvzip tier: restored %d chunks for %d requests in %.3f s%s",
            sum(reqs_hit.values()),
            len(reqs_hit),
            time.perf_counter() - t0,
            f", {len(failed)} failed (recomputed)" if failed else "",
        )
        self._write_stats()

    def _wait_for_stores(self, loads: list[Load]) -> None:
        """CPU: wait (at most ``LOAD_WAIT_FOR_STORE_S`` in all) for the stores of the loads'
        chunks still being coded in the background (the scheduler counts them held); a chunk
        still not stored then fails to load and vLLM recomputes it."""
        from kvzip_vllm.cuda_pipeline import LOAD_WAIT_FOR_STORE_S

        bg = self._background
        waiting = [ld.key for ld in loads if bg.in_flight(ld.key)]
        if not waiting:
            return
        self.store.stats.loads_waited_for_store += len(waiting)
        deadline = time.monotonic() + LOAD_WAIT_FOR_STORE_S
        for key in waiting:
            bg.wait_for(key, max(0.0, deadline - time.monotonic()))

    def _clear(self) -> None:
        """Empty the store (``reset_cache``) before the step's loads and stores. The report
        says so (``cleared``) in place of listing every key: what it says stored or dropped
        after that happened after the clear, so the scheduler applies the clear first and a
        store of an equal key in the same step stays held (issue 29)."""
        if self._cuda is not None:
            self._cuda.drain()  # the store thread is done writing to the store
            self._cuda.collect()  # stores that landed before the clear: cleared with it
        if self._background is not None:
            self._background.drain()
            self._background.collect()
        self.store.clear()
        self._logical.clear()
        self._report.stored, self._report.dropped = [], []
        self._report.cleared = True

    def _fetch_shared(self, loads: list[Load]) -> set[bytes]:
        """Bring the loads' blocks the local store lacks from the shared store into it (a
        miss stays a miss: the load then fails and vLLM recomputes). Returns the keys
        fetched; they are reported held (and what their room evicted, dropped)."""
        fetched = set()
        for load in loads:
            if load.key in self.store or load.key in fetched:
                continue
            entry = self.shared.get_entry(load.key)  # None when absent, damaged or down
            if entry is None:
                continue
            nbytes, evicted = self.store.put_blobs(load.key, tuple(entry.blobs), entry.raw_bytes)
            self._report.dropped.extend(evicted)
            if nbytes:
                fetched.add(load.key)
                self._report.stored.append(load.key)
        self._shared_counts["shared_blocks_fetched"] += len(fetched)
        return fetched

    def _share(self, key: bytes) -> None:
        """Queue a block just stored locally for the shared store (never waits)."""
        if self._shared_writer is None:
            return
        entry = self.store.lease(key)
        if entry is None:
            return
        try:  # copied out of the arena: its extent may be reused once the entry is evicted
            blobs = tuple(bytes(b) for b in entry.blobs)
        finally:
            self.store.unlease([entry])
        self._shared_writer.submit(key, blobs, entry.raw_bytes)

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
        failed_ids = self._cuda.wait_loads()
        if failed_ids:
            by_id = getattr(self, "_cuda_loads", {})
            loads = {id(by_id[b]): by_id[b] for b in sorted(failed_ids) if b in by_id}
            self._record_failures(list(loads.values()))
            self._load_errors |= failed_ids
        self._cuda_loads = {}

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._finish_cuda_loads()

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
        if self._cuda is not None:
            self._cuda.start_stores([(st.key, st.ids) for st in stores])
            return
        for st in stores:  # copied out of the paged cache here, coded in the background
            self._background.submit(st.key, self._gather(st.ids))

    def _collect_background(self) -> bool:
        """CPU: report the stores the background coder finished; True if there were any."""
        stored, dropped = self._background.collect()
        for key in stored:
            self._share(key)
        self._report.stored.extend(stored)
        self._report.dropped.extend(dropped)
        s = self.store.stats
        bg = self._background
        s.store_errors += bg.errors - self._background_errors
        self._background_errors = bg.errors
        s.store_busy_seconds = bg.busy_seconds
        s.store_queue_peak_bytes = bg.peak_bytes
        s.store_wait_seconds = bg.wait_seconds
        if not (stored or dropped):
            return False
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
        return True

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_cuda_loads()  # loads no layer waited for
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KvzipWorkerMetadata | None:
        if self._cuda is not None:
            stored, dropped = self._cuda.collect()
            for key in stored:
                self._share(key)
            self._report.stored.extend(stored)
            self._report.dropped.extend(dropped)
            if stored or dropped or self._stats_dirty or self._report.refused:
                self._stats_dirty = False
                self._write_stats()
        elif self._background is not None:
            if self._collect_background() or self._report.refused or self._report.failed_loads:
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
        if self._background is not None:  # chunks copied out of a step, still being coded
            d["stores_in_flight"] = self._background.pending
        if self.shared is not None:
            d.update(self.shared.stats)
            d.update(self._shared_counts)
            d["shared_put_queued"] = self._shared_writer.queued
            d["shared_put_dropped"] = self._shared_writer.dropped
        return d

    def _write_stats(self) -> None:
        if not self.stats_path:
            return
        with self._stats_lock:  # the step's thread and the background coder's
            tmp = f"{self.stats_path}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.stats(), f, indent=1)
            os.replace(tmp, self.stats_path)

    def shutdown(self) -> None:
        if self._cuda is not None:
            self._cuda.close()
        if self._background is not None:
            self._background.close()
            self._decoder.close()
            self._collect_background()
        if self._shared_writer is not None:
            self._shared_writer.close(timeout_s=10.0)  # bounded: puts fail fast when down
            self.shared.close()
            self._shared_writer = None
        self._write_stats()
        self.store.close()
