"""The CUDA tier pipeline's store path (:class:`StorePath`, which
:class:`~kvzip_vllm.core.cuda_pipeline.CudaTierPipeline` extends with its loads).

Stores (``start_stores`` after the forward): a step's chunks are gathered token-major on the
compute stream (so vLLM may reuse the blocks at once) into one buffer, chunk by chunk (each
chunk's layers' K then V: the coder reads them there, in place) and queued; a worker thread
codes every layer's K and V of every chunk of the job in one ``encode_batch`` call on its own
stream, reserves each chunk's extent in the store's page-locked arena and copies the chunk's
blobs there from the device (asynchronously), then synchronises once for the job and commits
the entries, each with its blobs' plans (``kvzip_lossless.PLAN_FIELDS``, 72 bytes a blob)
beside it.
Without a table set yet (``fit_tokens``), the first chunks wait on the thread until there are
``fit_tokens`` tokens, the set is fitted from them on the device, and they are coded with it:
nothing is coded with per-blob tables on the way. ``collect`` reports the keys stored and
dropped (evicted, skipped, damaged or missing). The staged copies are bounded
(``queue_bytes``): past it a step's chunks are spilled raw to page-locked extents of the
store's arena (inside its budget, at most ``spill_bytes``) and the store thread brings them
back to the device and codes them in their turn; with no room there either the step waits
for the queue. A store is dropped only if the store thread makes no room for
``STORE_WAIT_LIMIT_S`` (counted, logged).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import time
from dataclasses import dataclass

import numpy as np
import torch

import kvzip_lossless
from kvzip_formats import settings as table
from kvzip_vllm.core import gil
from kvzip_vllm.core.blocks import as_ids

logger = logging.getLogger("kvzip_vllm.cuda_pipeline")

#: the default store queue's ceiling, and its size where free device memory is not known
QUEUE_CAP_BYTES, QUEUE_CPU_BYTES = 16 << 30, 2 << 30


#: the default ceiling of raw chunks spilled to the host at once: this fraction of the budget
SPILL_FRACTION = 0.5


#: chunks gathered on the device at a time for a spill (their bf16 copy is the device memory
#: a spill takes: 8 chunks of 256 tokens at Llama-3.1-8B's shape, 268 MB)
SPILL_GROUP = 8


#: how long a step waits for room in the store queue (no room on the host either) before its
#: stores are dropped (counted in ``stores_dropped_queue_full``, logged): only a store thread
#: that stopped making progress gets there
STORE_WAIT_LIMIT_S = 120.0


#: the store stream's priority (CUDA: lower is higher, 0 the default; torch maps a value
#: outside the device's range to its nearest end): high, so that the coder's kernels and
#: copies run as soon as SMs free up while vLLM prefills on its default-priority stream,
#: instead of waiting behind the prefill's kernels. ``KVZIP_STORE_STREAM_PRIORITY`` overrides
#: it (0: the store stream shares the GPU as vLLM's own streams do), for measuring both.
STORE_STREAM_PRIORITY = table.STORE_STREAM_PRIORITY.get()


@dataclass
class _Job:
    """A step's chunks to store: staged on the device (``staged``: per layer (K, V)
    ``[m, chunk_tokens, kv_heads, head_size]``, ``nbytes`` of the queue), or spilled raw to
    arena extents (``spill``: (offset, bytes) per chunk, each chunk's layers' K then V)."""

    keys: list[bytes]
    staged: list | None
    event: object
    nbytes: int
    spill: list[tuple[int, int]] | None = None
    #: a spilled job's chunks being brought back to the device ahead of its turn (while the
    #: job before it is coded): the device copy and the event after its copies
    unspill: tuple[torch.Tensor, object] | None = None
    #: the job's staged (or brought back) copies' extent of the reserved store queue
    #: (``(offset, bytes)``), given back once the store thread is done reading them
    extent: tuple[int, int] | None = None


#: the coder's device working memory over the bf16 bytes of one call (its tiles' scratch and
#: the coded output; the H100 run of 2026-12-07 asked 960 MiB more for a call of 960 MiB)
ENCODE_WORKSPACE = 2
#: bf16 bytes coded per call of the store thread, at most (at least one chunk a call)
ENCODE_BYTES = table.STORE_ENCODE_BYTES.get()


def default_queue_bytes(
    device: torch.device, encode_bytes: int = ENCODE_BYTES, headroom: int | None = None
) -> int:
    """The tier's share of the device memory free now (half of it, after vLLM allocated its
    KV cache) less the coder's working memory for one call of ``encode_bytes``
    (``ENCODE_WORKSPACE`` times it), at most ``QUEUE_CAP_BYTES``, at least one call's bytes;
    ``QUEUE_CPU_BYTES`` off CUDA. A 32k-token prompt of an 8B-shaped model stages 4.3 GB while
    the first chunks are coded (and the table set fitted): a queue of 2 GiB dropped half of
    such a prompt's stores on the H200. The coder's memory was outside the share before: on
    an 80 GB H100 with vLLM at 0.9 of the device, a queue of half the free memory plus the
    coder's memory for a whole step's chunks ran out of memory (every store failed).

    ``headroom``: the device memory the engine leaves outside its own budget (vLLM: ``1 -
    gpu_memory_utilization`` of the device); the share is then taken from the smaller of it
    and what is free. What is free when the tier starts also holds the memory that the
    engine's forward takes back for its activations (vLLM frees it after profiling): a queue
    reserved from half of it ran vLLM's forward out of memory on an H100 (2026-12-07)."""
    if device.type != "cuda":
        return QUEUE_CPU_BYTES
    free, _ = torch.cuda.mem_get_info(device)
    if headroom is not None:
        free = min(free, max(0, headroom))
    share = free // 2 - ENCODE_WORKSPACE * encode_bytes
    return max(encode_bytes, min(QUEUE_CAP_BYTES, share))


