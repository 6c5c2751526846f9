"""The tier's one transfer interface: submit a transfer, poll the finished ones.

Shaped like vLLM's offloading workers (``submit_store`` / ``submit_load`` of a job id,
``get_finished`` returning ``TransferResult(job_id, success, ...)``, ``wait(job_ids)``), so an
engine adapter (kvzip-vllm's connector, or another engine's) only maps its steps onto jobs.
Behind it, :class:`KvTier` holds the store (arena, index, LRU, budget:
:class:`~kvzip_vllm.core.store.BlockStore`), the cache's :mod:`~kvzip_vllm.core.pages` layout
(the one gather / scatter of every path), the CPU path (kvzip-lossless's CPU coder, coding
stores on a thread out of the caller's step and decoding loads on a pool of threads:
:mod:`~kvzip_vllm.core.background`; or raw compact pages), the CUDA pipeline
(:mod:`~kvzip_vllm.core.cuda_pipeline`) and the shared Redis store (fetched from before a
load, written to after a store).

Promises the interface keeps (and the adapter builds on):

- a load that cannot be served bit-exact (not held, damaged) is reported failed with the block
  ids it would have written (``failed_blocks``) and never writes a block it could not check
  (a damaged entry is dropped, so it is never served again);
- a store reports its keys held (``stored``) or not (``dropped``, with the keys evicted for its
  room), so the engine's index never counts a chunk the tier does not hold.
"""

from __future__ import annotations

import contextlib
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

import kvzip_lossless
from kvzip_vllm.core import gil
from kvzip_vllm.core.blocks import as_ids
from kvzip_vllm.core.load_thread import LoadRunner
from kvzip_vllm.core.pages import (
    Bf16Pages,
    CompactPages,
    CorruptPagesError,
    pack_pages,
    unpack_pages,
)
from kvzip_vllm.core.store import BlockStore

logger = logging.getLogger("kvzip_vllm.core.transfer")

#: asynchronous load jobs queued together are run as one pass while their chunks hold at most
#: this many tokens (one 128k prompt's: the pass's compressed records and decode groups are
#: sized by what it restores)
MERGE_LOAD_TOKENS = 131072


class ChunkLoad(NamedTuple):
    """Restore the chunk ``key`` into its blocks ``block_ids`` (all but the first ``skip``)."""

    req_id: str
    key: bytes
    block_ids: tuple[int, ...]
    skip: int = 0
    first: bool = False  # the sequence's first chunk (compact formats: its sinks come too)


class ChunkStore(NamedTuple):
    """Store the chunk in the blocks ``block_ids`` under ``key``."""

    key: bytes
    block_ids: tuple[int, ...]
    first: bool = False  # the sequence's first chunk (compact formats: its sinks go too)


def _as_load(x) -> ChunkLoad:
    return x if isinstance(x, ChunkLoad) else ChunkLoad(*x)


def _as_store(x) -> ChunkStore:
    return x if isinstance(x, ChunkStore) else ChunkStore(*x)


@dataclass
class TransferResult:
    """A finished job (vLLM's ``TransferResult`` fields first). ``failed_blocks``: blocks a
    load did not restore (the engine recomputes them); ``failed``: those loads; ``stored`` /
    ``dropped``: keys now held / no longer held (not stored, evicted, damaged, missing)."""

    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None
    failed_blocks: set[int] = field(default_factory=set)
    failed: list[ChunkLoad] = field(default_factory=list)
    stored: list[bytes] = field(default_factory=list)
    dropped: list[bytes] = field(default_factory=list)
    tokens: int = 0  # tokens restored (loads)
    hits: dict[str, int] = field(default_factory=dict)  # chunks restored per request
    loads: list[ChunkLoad] = field(default_factory=list)  # a load job's chunks, as submitted


class TierTransfers(ABC):
    """Asynchronous KV transfers between an engine's paged cache and the tier."""

    @abstractmethod
    def submit_load(self, job_id: int, loads: list[ChunkLoad]) -> bool:
        """Begin restoring ``loads`` (tier -> cache). False: the job was not accepted."""

    @abstractmethod
    def submit_store(self, job_id: int, stores: list[ChunkStore]) -> bool:
        """Begin storing ``stores`` (cache -> tier); the blocks may be reused once this
        returns (their contents are copied or staged)."""

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """The jobs finished since the last call."""

    @abstractmethod
    def wait(self, job_ids: set[int]) -> None:
        """Block until the jobs ``job_ids`` are finished (loads: their blocks are written)."""

    def ready(self, job_ids: set[int]) -> None:
        """Order the caller's device work after the loads ``job_ids``' writes into the cache
        (the engine's forward reads them next). A transfer that writes on the device may do
        it without a host wait, its failures reported by a later :meth:`wait` or
        :meth:`get_finished` (before anything computed on them is stored); by default it is
        :meth:`wait`."""
        self.wait(job_ids)

    def shutdown(self) -> None:
        return