class StorePath:
    """The pipeline's stores: staging on the device, the spill to page-locked host memory,
    the store thread that codes and places the chunks, and what it reports. Its state is made
    by :class:`~kvzip_vllm.core.cuda_pipeline.CudaTierPipeline`'s ``__init__``.

    Two hooks for checkers (None by default): ``on_stage(keys, staged)``, called where a
    step's chunks are staged (the caller's stream, right after their copy), and
    ``on_encode(keys, staged, todo)``, called on the store thread right before the chunks
    ``todo`` (indices into ``keys``) are coded (the store stream); ``staged`` is per layer
    (K, V) ``[chunks, chunk_tokens, kv_heads, head_size]``."""

    on_stage = None
    on_encode = None

    # -- helpers ------------------------------------------------------------------------
    def _on(self, stream):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    # -- stores -------------------------------------------------------------------------
    def start_stores(self, stores) -> None:
        """Queue ``(key, block_ids)`` chunks for storing; their bytes are copied before this
        returns (on the compute stream), so vLLM may reuse the blocks.

        The step's chunks are staged on the device while the store queue has room
        (``queue_bytes``; an empty queue always takes a step). Otherwise they are spilled raw
        to a page-locked extent of the store's arena (within ``spill_bytes`` and the budget:
        ``stores_spilled_host``), coded later by the store thread on the device; with no
        room there either, the step waits until the queue has room (``stores_waited_queue_full``,
        ``store_wait_seconds``: vLLM's next step starts later). A store is dropped
        (``stores_dropped_queue_full``) only if the store thread makes no room within
        ``STORE_WAIT_LIMIT_S``."""
        if not stores:
            return
        keys = [key for key, _ in stores]
        flat = []
        for _, ids in stores:
            ids = as_ids(ids)
            if len(ids) != self.bpc:
                raise ValueError(f"a store names {len(ids)} blocks; a chunk is {self.bpc}")
            flat.extend(ids)
        m, (t, h, d) = len(stores), self.block_shape
        nbytes = 2 * len(self.caches) * m * t * h * d * 2  # bf16 K and V of every layer
        s = self.store.stats
        if not self._enqueue(nbytes, wait=False):
            ids = self._device_ids(flat)
            if self._spill(keys, ids, nbytes):
                return
            t0 = time.perf_counter()
            if not self._enqueue(nbytes, wait=True):  # the store thread made no room
                s.stores_dropped_queue_full += m
                logger.error(
                    "kvzip tier: %d chunks not stored: %.2f GB of stores still queued after "
                    "%.0f s (store_queue_bytes %.2f GB), and no room to spill them to the host",
                    m,
                    self._queued / 1e9,
                    STORE_WAIT_LIMIT_S,
                    self.queue_bytes / 1e9,
                )
                for key in keys:
                    self._done.put((key, 0, []))
                return
            if not s.stores_waited_queue_full:
                logger.warning(
                    "kvzip tier: the store queue is full and the spill has no room: the step "
                    "waited %.3f s for the store thread (stores_waited_queue_full)",
                    time.perf_counter() - t0,
                )
            s.stores_waited_queue_full += m
            s.store_wait_seconds += time.perf_counter() - t0
        ids = self._device_ids(flat)
        extent: list = []
        staged = self._layers(self._stage(ids, m, extent))
        if self.on_stage is not None:
            self.on_stage(keys, staged)
        self._jobs.put(
            _Job(keys, staged, self._record(), nbytes, extent=extent[0] if extent else None)
        )

    def _stage(self, ids: torch.Tensor, m: int, extent: list | None = None) -> torch.Tensor:
        """The ``m`` chunks of the blocks ``ids`` copied into one device buffer, chunk-major:
        each chunk's layers' K then V, ``[m, 2 * layers, chunk_tokens, kv_heads, head_size]``
        (the order the coder reads them in, so that it reads them in place, and the order of a
        spilled chunk's extent). With ``extent`` (a list), the buffer is taken from the
        reserved store queue where it has room and its ``(offset, bytes)`` appended."""
        buf = self._queue_buffer(m, extent)
        for li, cache in enumerate(self.caches):
            self.layout.gather_into(cache, ids, buf[:, 2 * li], buf[:, 2 * li + 1])
        return buf

    def _queue_buffer(self, m: int, extent: list | None) -> torch.Tensor:
        """A device buffer of ``m`` chunks: an extent of the reserved store queue (its
        ``(offset, bytes)`` appended to ``extent``) where there is one and it has room, else
        from torch's allocator (``stores_stage_allocated``)."""
        shape = (m, 2 * len(self.caches), *self.block_shape)
        arena = self._queue_arena
        if extent is not None and arena is not None and self.store.tables is not None:
            # (not while the table set waits for its fit: the jobs held for it keep their
            # copies past their turn in the store thread)
            nbytes = int(np.prod(shape)) * 2
            with self._queued_lock:
                off = arena.alloc(nbytes)
            if off is not None:
                extent.append((off, nbytes))
                return arena.view(off, nbytes).view(torch.bfloat16).view(shape)
        if arena is not None and extent is not None:
            self.store.stats.stores_stage_allocated += 1
        return torch.empty(shape, dtype=torch.bfloat16, device=self.device)

    def _give_back(self, job: _Job) -> None:
        """The job's extent of the reserved store queue, free again (its readers are done)."""
        if job.extent is not None:
            with self._queued_lock:
                self._queue_arena.free(*job.extent)
            job.extent = None

    @staticmethod
    def _layers(buf: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A staged buffer as per layer (K, V) ``[m, chunk_tokens, kv_heads, head_size]``."""
        return [(buf[:, 2 * li], buf[:, 2 * li + 1]) for li in range(buf.shape[1] // 2)]

    def _device_ids(self, flat: list[int]) -> torch.Tensor:
        """Block ids on the device without waiting for the compute stream: through
        page-locked memory, copied asynchronously (``torch.tensor(..., device=cuda)`` copies
        from pageable memory and synchronises the stream, so the step's host work would wait
        for its forward)."""
        ids = torch.tensor(flat, dtype=torch.int64)
        if self.device.type != "cuda":
            return ids
        return ids.pin_memory().to(self.device, non_blocking=True)

    def _record(self):
        """An event on the compute stream (CUDA), None on the CPU."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _enqueue(self, nbytes: int, *, wait: bool) -> bool:
        """Count ``nbytes`` of staged copies in the queue if it has room (an empty queue
        always has); with ``wait``, wait up to ``STORE_WAIT_LIMIT_S`` for room."""
        deadline = time.monotonic() + STORE_WAIT_LIMIT_S
        with self._room:
            while self._queued > 0 and self._queued + nbytes > self.queue_bytes:
                left = deadline - time.monotonic()
                if not wait or left <= 0:
                    return False
                self._room.wait(min(left, 1.0))
            self._queued += nbytes
            s = self.store.stats
            s.store_queue_peak_bytes = max(s.store_queue_peak_bytes, self._queued)
            return True

    def _spill(self, keys: list[bytes], ids: torch.Tensor, nbytes: int) -> bool:
        """Copy the step's chunks raw into page-locked extents of the arena, one per chunk
        (every layer's K then V, token-major ``[2 * layers, chunk_tokens, kv_heads,
        head_size]``: an extent about the size of a coded entry, so making room evicts about
        as much as storing does), gathered on the device ``SPILL_GROUP`` chunks at a time, for
        the store thread to code later. False, with nothing spilled, when the spill ceiling or
        the budget leaves no room for every chunk of the step."""
        with self._queued_lock:
            if self._spilled + nbytes > self.spill_bytes:
                return False
            self._spilled += nbytes  # (held from now: a concurrent spill sees it)
        m = len(keys)
        size = nbytes // m
        extents, evicted = [], []
        for _ in range(m):
            off, ev = self.store.reserve_spill(size)
            evicted += ev
            if off is None:
                break
            extents.append((off, size))
        if evicted:  # (made room for the spill: reported not held)
            self._done.put((None, 0, evicted))
        if len(extents) < m:
            for off, n in extents:
                self.store.release_spill(off, n)
            with self._queued_lock:
                self._spilled -= nbytes
            return False
        cuda = self.device.type == "cuda"
        for j0 in range(0, m, SPILL_GROUP):
            j1 = min(m, j0 + SPILL_GROUP)
            sub = ids[j0 * self.bpc : j1 * self.bpc]
            # [chunks, 2 * layers, chunk_tokens, kv_heads, head_size] on the device
            group = self._stage(sub, j1 - j0)
            if self.on_stage is not None:
                self.on_stage(keys[j0:j1], self._layers(group))
            for j in range(j0, j1):
                off, n = extents[j]
                dst = self.store.extent(off, n).view(torch.bfloat16)
                dst.copy_(group[j - j0].view(-1), non_blocking=cuda)  # page-locked: async
        if not self.store.stats.stores_spilled_host:
            logger.warning(
                "kvzip tier: the store queue is full (store_queue_bytes %.2f GB): chunks are "
                "spilled raw to the tier's host memory and coded later (stores_spilled_host)",
                self.queue_bytes / 1e9,
            )
        self.store.stats.stores_spilled_host += m
        self._jobs.put(_Job(keys, None, self._record(), 0, spill=extents))
        return True

    def _release_spill(self, job: _Job) -> None:
        for off, n in job.spill:
            self.store.release_spill(off, n)
        with self._queued_lock:
            self._spilled -= sum(n for _, n in job.spill)
        job.spill = None

    def _start_unspill(self, job: _Job, ahead: bool = False) -> None:
        """Begin bringing a spilled job's chunks back to the device: page-locked host to
        device copies on the unspill stream (asynchronous), an event after them. ``ahead``:
        for the job queued next while the current one is coded, so the copy of one and the
        coding of the other overlap (``stores_unspilled_ahead``), only where the store queue
        has room for it beside what it holds (else it comes back at its turn: the device
        memory of staged and brought-back copies stays within the queue's)."""
        if job.unspill is not None or job.spill is None:
            return
        m = len(job.keys)
        nbytes = sum(n for _, n in job.spill)
        with self._queued_lock:  # device memory the job takes while it is coded
            if ahead and self._queued + nbytes > self.queue_bytes:
                return
            self._queued += nbytes
        job.nbytes = nbytes
        cuda = self.unspill_stream is not None
        if cuda and job.event is not None:
            self.unspill_stream.wait_event(job.event)  # the spill's own copies have landed
        with self._on(self.unspill_stream):
            extent: list = []
            dev = self._queue_buffer(m, extent)
            job.extent = extent[0] if extent else None
            for j, (off, n) in enumerate(job.spill):
                src = self.store.extent(off, n).view(torch.bfloat16)
                dev[j].view(-1).copy_(src, non_blocking=cuda)
            event = None
            if cuda:
                event = torch.cuda.Event()
                event.record(self.unspill_stream)
        job.unspill = (dev, event)

    def _unspill(self, job: _Job) -> None:
        """A spilled job's chunks back on the device (store thread), its host extents given
        back once the copies have landed: the job goes on as one staged by ``start_stores``.
        The copies were started ahead when the job queued behind another (``_start_unspill``)."""
        if job.unspill is None:
            self._start_unspill(job)
        else:
            self.store.stats.stores_unspilled_ahead += len(job.keys)
        dev, event = job.unspill
        job.unspill = None
        if event is not None:
            self.store_stream.wait_event(event)  # the coder reads the copies after they land
            event.synchronize()  # the copies have landed: the extents are free
        self._release_spill(job)
        job.staged = self._layers(dev)

    def _next_job(self) -> _Job | None:
        """The job queued after the one being coded (None if none yet), without taking it."""
        with self._jobs.mutex:
            return self._jobs.queue[0] if self._jobs.queue else None

    def _store_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                self._jobs.task_done()
                return
            try:
                if job.event is not None:
                    job.event.synchronize()  # the step's KV is computed (and copied)
                t0, c0 = time.perf_counter(), time.thread_time()
                st = self.store.stats
                with gil.busy(self.switch_interval_s), self._on(self.store_stream):
                    if job.spill is not None:
                        self._unspill(job)
                    nxt = self._next_job()
                    if nxt is not None and nxt.spill is not None:
                        self._start_unspill(nxt, ahead=True)  # overlaps this job's coding
                    t1 = time.perf_counter()
                    st.store_unspill_seconds += t1 - t0
                    ready = self._ready(job.keys, job.staged)
                    t2 = time.perf_counter()
                    st.store_fit_seconds += t2 - t1
                    for job_keys, job_staged in ready:
                        if self.store.tables is not None:
                            self._store_batched(job_keys, job_staged)
                        else:  # fit_tokens=0 and no tables_path: each blob embeds its table
                            self._store_single(job_keys, job_staged)
                    t1 = time.perf_counter()
                    st.store_code_seconds += t1 - t2
                    if self.store_stream is not None:
                        self.store_stream.synchronize()  # staged is read there until now
                    st.store_sync_seconds += time.perf_counter() - t1
                st.store_busy_seconds += time.perf_counter() - t0
                st.store_thread_cpu_seconds += time.thread_time() - c0
            except Exception:  # noqa: BLE001 (the job's chunks reported not stored)
                logger.exception("kvzip tier: storing %d chunks failed", len(job.keys))
                self.store.stats.store_errors += len(job.keys)
                for key in job.keys:
                    self._done.put((key, 0, []))
            finally:
                if job.spill is not None:  # (failed before it was brought back)
                    if job.unspill is not None and job.unspill[1] is not None:
                        job.unspill[1].synchronize()  # (its copies read the extents)
                    job.unspill = None
                    self._release_spill(job)
                if job.extent is not None:  # its reserved copies: no reader left
                    for stream in (self.store_stream, self.unspill_stream):
                        if stream is not None:
                            stream.synchronize()  # (done already, but after an error)
                    self._give_back(job)
                job.staged = None  # (jobs held for the table fit keep their copies)
                with self._room:
                    self._queued -= job.nbytes
                    self._room.notify_all()
                self._jobs.task_done()

    def _ready(self, keys, staged) -> list:
        """The store jobs to code now: this one; or, while the store is to fit its table set
        from the first ``fit_tokens`` tokens, none until that many are queued, then all of
        them, coded with the set fitted from them (on the device)."""
        st = self.store
        if st.tables is not None or st.fit_tokens <= 0:
            return [(keys, staged)]
        self._fit_jobs.append((keys, staged))
        tokens = sum(len(k) for k, _ in self._fit_jobs) * self.block_shape[0]
        if tokens < st.fit_tokens:
            return []
        windows = [
            [(k[j], v[j]) for k, v in stg] for ks, stg in self._fit_jobs for j in range(len(ks))
        ]
        jobs, self._fit_jobs = self._fit_jobs, []
        try:
            st.set_tables(kvzip_lossless.build_kv_tables(windows), tokens)
        except Exception:  # noqa: BLE001 (not stored; the next chunks try again)
            logger.exception("kvzip tier: fitting the table set failed")
            for ks, _ in jobs:
                st.stats.store_errors += len(ks)
                for key in ks:
                    self._done.put((key, 0, []))
            return []
        logger.info("kvzip tier: table set fitted on the first %d tokens stored", tokens)
        return jobs

    def _store_single(self, keys, staged) -> None:
        """Chunks coded blob by blob, each blob embedding its table (no table set)."""
        for j, key in enumerate(keys):
            layers = [(k[j], v[j]) for k, v in staged]
            try:
                nbytes, evicted = self.store.put(key, layers)
            except Exception:  # noqa: BLE001 (report the chunk as not stored)
                logger.exception("kvzip tier: storing a chunk failed")
                self.store.stats.store_errors += 1
                nbytes, evicted = 0, []
            self._done.put((key, nbytes, evicted))

    def encode_chunks(self, staged) -> int:
        """Chunks coded per ``encode_batch`` call: as many as ``encode_bytes`` holds, at
        least one (the coder's working memory grows with its call)."""
        chunk = sum(k[0].numel() * k.element_size() + v[0].numel() * v.element_size()
                    for k, v in staged)  # fmt: skip
        return max(1, self.encode_bytes // max(chunk, 1))

    def _store_batched(self, keys: list[bytes], staged) -> None:
        """Code a store job's chunks: those not held yet, in ``encode_batch`` calls of at
        most :meth:`encode_chunks` chunks (every layer's K and V of each), each call's blobs
        copied from the device into their arena extents (page-locked: asynchronous), one
        synchronisation per call."""
        todo, again, first = [], [], set()
        for j, key in enumerate(keys):
            held = self.store.touch(key)
            if held:  # held already (another request stored it)
                self._done.put((key, held, []))
            elif key in first:  # two requests' copies of one chunk in this job: the first kept
                again.append(j)
            else:
                first.add(key)
                todo.append(j)
        step = self.encode_chunks(staged)
        for i in range(0, len(todo), step):
            self._encode_piece(keys, staged, todo[i : i + step])
        for j in again:  # held now, unless its first copy could not be stored
            self._done.put((keys[j], self.store.touch(keys[j]), []))

    def _encode_piece(self, keys: list[bytes], staged, todo: list[int]) -> None:
        """One ``encode_batch`` call for the job's chunks ``todo`` (indices into ``keys``)."""
        t0 = time.perf_counter()
        S = 2 * len(staged)
        tensors, slots = [], []
        for j in todo:
            for layer, (k, v) in enumerate(staged):
                tensors += [k[j], v[j]]
                slots += [kvzip_lossless.kv_slot(layer, "k"), kvzip_lossless.kv_slot(layer, "v")]
        if self.on_encode is not None:
            self.on_encode(keys, staged, todo)
        try:
            enc = kvzip_lossless.encode_batch(tensors, tables=self.store.tables, slots=slots)
        except Exception:  # noqa: BLE001 (every chunk of the job reported not stored)
            logger.exception("kvzip tier: storing %d chunks failed", len(todo))
            self.store.stats.store_errors += len(todo)
            for j in todo:
                self._done.put((keys[j], 0, []))
            return
        t_enc = time.perf_counter()
        raw = sum(t.numel() * t.element_size() for t in tensors[:S])
        pending = []
        for c, j in enumerate(todo):
            i0, i1 = c * S, (c + 1) * S
            a = int(enc.offsets[i0])
            size = int(enc.offsets[i1 - 1] + enc.lengths[i1 - 1]) - a
            plans = np.ascontiguousarray(enc.plans[i0:i1], np.int64)
            off, evicted = self.store.reserve(size, plans.nbytes)
            if off is None:  # larger than the budget, or no room now
                self._done.put((keys[j], 0, evicted))
                continue
            self.store.extent(off, size).copy_(enc.data[a : a + size], non_blocking=True)
            pending.append((keys[j], off, size, enc.lengths[i0:i1], plans, evicted))
        if self.store_stream is not None:
            self.store_stream.synchronize()  # the job's copies are in the arena
        for key, off, size, lengths, plans, evicted in pending:
            nbytes = self.store.commit(key, off, size, lengths, raw, plans, plans.nbytes)
            self._done.put((key, nbytes, evicted))
        t1 = time.perf_counter()
        self.store.stats.store_seconds += t1 - t0
        self.store.stats.store_encode_seconds += t_enc - t0
        self.store.stats.store_copy_seconds += t1 - t_enc

    @property
    def stores_pending(self) -> int:
        """Store jobs queued or being coded (a step's chunks are one job), and those held
        for the table set's fit."""
        return self._jobs.unfinished_tasks + len(self._fit_jobs)

    def drain(self) -> None:
        """Wait until every queued store is in the store (tests, shutdown)."""
        self._jobs.join()

    def collect(self) -> tuple[list[bytes], list[bytes]]:
        """Keys stored and keys no longer held since the last call."""
        stored, dropped = [], self._dropped
        self._dropped = []
        while True:
            try:
                key, nbytes, evicted = self._done.get_nowait()
            except queue.Empty:
                return stored, dropped
            dropped.extend(evicted)
            if key is not None:  # (None: keys evicted to make room for a spill)
                (stored if nbytes else dropped).append(key)