class KvTier(TierTransfers):
    """The tier over one model's per-layer paged caches (``caches``, layer order), chunks of
    ``bpc`` blocks. ``layout``: the caches' :mod:`~kvzip_vllm.core.pages` layout
    (:class:`Bf16Pages`: coded by kvzip-lossless; :class:`CompactPages`: raw pages, checked by
    a checksum). ``shared``: a :class:`~kvzip_vllm.core.shared_store.SharedBlobStore` (or None)
    and ``shared_writer`` its background writer. ``on_store_idle``: called by the CPU path's
    coder thread when its last store in flight is done (e.g. to write a stats file).

    bf16 caches on the CPU: ``submit_store`` copies the chunks' pages out and returns; a thread
    codes them and a later ``get_finished`` reports them; ``submit_load`` first waits (at most
    ``LOAD_WAIT_FOR_STORE_S`` in all) for stores still in flight of its chunks.

    ``pipeline``: bf16 caches go through :class:`~kvzip_vllm.core.cuda_pipeline.CudaTierPipeline`
    (staged stores, batched restores); None (the default): on CUDA only. True on the CPU runs
    the CUDA path's algorithm there (its tests' CPU twins)."""

    def __init__(
        self,
        store: BlockStore,
        caches: list[torch.Tensor],
        layout: Bf16Pages | CompactPages,
        bpc: int = 1,
        *,
        queue_bytes: int | None = None,
        shared=None,
        shared_writer=None,
        on_store_idle=None,
        switch_interval_s: float | None = None,
        queue_reserved: bool = False,
        pipeline: bool | None = None,
    ):
        if not caches:
            raise ValueError("caches must hold one paged-cache view per layer, got none")
        if pipeline is None:
            pipeline = caches[0].device.type == "cuda" and isinstance(layout, Bf16Pages)
        elif pipeline and not isinstance(layout, Bf16Pages):
            raise ValueError(
                "pipeline=True: the pipeline codes bf16 pages (Bf16Pages), "
                f"not {type(layout).__name__}"
            )
        self.store, self.caches, self.layout, self.bpc = store, caches, layout, bpc
        self.switch_interval_s = switch_interval_s  # while loads or stores run (core.gil)
        self.device = caches[0].device
        self.shared, self.shared_writer = shared, shared_writer
        self.shared_counts = {"shared_blocks_fetched": 0, "shared_blocks_bad": 0}
        self.pipeline = None
        if pipeline:
            from kvzip_vllm.core.cuda_pipeline import CudaTierPipeline

            self.pipeline = CudaTierPipeline(
                store, caches, layout.block_size, bpc, queue_bytes=queue_bytes, layout=layout,
                switch_interval_s=switch_interval_s, queue_reserved=queue_reserved,
            )  # fmt: skip
        elif self.device.type == "cuda":
            store.pin()  # raw pages are copied from the arena where they lie
        self.background = self.decoder = None  # the CPU path's coder thread and decode pool
        if self.pipeline is None and self.device.type == "cpu" and isinstance(layout, Bf16Pages):
            from kvzip_vllm.core import background

            # (the store's put / get looked up at each call: tests wrap them)
            self.background = background.BackgroundStores(
                lambda key, layers: self.store.put(key, layers),
                max_bytes=queue_bytes or background.DEFAULT_QUEUE_BYTES,
                on_idle=on_store_idle,
            )
            self.decoder = background.ChunkDecoder(self._get_checked, self.outputs)
            self._background_errors = 0  # the coder's errors counted into the stats so far
        self._finished: list[TransferResult] = []
        self._load_job: tuple[int, dict, TransferResult] | None = None  # CUDA load in flight
        self._runner: LoadRunner | None = None  # asynchronous loads' thread, once used
        self._fences: dict[int, object] = {}  # asynchronous load job -> its fence (CUDA)
        self._fence = None  # the fence of the pass the load thread runs (its state only)
        self._own_stream = None  # asynchronous loads' stream without the CUDA pipeline
        # stores in flight (CUDA pipeline, CPU coder thread), in order
        self._store_jobs: dict[int, tuple[set[bytes], TransferResult]] = {}

    # -- helpers --------------------------------------------------------------------------
    def _check(self, ids: tuple[int, ...], skip: int = 0) -> None:
        if len(ids) != self.bpc or not 0 <= skip < self.bpc:
            raise ValueError(
                f"a transfer names {len(ids)} blocks (skip {skip}); a chunk is {self.bpc}"
            )

    def _raw_bytes(self) -> int:
        shape = self.layout.chunk_shape(self.bpc)
        n = 1
        for x in shape:
            n *= x
        return n * self.layout.tensors_per_layer * len(self.caches) * self.layout.dtype.itemsize

    def gather(self, block_ids) -> list[torch.Tensor]:
        """The stored tensors of one chunk (layer 0's, layer 1's, ...), on the cache's device:
        per layer K and V ``[chunk_tokens, kv_heads, head_size]`` (bf16) or the pages
        ``[blocks, page_bytes]`` (compact)."""
        ids = as_ids(block_ids)
        shape = self.layout.chunk_shape(len(ids))
        return [t.view(shape) for c in self.caches for t in self.layout.gather(c, ids)]

    def scatter(self, block_ids, tensors: list[torch.Tensor], skip: int = 0) -> None:
        """Write one chunk's tensors (as :meth:`gather` gives them) into its blocks, all but
        the first ``skip``."""
        ids = as_ids(block_ids)
        per, n = self.layout.tensors_per_layer, len(ids)
        for li, c in enumerate(self.caches):
            parts = [t.view(n, -1)[skip:] for t in tensors[per * li : per * (li + 1)]]
            self.layout.scatter(c, ids[skip:], *parts)

    def outputs(self, device=None) -> list[torch.Tensor]:
        """Empty tensors for one chunk's decode (bf16 layouts)."""
        shape = self.layout.chunk_shape(self.bpc)
        return [
            torch.empty(shape, dtype=self.layout.dtype, device=device or self.device)
            for _ in range(self.layout.tensors_per_layer * len(self.caches))
        ]

    def read(self, key: bytes, device="cpu") -> list[torch.Tensor] | None:
        """The stored tensors of ``key`` decoded on ``device`` (CPU by default), or None when
        not held or damaged (dropped then)."""
        if isinstance(self.layout, CompactPages):
            got = self._read_pages(key, device)
            return None if got is None else got[0]
        outs = self.outputs(device)
        return outs if self.store.get(key, outs) else None

    def _get_checked(self, key: bytes, outs: list[torch.Tensor]) -> bool:
        """``store.get`` (bf16), a damaged entry logged and dropped: False (decode threads)."""
        try:
            return self.store.get(key, outs)
        except (ValueError, kvzip_lossless.CorruptBlobError):
            logger.exception("kvzip tier: restoring chunk %s failed", key[:4].hex())
            self.store.drop(key)
            return False

    @property
    def stores_in_flight(self) -> int:
        """Stores submitted and still being coded: the CPU path's coder thread's chunks, or
        the CUDA pipeline's store jobs (a step's chunks each)."""
        if self.pipeline is not None:
            return self.pipeline.stores_pending
        return 0 if self.background is None else self.background.pending

    def _wait_for_stores(self, loads: list[ChunkLoad]) -> None:
        """CPU: wait (at most ``LOAD_WAIT_FOR_STORE_S`` in all) for the stores of the loads'
        chunks still being coded (the engine's scheduler may count them held); a chunk still
        not stored then fails to load and the engine recomputes it."""
        from kvzip_vllm.core.cuda_pipeline import LOAD_WAIT_FOR_STORE_S

        bg = self.background
        waiting = list(dict.fromkeys(ld.key for ld in loads if bg.in_flight(ld.key)))
        if not waiting:
            return
        self.store.stats.loads_waited_for_store += len(waiting)
        deadline = time.monotonic() + LOAD_WAIT_FOR_STORE_S
        for key in waiting:
            bg.wait_for(key, max(0.0, deadline - time.monotonic()))

    def _read_pages(self, key: bytes, device):
        """Compact: ``(pages per layer, the sequence's sinks or None)`` of ``key``, checked;
        None when not held or damaged (dropped then)."""
        entry = self.store.lease(key)
        if entry is None:
            return None
        try:
            shape = self.layout.chunk_shape(self.bpc)
            n = len(self.caches)
            if len(entry.blobs) not in (n, n + 1):
                raise CorruptPagesError(f"{len(entry.blobs)} blobs for {n} layers")
            outs = [unpack_pages(b, device) for b in entry.blobs]
        except (CorruptPagesError, RuntimeError):
            self.store.drop(key)
            return None
        finally:
            self.store.unlease([entry])
        return [o.view(shape) for o in outs[:n]], (outs[n] if len(outs) > n else None)

    # -- loads ----------------------------------------------------------------------------
    def _fetch_shared(self, loads: list[ChunkLoad], res: TransferResult) -> set[bytes]:
        """Bring the loads' chunks the local store lacks from the shared store into it;
        reported held (``stored``), what their room evicted ``dropped``."""
        fetched: set[bytes] = set()
        for ld in loads:
            if ld.key in self.store or ld.key in fetched:
                continue
            entry = self.shared.get_entry(ld.key)  # None when absent, damaged or down
            if entry is None:
                continue
            nbytes, evicted = self.store.put_blobs(ld.key, tuple(entry.blobs), entry.raw_bytes)
            res.dropped.extend(evicted)
            if nbytes:
                fetched.add(ld.key)
                res.stored.append(ld.key)
        self.shared_counts["shared_blocks_fetched"] += len(fetched)
        return fetched

    def _load_runner(self) -> LoadRunner:
        if self._runner is None:
            tokens = self.bpc * self.layout.block_size
            self._runner = LoadRunner(
                self._run_loads, self._fail_all, max(1, MERGE_LOAD_TOKENS // tokens)
            )
        return self._runner

    @contextlib.contextmanager
    def load_batch(self):
        """The asynchronous loads submitted inside are taken up by the load thread together
        once the block ends (one pass for as many as one pass holds), not the first alone
        while the rest are still being submitted: a step whose requests return at once."""
        with self._load_runner().holding():
            yield

    def submit_load(self, job_id: int, loads: list[ChunkLoad], *, asynchronous=False) -> bool:
        """Begin restoring ``loads``. Synchronous (the default): the caller's step does the
        host work now and the job finishes by the step's :meth:`wait` / :meth:`ready`.
        ``asynchronous``: the job runs on the tier's load thread, on its own streams, off the
        caller's step (its chunks must not be read until :meth:`get_finished` reports it)."""
        loads = [ld._replace(block_ids=as_ids(ld.block_ids)) for ld in map(_as_load, loads)]
        for ld in loads:
            self._check(ld.block_ids, ld.skip)
        if asynchronous:
            if self.device.type == "cuda":
                # the fence: the job's writes into the cache wait on the device for the work
                # queued on the caller's stream so far. vLLM frees a finished request's blocks
                # once its last step's output is back, while what was queued behind that
                # step's forward (the copies of its stores) may not have run yet: a load into
                # those blocks on the tier's own streams could land first, and the store would
                # copy the restored chunk's bits into its later layers (what the restore
                # benchmark's differing blocks look like: results/vllm/tier_vs_offload/
                # h100_restore_defaults_s20/). The copies and decodes need not wait for it.
                fence = torch.cuda.Event()
                fence.record(torch.cuda.current_stream(self.device))
                self._fences[job_id] = fence
            self._load_runner().submit(job_id, loads)
            return True
        t0 = time.perf_counter()
        try:
            return self._submit_load(job_id, loads, t0)
        finally:
            self.store.stats.load_submit_seconds += time.perf_counter() - t0

    def _prepare_load(self, loads: list[ChunkLoad], res: TransferResult) -> set[bytes]:
        """Before a load reads the store: stores of its chunks still in flight waited for
        (CPU coder), the chunks the local store lacks fetched from the shared tier."""
        if self.background is not None:  # (before the shared tier is asked for them)
            self._wait_for_stores(loads)
        return self._fetch_shared(loads, res) if self.shared is not None else set()

    def _load_stream(self):
        """The stream an asynchronous load runs on (CUDA): the pipeline's decode stream, or
        one of the tier's own; never the engine's compute stream."""
        if self.device.type != "cuda":
            return None
        if self.pipeline is not None:
            return self.pipeline.decode_stream
        if self._own_stream is None:
            self._own_stream = torch.cuda.Stream(self.device)
        return self._own_stream

    def _run_load(self, job_id: int, loads: list[ChunkLoad]) -> TransferResult:
        """One asynchronous load job, start to finish, on the load thread: its writes into
        the cache come after the pass's fence (an event on the engine's stream, recorded when
        its last job was submitted) and are complete (the stream synchronised) when this
        returns."""
        t0 = time.perf_counter()
        fence = self._fence
        stream = self._load_stream()
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        # (vLLM's caches are inference tensors: written in place only in inference mode,
        # which is thread-local)
        with torch.inference_mode(), ctx:
            res = TransferResult(job_id, True, loads=loads)
            fetched = self._prepare_load(loads, res)
            if self.pipeline is not None:
                by_block = {b: ld for ld in loads for b in ld.block_ids[ld.skip :]}
                job = (job_id, by_block, res, fetched, t0)
                self.pipeline.start_loads(
                    [(ld.req_id, ld.key, ld.block_ids, ld.skip) for ld in loads], after=fence
                )
                res = self._finish_cuda_load(job)
            else:
                if fence is not None:
                    stream.wait_event(fence)
                self._load_each(loads, res, fetched)
                self._finish_load(res, t0)
            if stream is not None:
                stream.synchronize()  # every write into the cache landed
        res.transfer_time = time.perf_counter() - t0
        self.store.stats.load_async_seconds += res.transfer_time
        return res

    def _run_loads(self, jobs: list[tuple[int, list[ChunkLoad]]]) -> list[TransferResult]:
        """Asynchronous load jobs queued together, run as one: one pass through the shared
        tier, the copies and the batched decode for all their chunks, one synchronisation;
        then one result per job (its own chunks' failures; the keys the pass stored or
        dropped go with the first). A pass that raises is run again job by job, so that only
        the job that raises fails its chunks."""
        fence = None  # the last job's (recorded after the others' on the same stream)
        for job_id, _ in jobs:
            fence = self._fences.pop(job_id, None) or fence
        self._fence = fence
        with gil.busy(self.switch_interval_s):
            return self._run_passes(jobs)

    def _run_passes(self, jobs: list[tuple[int, list[ChunkLoad]]]) -> list[TransferResult]:
        if len(jobs) == 1:
            return [self._run_load(*jobs[0])]
        try:
            merged = self._run_load(jobs[0][0], [ld for _, lds in jobs for ld in lds])
        except Exception:  # noqa: BLE001  (each job alone: the runner fails only the one raising)
            logger.exception(
                "kvzip tier: load jobs %s run together failed; one by one", [j for j, _ in jobs]
            )
            return [self._run_one(job_id, loads) for job_id, loads in jobs]
        self.store.stats.load_jobs_merged += len(jobs) - 1
        failed = {(ld.req_id, ld.key) for ld in merged.failed}
        out = []
        for i, (job_id, loads) in enumerate(jobs):
            res = TransferResult(job_id, True, transfer_time=merged.transfer_time, loads=loads)
            if i == 0:
                res.stored, res.dropped = merged.stored, merged.dropped
            for ld in loads:
                if (ld.req_id, ld.key) in failed:
                    res.failed.append(ld)
                    res.failed_blocks.update(ld.block_ids[ld.skip :])
                elif ld.req_id in merged.hits:
                    res.hits[ld.req_id] = res.hits.get(ld.req_id, 0) + 1
                    res.tokens += (self.bpc - ld.skip) * self.layout.block_size
            # (a block the pass failed outside every failed load: the job holding it fails)
            res.failed_blocks |= merged.failed_blocks & {
                b for ld in loads for b in ld.block_ids[ld.skip :]
            }
            res.success = not res.failed_blocks
            out.append(res)
        return out

    def _run_one(self, job_id: int, loads: list[ChunkLoad]) -> TransferResult:
        try:
            return self._run_load(job_id, loads)
        except Exception:  # noqa: BLE001  (reported failed: the engine recomputes)
            logger.exception("kvzip tier: load job %d failed", job_id)
            return self._fail_all(job_id, loads)

    def _fail_all(self, job_id: int, loads: list[ChunkLoad]) -> TransferResult:
        """A job whose run raised: every chunk reported failed (the engine recomputes them)
        and dropped from the store, so that the request's next look-up misses them rather than
        loading them again (a load that raises each time would otherwise be retried forever)."""
        res = TransferResult(job_id, False, loads=loads)
        for ld in loads:
            res.failed.append(ld)
            res.failed_blocks.update(ld.block_ids[ld.skip :])
            self.store.stats.load_errors += 1
            if self.store.drop(ld.key):
                res.dropped.append(ld.key)
        return res

    def _submit_load(self, job_id: int, loads: list[ChunkLoad], t0: float) -> bool:
        res = TransferResult(job_id, True, loads=loads)
        fetched = self._prepare_load(loads, res)
        if self.pipeline is not None:
            self.wait({self._load_job[0]} if self._load_job else set())
            by_block = {b: ld for ld in loads for b in ld.block_ids[ld.skip :]}
            self._load_job = (job_id, by_block, res, fetched, t0)
            self.pipeline.start_loads([(ld.req_id, ld.key, ld.block_ids, ld.skip) for ld in loads])
            return True
        self._load_each(loads, res, fetched)
        self._finish_load(res, t0)
        self._finished.append(res)
        return True

    def _load_each(self, loads: list[ChunkLoad], res: TransferResult, fetched) -> None:
        """The loads on the host's paths (CPU decode pool, compact pages, chunk by chunk)."""
        if self.decoder is not None:
            self._decode_loads(loads, res, fetched)
            return
        for ld in loads:
            ok = False
            try:
                if isinstance(self.layout, CompactPages):
                    ok = self._load_pages(ld)
                else:
                    tensors = self.read(ld.key, self.device) if ld.key in self.store else None
                    if tensors is not None:
                        self.scatter(ld.block_ids, tensors, ld.skip)
                        ok = True
            except (ValueError, kvzip_lossless.CorruptBlobError):
                logger.exception("kvzip tier: restoring chunk %s failed", ld.key[:4].hex())
                self.store.drop(ld.key)
            if ok:
                res.hits[ld.req_id] = res.hits.get(ld.req_id, 0) + 1
                res.tokens += (self.bpc - ld.skip) * self.layout.block_size
            else:
                self._fail(res, ld, fetched)

    def _decode_loads(self, loads: list[ChunkLoad], res: TransferResult, fetched) -> None:
        """CPU, bf16: the loads' chunks decoded on the decode pool, each scattered as it
        comes (in order)."""
        held = [ld.key in self.store for ld in loads]
        decoded = self.decoder.decode([ld.key for ld, h in zip(loads, held, strict=True) if h])
        for ld, h in zip(loads, held, strict=True):  # (failures reported in the loads' order)
            outs = next(decoded)[1] if h else None
            if outs is None:
                self._fail(res, ld, fetched)
                continue
            self.scatter(ld.block_ids, outs, ld.skip)
            res.hits[ld.req_id] = res.hits.get(ld.req_id, 0) + 1
            res.tokens += (self.bpc - ld.skip) * self.layout.block_size

    def _load_pages(self, ld: ChunkLoad) -> bool:
        """Compact: one chunk's pages (and, for a sequence's first chunk written from its first
        block, its sinks) into the cache; False, writing nothing, when it cannot be served."""
        got = self._read_pages(ld.key, self.device) if ld.key in self.store else None
        if got is None:
            return False
        pages, sinks = got
        carry = self.layout.sinks is not None and ld.first and ld.skip == 0
        if carry and sinks is None:
            logger.warning("kvzip tier: first chunk %s holds no sinks: dropped", ld.key[:4].hex())
            self.store.drop(ld.key)
            return False
        self.scatter(ld.block_ids, pages, ld.skip)
        if carry:
            self.layout.sinks.write(self.caches, ld.block_ids[0], sinks)
        return True

    def _fail(self, res: TransferResult, ld: ChunkLoad, fetched: set[bytes]) -> None:
        res.success = False
        res.failed.append(ld)
        res.failed_blocks.update(ld.block_ids[ld.skip :])
        res.dropped.append(ld.key)
        self.store.stats.load_errors += 1
        if ld.key in fetched:  # intact value, blobs failing to decode: for all
            self.shared_counts["shared_blocks_bad"] += 1
            self.shared.delete(ld.key)

    def _finish_load(self, res: TransferResult, t0: float) -> None:
        s = self.store.stats
        res.transfer_time = time.perf_counter() - t0
        s.restore_seconds += res.transfer_time
        s.restore_hits += len(res.hits)
        s.blocks_restored += sum(res.hits.values())
        s.tokens_restored += res.tokens

    def _finish_cuda_load(self, job) -> TransferResult:
        """The pipeline's started loads of ``job`` finished (its flags read, damaged chunks
        dropped): the job's result."""
        job_id, by_block, res, fetched, t0 = job
        failed_ids = self.pipeline.wait_loads()  # (it counts its restores and errors)
        seen: dict[int, ChunkLoad] = {}
        for b in sorted(failed_ids):
            ld = by_block.get(b)
            if ld is not None:
                seen.setdefault(id(ld), ld)
        res.failed_blocks |= failed_ids
        res.failed.extend(seen.values())
        res.success = not failed_ids
        # the job's other chunks were restored (the pipeline counts them in the stats)
        for ld in res.loads:
            if id(ld) not in seen:
                res.hits[ld.req_id] = res.hits.get(ld.req_id, 0) + 1
                res.tokens += (self.bpc - ld.skip) * self.layout.block_size
        for ld in seen.values():
            if ld.key in fetched:
                self.shared_counts["shared_blocks_bad"] += 1
                self.shared.delete(ld.key)
        res.transfer_time = time.perf_counter() - t0
        return res

    def _finish_sync_cuda_load(self) -> None:
        job, self._load_job = self._load_job, None
        self._finished.append(self._finish_cuda_load(job))

    # -- stores ---------------------------------------------------------------------------
    def submit_store(self, job_id: int, stores: list[ChunkStore]) -> bool:
        t0 = time.perf_counter()
        stores = [st._replace(block_ids=as_ids(st.block_ids)) for st in map(_as_store, stores)]
        for st in stores:
            self._check(st.block_ids)
        res = TransferResult(job_id, True)
        if self.pipeline is not None:
            self._store_jobs[job_id] = ({st.key for st in stores}, res)
            self.pipeline.start_stores([(st.key, st.block_ids) for st in stores])
            self._collect()
            return True
        if self.background is not None:
            self._submit_background(job_id, stores, res)
            return True
        compact = isinstance(self.layout, CompactPages)
        for st in stores:
            try:
                tensors = self.gather(st.block_ids)
                if compact:
                    blobs = tuple(pack_pages(t) for t in tensors)
                    if st.first and self.layout.sinks is not None:
                        sinks = self.layout.sinks.read(self.caches, st.block_ids[0])
                        blobs += (pack_pages(sinks),) if sinks is not None else (None,)
                if compact and blobs[-1] is None:  # its sink slot was given away: not stored
                    logger.warning(
                        "kvzip tier: first chunk %s not stored: its sequence's sink slot was "
                        "given away (vLLM recomputes it)",
                        st.key[:4].hex(),
                    )
                    nbytes, evicted = 0, []
                elif compact:
                    nbytes, evicted = self.store.put_blobs(
                        st.key, blobs, self._raw_bytes(), seconds=time.perf_counter() - t0
                    )
                else:
                    layers = list(zip(tensors[0::2], tensors[1::2], strict=True))
                    nbytes, evicted = self.store.put(st.key, layers)
            except Exception:  # noqa: BLE001  (a chunk not stored is recomputed later)
                logger.exception("kvzip tier: storing chunk %s failed", st.key[:4].hex())
                self.store.stats.store_errors += 1
                nbytes, evicted = 0, []
            res.dropped.extend(evicted)
            (res.stored if nbytes else res.dropped).append(st.key)
            res.success &= bool(nbytes)
        self._share(res.stored)
        res.transfer_time = time.perf_counter() - t0
        self._finished.append(res)
        return True

    def _submit_background(self, job_id: int, stores: list[ChunkStore], res) -> None:
        """CPU, bf16: the chunks' pages copied out of the cache (the blocks are free for reuse
        once this returns), coded by the coder thread; the job finishes when they are done."""
        want = set()
        for st in stores:
            try:
                tensors = self.gather(st.block_ids)
            except Exception:  # noqa: BLE001  (a chunk not stored is recomputed later)
                logger.exception("kvzip tier: copying chunk %s failed", st.key[:4].hex())
                self.store.stats.store_errors += 1
                res.dropped.append(st.key)
                res.success = False
                continue
            want.add(st.key)
            self.background.submit(st.key, list(zip(tensors[0::2], tensors[1::2], strict=True)))
        if want:
            self._store_jobs[job_id] = (want, res)
        else:
            self._finished.append(res)
        self._collect()

    def _share(self, keys: list[bytes]) -> None:
        """Queue chunks just stored locally for the shared store (never waits)."""
        if self.shared_writer is None:
            return
        for key in keys:
            entry = self.store.lease(key)
            if entry is None:
                continue
            try:  # copied out of the arena: its extent may be reused once the entry is evicted
                blobs = tuple(bytes(b) for b in entry.blobs)
            finally:
                self.store.unlease([entry])
            self.shared_writer.submit(key, blobs, entry.raw_bytes)

    def _collect(self) -> None:
        """The finished stores (CUDA pipeline, CPU coder thread), credited to their jobs
        (oldest first); keys evicted to make room, to the oldest job still open (or a job of
        its own: -1)."""
        if self.pipeline is not None:
            stored, dropped = self.pipeline.collect()
        elif self.background is not None:
            bg, s = self.background, self.store.stats
            stored, dropped = bg.collect()
            errors = bg.errors  # (read once: the thread may count another meanwhile)
            s.store_errors += errors - self._background_errors
            self._background_errors = errors
            s.store_busy_seconds = bg.busy_seconds
            s.store_queue_peak_bytes = bg.peak_bytes
            s.store_wait_seconds = bg.wait_seconds
        else:
            return
        self._share(stored)
        jobs = list(self._store_jobs.items())
        loose = TransferResult(-1, True)
        for keys, ok in ((stored, True), (dropped, False)):
            for key in keys:
                for _, (want, res) in jobs:
                    if key in want:
                        want.discard(key)
                        (res.stored if ok else res.dropped).append(key)
                        res.success &= ok
                        break
                else:
                    loose.dropped.append(key) if not ok else loose.stored.append(key)
        for job_id, (want, res) in jobs:
            if not want:
                del self._store_jobs[job_id]
                self._finished.append(res)
        if loose.stored or loose.dropped:
            self._finished.append(loose)

    # -- polling --------------------------------------------------------------------------
    def get_finished(self) -> list[TransferResult]:
        if self.pipeline is not None and self._load_job is not None:
            self._finish_sync_cuda_load()
        if self._runner is not None:
            self._finished.extend(self._runner.take())
        self._collect()
        done, self._finished = self._finished, []
        return done

    @property
    def loads_in_flight(self) -> int:
        """Asynchronous load jobs submitted and not yet finished."""
        return 0 if self._runner is None else self._runner.pending

    def wait_loads(self, timeout_s: float | None = None) -> bool:
        """Block until every asynchronous load job has finished (their results stay for
        :meth:`get_finished`); False if ``timeout_s`` passed first."""
        return self._runner is None or self._runner.wait(None, timeout_s)

    def wait_any_load(self, timeout_s: float) -> bool:
        """Block (the GIL released) until an asynchronous load job finishes or none is left
        in flight, at most ``timeout_s``; True if that came first (its result stays for
        :meth:`get_finished`), False on the timeout or without a load thread."""
        return self._runner is not None and self._runner.wait_any(timeout_s)

    def ready(self, job_ids: set[int]) -> None:
        job = self._load_job
        if self.pipeline is not None and job is not None and job[0] in job_ids:
            if self.pipeline.order_loads():  # written on the device: no host wait
                return
        self.wait(job_ids)

    def wait(self, job_ids: set[int]) -> None:
        if self._runner is not None:
            self._runner.wait(set(job_ids))
        if self.pipeline is None:  # CPU: loads finish as submitted; stores on the coder
            if self.background is not None and any(j in self._store_jobs for j in job_ids):
                self.background.drain()
                self._collect()
            return
        if self._load_job is not None and self._load_job[0] in job_ids:
            self._finish_sync_cuda_load()
        if any(j in self._store_jobs for j in job_ids):
            self.pipeline.drain()
            self._collect()

    def drain(self) -> None:
        """Every store in flight held (or dropped) and collected."""
        if self.pipeline is not None:
            self.pipeline.drain()
        if self.background is not None:
            self.background.drain()
        self._collect()

    def shutdown(self) -> None:
        if self._runner is not None:
            self._runner.close()  # (finishes the loads queued)
        if self.pipeline is not None:
            self.pipeline.close()
        if self.background is not None:
            self.background.close()  # (finishes the stores queued)
            self.decoder.close()
            self._collect()
