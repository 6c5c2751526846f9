"""The tier's loads and stores on the GPU (connector.py uses it when the paged cache is on CUDA).

No vLLM here: the pipeline sees the per-layer paged-cache views (:mod:`kvzip_vllm.core.blocks`) and
the :class:`~kvzip_vllm.core.store.BlockStore`; the coding is kvzip-lossless's public batched API
(``encode_batch`` / ``decode_batch``, spec/blob.md section 9). On a CPU device it runs the
same steps with no streams (kvzip-lossless's CPU path, or its Triton kernels under
``TRITON_INTERPRET=1``), which is how it is tested without a GPU.

Stores: :mod:`~kvzip_vllm.core.cuda_stores` (the pipeline takes its store path from there).

Loads (``start_loads`` before the forward, ``wait_loads`` before the first layer reads the
cache): the step's records are copied from the arena on a copy stream, in a few chunk groups,
each group into one of a ring of device buffers kept from step to step (a run of records lying
back to back in the arena, as a prefix stored in order does, is one copy); on a decode stream
each group is decoded by one ``decode_batch`` call as soon as its copies have landed (header and
tile checks on the device, one damage flag per blob), and on CUDA the decoded chunks are written
into the paged cache right behind it by one masked launch (:mod:`~kvzip_vllm.core.scatter`: a
chunk whose flag is set is not written, so a damaged blob's output never reaches the cache).
``order_loads`` makes the compute stream wait for those writes without a host wait (the
connector calls it before the forward is launched); ``wait_loads`` (before the step's stores)
reads the step's flags once (its only synchronisation, on the decode stream's event), drops
damaged entries and reports their blocks as failed (vLLM recomputes them). Without the device
scatter (``device_scatter=False``, the CPU device, a CPU page order) ``wait_loads`` reads the
flags first and then scatters the good chunks with torch on the compute stream, and the forward
waits for it. Entries that cannot be batch-decoded (blobs that embed their own table: stored
with ``fit_tokens=0``, or by another path) are decoded chunk by chunk with
``kvzip_lossless.decompress`` and written by ``wait_loads`` (``order_loads`` then defers to it).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

import kvzip_lossless
from kvzip_formats import settings as table
from kvzip_vllm.core import scatter
from kvzip_vllm.core.blocks import as_ids
from kvzip_vllm.core.cuda_stores import (  # noqa: F401  (the store path's settings, here too)
    ENCODE_BYTES,
    ENCODE_WORKSPACE,
    QUEUE_CAP_BYTES,
    QUEUE_CPU_BYTES,
    SPILL_FRACTION,
    SPILL_GROUP,
    STORE_STREAM_PRIORITY,
    STORE_WAIT_LIMIT_S,
    StorePath,
    default_queue_bytes,
)
from kvzip_vllm.core.pages import Bf16Pages
from kvzip_vllm.core.store import Arena, BlockStore

logger = logging.getLogger("kvzip_vllm.cuda_pipeline")

#: Chunks per group of a load step: the copies of group g+1 overlap the decode of group g,
#: and only the last group's decode follows the last copy. Each group costs one prepare (numpy
#: over its plans) and four launches. Measured on the H200 (results/vllm/tier_restore/, 8B
#: shape, 256-token chunks): 16 chunks per group, at most 16 groups, restore 0.83-0.87x a raw
#: copy. A step of n chunks now runs in ceil(n / 16) groups of at most 16 (more than 16 groups
#: past 256 chunks), so that the restore ring's device buffers are sized once, for 16 chunks.
#: ``KVZIP_LOAD_GROUP_CHUNKS`` sets the chunks per group (for measuring the split).
BLOCKS_PER_GROUP = table.LOAD_GROUP_CHUNKS.get()


#: Device buffers the step's records are copied into, one chunk group each, reused round
#: robin (a group's copies wait on the device for the decode of the group before it in that
#: buffer): a restore holds ``LOAD_RING`` groups' records on the device, not the whole step's
#: (a 131,072-token 8B prefix took 11 GB, allocated per step), and allocates nothing per step.
#: The buffers are reserved when the pipeline is made, before the store queue is sized from
#: the free memory (8B shape: 3 x 16 chunks of at most 34 MB of records, and 16 decoded
#: chunks of 32 MB: about 2.1 GB).
LOAD_RING = 3
#: a record's bytes over its chunk's raw bytes, at most (blobs stored raw, with their headers)
RECORD_SLACK = 1.0625


class _LoadRing:
    """The loads' device buffers, kept from step to step: ``LOAD_RING`` record buffers with
    an event per buffer after the last decode that read it, and the decoded chunks' buffer
    (a group's, written on the device). They grow when a step needs more; the streams are
    synchronised first, so nothing still queued reads a buffer that is let go."""

    def __init__(self, device: torch.device, streams, depth: int = LOAD_RING):
        if depth < 2:
            raise ValueError(f"a load ring needs at least 2 buffers, got {depth}")
        self.device, self.streams, self.depth = device, streams, depth
        self._records: list[torch.Tensor] = []
        self._free: list = [None] * depth  # per buffer: the event after its last decode
        self._decoded: torch.Tensor | None = None
        self.grown = 0  # times a buffer was (re)allocated

    def _sync(self) -> None:
        for stream in self.streams:
            if stream is not None:
                stream.synchronize()

    def buffers(self, nbytes: int) -> list[torch.Tensor]:
        """The record buffers, each of at least ``nbytes`` (grown by a quarter more past
        what they hold)."""
        if not self._records or self._records[0].numel() < nbytes:
            self._sync()
            size = max(nbytes + nbytes // 4 if self._records else nbytes, 1 << 16)
            self._records = []  # (the old ones let go before the new ones are taken)
            self._records = [
                torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(self.depth)
            ]
            self._free = [None] * self.depth
            self.grown += 1
        return self._records

    @property
    def record_bytes(self) -> int:
        return self._records[0].numel() if self._records else 0

    @property
    def decoded_bytes(self) -> int:
        return 0 if self._decoded is None else self._decoded.numel() * 2

    def claim(self, i: int, stream) -> None:
        """``stream`` (the copies into buffer ``i``) waits for the last decode that read it."""
        if stream is not None and self._free[i] is not None:
            stream.wait_event(self._free[i])

    def release(self, i: int, stream) -> None:
        """Buffer ``i`` is free once the work queued on ``stream`` so far is done."""
        if stream is not None:
            self._free[i] = torch.cuda.Event()
            self._free[i].record(stream)

    def decoded(self, shape) -> torch.Tensor:
        """The decoded chunks' buffer viewed as ``shape`` (bf16)."""
        numel = int(np.prod(shape))
        if self._decoded is None or self._decoded.numel() < numel:
            self._sync()
            self._decoded = None
            self._decoded = torch.empty(numel, dtype=torch.bfloat16, device=self.device)
            self.grown += 1
        return self._decoded[:numel].view(shape)


@dataclass
class _Load:
    t0: float
    cpu0: float = 0.0  # the thread's CPU time at the start (time.thread_time)
    failed: set[int] = field(default_factory=set)
    dropped: list[bytes] = field(default_factory=list)
    # decoded chunks: (req, key, block ids, skip)
    blocks: list[tuple[str, bytes, tuple[int, ...], int]] = field(default_factory=list)
    out: torch.Tensor | None = None  # [2 * layers, n, chunk_tokens, kv_heads, head_size]
    flags: torch.Tensor | None = None  # [2 * layers * n] damage flags, slot-major
    keep: list = field(default_factory=list)  # tensors alive until the step is done
    leased: list = field(default_factory=list)  # store entries read by the step's copies
    single: list = field(default_factory=list)  # chunks decoded one by one: (load, outputs)
    copies: int = 0  # host-to-device copies issued for the step's records
    # the batched chunks written on the device (core.scatter), the flags' host copy and the
    # event after both (None: written by wait_loads on the host's reading of the flags)
    scattered: bool = False
    flags_host: torch.Tensor | None = None
    done: object = None
    ordered: bool = False  # the compute stream waits for the step's writes (order_loads)
    t_ordered: float = 0.0
    host_plan_s: float = 0.0  # host time: the step's offsets over the plans (numpy)
    host_s: float = 0.0  # host time of start_loads (lookups, plan, copies and launches)
    # an event on the engine's stream that the step's writes into the cache wait for on the
    # device (asynchronous loads: the work queued there before the load, e.g. store copies
    # of blocks vLLM has since freed); None once waited for, or for loads in the engine's step
    after: object = None


def _load_item(item) -> tuple[str, bytes, tuple[int, ...], int]:
    """``(req_id, key, block_ids[, skip])``; an int block id is a chunk of one block."""
    req_id, key, ids, *rest = item
    return req_id, key, as_ids(ids), int(rest[0]) if rest else 0


#: how long a load waits for its chunk's store still in flight before it fails (vLLM then
#: recomputes the chunk): about the time an 8B-shaped GPU recomputes a few thousand tokens
LOAD_WAIT_FOR_STORE_S = 1.0


class CudaTierPipeline(StorePath):
    def __init__(
        self,
        store: BlockStore,
        caches: list[torch.Tensor],
        block_size: int,
        bpc: int = 1,
        queue_bytes: int | None = None,
        spill_bytes: int | None = None,
        layout: Bf16Pages | None = None,
        device_scatter: bool | None = None,
        switch_interval_s: float | None = None,
        queue_reserved: bool = False,
        encode_bytes: int | None = None,
    ):
        if not caches:
            raise ValueError("caches must hold one paged-cache view per layer, got none")
        if bpc < 1:
            raise ValueError(f"blocks per chunk must be >= 1, got {bpc}")
        self.store = store
        self.switch_interval_s = switch_interval_s  # while the store thread codes (core.gil)
        self.caches = caches
        self.block_size = block_size
        self.bpc = bpc  # paged-cache blocks per stored chunk
        self.device = caches[0].device
        #: the caches' layout: the one gather / scatter (``core.pages``) every path uses
        self.layout = layout or Bf16Pages.of(caches[0])
        _, h, n, c = caches[0].shape
        self.block_shape = (n * bpc, h, c // 2)  # token-major [chunk_tokens, kv_heads, head]
        cuda = self.device.type == "cuda"
        # the batched chunks written by one masked launch on the decode stream (core.scatter):
        # no host synchronisation before the forward (the default on CUDA); else by torch
        # after the host has read the flags
        why = scatter.supported(caches) if self.layout.k_index is None else "a CPU page order"
        if device_scatter is None:
            device_scatter = cuda and why is None
        elif device_scatter and why is not None:
            raise ValueError(f"device_scatter: not for these caches ({why})")
        self.device_scatter = device_scatter
        self._bases = scatter.layer_pointers(caches) if device_scatter else None
        if device_scatter:  # its kernel compiled now, not at the first restore
            scatter.warm_up(caches, self._bases)
        if cuda:  # builds kvzip-lossless's CUDA coder now (nvcc, ~10 s once), not mid-step
            logger.info("kvzip tier: GPU coder %s", kvzip_lossless.coder(self.device))
        new_stream = (lambda: torch.cuda.Stream(self.device)) if cuda else (lambda: None)
        self.copy_stream, self.decode_stream = (new_stream() for _ in range(2))
        self.store_stream = (
            torch.cuda.Stream(self.device, priority=STORE_STREAM_PRIORITY) if cuda else None
        )
        # spilled chunks brought back to the device ahead of their turn (``_start_unspill``)
        self.unspill_stream = torch.cuda.Stream(self.device) if cuda else None
        self._ring = _LoadRing(self.device, (self.copy_stream, self.decode_stream))
        # reserved now, before the store queue takes half of what is free
        raw = 2 * len(caches) * int(np.prod(self.block_shape)) * 2  # a chunk's bf16 bytes
        self._ring.buffers(int(BLOCKS_PER_GROUP * raw * RECORD_SLACK) + (1 << 16))
        if self.device_scatter:
            self._ring.decoded((2 * len(caches), BLOCKS_PER_GROUP, *self.block_shape))
        if cuda:
            logger.info(
                "kvzip tier: restore ring %d x %.0f MB of records, %.0f MB decoded",
                LOAD_RING, self._ring.record_bytes / 1e6, self._ring.decoded_bytes / 1e6,
            )  # fmt: skip
        if cuda:  # the arena page-locked: records are copied to the GPU from where they lie
            store.pin()
        # every entry holds its decode plan (also those the shared tier's fetches put)
        store.planner = self._plan_entry
        self._fit_jobs: list = []  # store jobs waiting for the table set (fit_tokens)
        self._tables, self._slot_tables = store.tables, {}  # device copies of the set's tables
        self._load: _Load | None = None
        self.last_host_s: dict[str, float] = {}  # host time of the last load step, by part
        self.last_copies = 0  # host-to-device copies of the last load step
        self._carry: set[int] = set()  # failures of loads finished by a later start_loads
        self._dropped: list[bytes] = []
        self._done: queue.Queue = queue.Queue()
        self._jobs: queue.Queue = queue.Queue()
        if encode_bytes is None:
            encode_bytes = ENCODE_BYTES
        if encode_bytes <= 0:
            raise ValueError(f"encode_bytes must be > 0, got {encode_bytes}")
        self.encode_bytes = encode_bytes  # bf16 bytes coded per encode_batch call, at most
        if queue_bytes is None:
            queue_bytes = default_queue_bytes(self.device, encode_bytes)
            logger.info("kvzip tier: store queue %.2f GB (store_queue_bytes)", queue_bytes / 1e9)
        if queue_bytes <= 0:
            raise ValueError(f"queue_bytes must be > 0, got {queue_bytes}")
        self.queue_bytes = queue_bytes  # staged copies waiting for the store thread, at most
        # the queue's device memory reserved now, extents handed out per job (no allocation
        # per step: a cudaMalloc that fails beside vLLM's cache makes torch free its cached
        # blocks and retry, which waits for the whole device, the forward included)
        self._queue_arena = Arena(queue_bytes, self.device) if queue_reserved else None
        self._queued = 0  # bytes of staged copies queued or being coded
        self._queued_lock = threading.Lock()
        self._room = threading.Condition(self._queued_lock)  # notified as the queue drains
        if spill_bytes is None:
            spill_bytes = int(store.budget_bytes * SPILL_FRACTION)
        if spill_bytes < 0:
            raise ValueError(f"spill_bytes must be >= 0 (0: no spill), got {spill_bytes}")
        self.spill_bytes = spill_bytes  # raw chunks spilled to the host at once, at most
        self._spilled = 0  # bytes of spill extents held
        self._thread = threading.Thread(target=self._store_loop, daemon=True)
        self._thread.start()

    # -- loads --------------------------------------------------------------------------
    def start_loads(self, loads, after=None) -> None:
        """Begin restoring ``(req_id, key, block_ids, skip)`` chunks into the paged cache
        (asynchronous): the chunk's blocks after the first ``skip`` are written, on the device
        after the event ``after`` (CUDA; its copies and decodes need not wait for it)."""
        self._carry = self.wait_loads()  # a previous step's loads, if never waited for
        load = self._load = _Load(time.perf_counter(), time.thread_time())
        load.after = after
        n_tensors = 2 * len(self.caches)
        numel = int(np.prod(self.block_shape))
        good, plans, records = [], [], []
        deadline: list[float] = []  # one bound for the step's waits for stores in flight
        for item in loads:
            req_id, key, ids, skip = _load_item(item)
            if len(ids) != self.bpc or not 0 <= skip < self.bpc:
                raise ValueError(
                    f"a load names {len(ids)} blocks (skip {skip}); a chunk is {self.bpc} blocks"
                )
            entry = self.store.lease(key)
            if (
                entry is None
                and self._jobs.unfinished_tasks
                and self._wait_for_store(key, deadline)
            ):
                entry = self.store.lease(key)
            if entry is None:
                load.failed.update(ids[skip:])
                load.dropped.append(key)
                continue
            load.leased.append(entry)
            plan = entry.aux
            if plan is None and self.store.tables is not None:  # put without one
                plan = self._plan_entry(entry.blobs)[0]
            if isinstance(plan, np.ndarray) and self._plans_match(plan, entry, n_tensors, numel):
                good.append((req_id, key, ids, skip))
                plans.append(plan)
                records.append(entry)
                continue
            # no batch plan (blobs embedding their tables): decoded here, chunk by chunk
            outs = [
                torch.empty(self.block_shape, dtype=torch.bfloat16, device=self.device)
                for _ in range(n_tensors)
            ]
            if self.store.get(key, outs):
                load.single.append(((req_id, key, ids, skip), outs))
            else:
                logger.warning("kvzip tier: chunk %s failed to decode: dropped", key[:4].hex())
                load.failed.update(ids[skip:])
                load.dropped.append(key)
        self.store.stats.load_lookup_seconds += time.perf_counter() - load.t0
        if good:
            self._start_batched(load, good, plans, records)
        load.host_s = time.perf_counter() - load.t0
        self.store.stats.load_host_seconds += load.host_s
        self.store.stats.load_host_cpu_seconds += time.thread_time() - load.cpu0

    def _wait_for_store(self, key: bytes, deadline: list[float]) -> bool:
        """Wait for ``key`` to be stored: a chunk stored by an earlier step and still coded in
        the background (the scheduler counts such chunks as held, since an idle server takes
        no step that would report them). ``deadline`` is the load step's one bound, set at its
        first wait to ``LOAD_WAIT_FOR_STORE_S`` from then and shared by every chunk of the
        step (a bound per chunk let one step of many missing chunks wait a second for each:
        2.6 s for one warm-up load on the H200, results/vllm/fixed_cost/h200_restore.md).
        True once it is stored; False past the bound or once no store is left in flight (the
        load then fails and vLLM recomputes the chunk, which a long store queue can make the
        faster way)."""
        self.store.stats.loads_waited_for_store += 1
        if not deadline:
            deadline.append(time.monotonic() + LOAD_WAIT_FOR_STORE_S)
        while True:
            busy = self._jobs.unfinished_tasks  # (read first: a store done by now is seen)
            if key in self.store:
                return True
            if not busy or time.monotonic() >= deadline[0]:
                return False
            time.sleep(0.001)

    def wait_loads(self) -> set[int]:
        """Finish the started loads; returns the block ids that failed (missing or damaged:
        vLLM must recompute them). Idempotent: an empty set when nothing is pending."""
        load, self._load = self._load, None
        failed, self._carry = self._carry, set()
        if load is None:
            return failed
        t_wait = time.perf_counter()
        failed |= load.failed
        self.last_host_s = {"start_loads": load.host_s, "plan": load.host_plan_s}
        self.last_copies = load.copies
        s = self.store.stats
        hits: dict[str, int] = {}
        tokens = 0
        try:
            if load.blocks:
                n, b = len(load.blocks), self.bpc
                if self.decode_stream is not None and not load.ordered:
                    torch.cuda.current_stream(self.device).wait_stream(self.decode_stream)
                if load.done is not None:  # written on the device: only the flags to read
                    load.done.synchronize()  # the step's one sync (the decode stream only)
                    bad = load.flags_host.numpy()
                elif load.scattered:
                    bad = load.flags_host.numpy()
                else:
                    bad = load.flags.cpu().numpy()  # the step's one sync
                for j in np.flatnonzero(bad):
                    _, key, ids, skip = load.blocks[j]
                    logger.warning(
                        "kvzip tier: chunk %s failed its checksums: dropped", key[:4].hex()
                    )
                    self.store.drop(key)
                    failed.update(ids[skip:])
                    load.dropped.append(key)
                rows, dest = [], []  # the decoded blocks to write, and where
                for j in range(n):
                    if bad[j]:
                        continue
                    req_id, _, ids, skip = load.blocks[j]
                    rows.extend(j * b + i for i in range(skip, b))
                    dest.extend(ids[skip:])
                    hits[req_id] = hits.get(req_id, 0) + 1
                    tokens += (b - skip) * self.block_size
                if rows and not load.scattered:
                    self._after(load)
                    out = load.out.view(load.out.shape[0], n * b, self.block_size,
                                        *self.block_shape[1:])  # fmt: skip
                    if rows != list(range(n * b)):
                        out = out[:, torch.tensor(rows, device=self.device)]
                    ids = torch.tensor(dest, device=self.device)
                    for layer, cache in enumerate(self.caches):
                        self.layout.scatter(cache, ids, out[2 * layer], out[2 * layer + 1])
            for (req_id, _, ids, skip), outs in load.single:  # decoded one by one
                self._after(load)
                b, n = self.bpc, self.block_size
                rows = torch.arange(skip, b, device=self.device)
                dest = torch.tensor(ids[skip:], device=self.device)
                for layer, cache in enumerate(self.caches):
                    k, v = (outs[2 * layer + i].view(b, n, *self.block_shape[1:]) for i in (0, 1))
                    self.layout.scatter(cache, dest, k[rows], v[rows])
                hits[req_id] = hits.get(req_id, 0) + 1
                tokens += (b - skip) * n
        finally:
            self.store.unlease(load.leased)  # the copies have landed (the sync above)
        s.restore_hits += len(hits)
        s.blocks_restored += sum(hits.values())
        s.tokens_restored += tokens
        s.load_errors += len(load.dropped)  # one key per failed chunk
        t_end = time.perf_counter()
        # (loads ordered before the forward: start to ordered, then the wait for the flags;
        # the forward's own host time between them is not the restore's)
        s.restore_seconds += (
            (load.t_ordered - load.t0) + (t_end - t_wait) if load.ordered else t_end - load.t0
        )
        s.load_wait_seconds += t_end - t_wait
        self._dropped.extend(load.dropped)
        return failed

    # -- kvzip-lossless's public batched coder ------------------------------------------
    def _plan_entry(self, blobs):
        """The store's planner for entries put without a plan (e.g. fetched from the shared
        tier): their blobs' batch plans, or none for blobs that embed their tables (those
        are decoded one by one)."""
        try:
            plans = np.ascontiguousarray(kvzip_lossless.plan_blobs(blobs), np.int64)
        except (ValueError, kvzip_lossless.CorruptBlobError):  # embedded table, or damaged
            return None, 0, None
        return plans, plans.nbytes, None

    def _plans_match(self, plans: np.ndarray, entry, n_tensors: int, numel: int) -> bool:
        """An entry's batch plans agree with its blobs and this cache's shape."""
        return (
            plans.shape == (n_tensors, len(kvzip_lossless.PLAN_FIELDS))
            and (plans[:, 1] == numel).all()
            and tuple(plans[:, 0].tolist()) == tuple(map(len, entry.blobs))
            and int(plans[:, 0].sum()) <= entry.size
        )

    def _start_batched(self, load: _Load, good, plans, records) -> None:
        """A load step through ``kvzip_lossless.decode_batch``: the records (blobs back to
        back) copied group by group into a ring of ``LOAD_RING`` device buffers (one copy per
        run of records lying back to back in the arena), one decode call per chunk group as
        its copies land; a group's copies wait on the device until the decode of the group
        that last used their buffer is done."""
        n, S = len(good), 2 * len(self.caches)
        numel = int(np.prod(self.block_shape))
        order = self.store.record_order(records)
        good, plans, records = ([x[j] for j in order] for x in (good, plans, records))
        load.blocks = good
        t_host = time.perf_counter()
        all_plans = np.concatenate(plans)  # [n * S, PLAN_WIDTH], chunk-major
        batch = self.store.record_batch(records, all_plans[:, 0].reshape(n, S))
        offsets = batch.offsets
        j_idx, s_idx = np.divmod(np.arange(n * S), S)
        groups = -(-n // BLOCKS_PER_GROUP)  # (each of at most BLOCKS_PER_GROUP chunks)
        bounds = np.linspace(0, n, groups + 1).astype(int)
        bounds = list(zip(bounds[:-1], bounds[1:], strict=True))
        # each group's records from its own buffer's start: [lo, hi) of the batch's bytes
        ends = np.append(batch.base, batch.nbytes)
        spans = [(int(ends[j0]), int(ends[j1])) for j0, j1 in bounds]
        load.host_plan_s = time.perf_counter() - t_host
        st = self.store.stats
        st.load_plan_seconds += load.host_plan_s
        t_alloc = time.perf_counter()
        ring = self._ring.buffers(max(hi - lo for lo, hi in spans))
        # Written on the device, each group is decoded into one buffer of the largest group's
        # size and written into the cache right behind its decode (the same stream), so the
        # decoded bf16 takes a group's bytes on the device, not the whole step's (a 131,072-
        # token 8B prefix: 0.5 GB instead of 17 GB, outside vLLM's memory accounting), and
        # that buffer is the ring's, reserved with it. Otherwise (the host reads the flags
        # first) every chunk keeps its decoded copy until wait_loads scatters the good ones.
        bounded = self.device_scatter
        cap = max(j1 - j0 for j0, j1 in bounds) if bounded else n
        if bounded:
            out = self._ring.decoded((S, cap, *self.block_shape))
        else:
            out = torch.empty((S, cap, *self.block_shape), dtype=torch.bfloat16,
                              device=self.device)  # fmt: skip
        st.load_alloc_seconds += time.perf_counter() - t_alloc
        cur = torch.cuda.current_stream(self.device) if self.decode_stream is not None else None
        for stream in (self.copy_stream, self.decode_stream):
            if stream is not None:
                stream.wait_stream(cur)
        flat = out.view(-1)

        def prepare(g):
            # out is [S, cap, *chunk shape], slot-major; a group's chunks from its row 0
            t = time.perf_counter()
            (j0, j1), (lo, _) = bounds[g], spans[g]
            rel = j_idx[j0 * S : j1 * S] - (j0 if bounded else 0)
            out_offsets = (s_idx[j0 * S : j1 * S] * cap + rel) * numel
            prep = kvzip_lossless.prepare_decode_batch(
                ring[g % len(ring)], offsets[j0 * S : j1 * S] - lo, all_plans[j0 * S : j1 * S],
                tables=self.store.tables, out=flat, out_offsets=out_offsets,
            )  # fmt: skip
            st.load_prepare_seconds += time.perf_counter() - t
            return prep

        t_launch, prep0 = time.perf_counter(), st.load_prepare_seconds
        copied = []  # per group: the event after its copies (CUDA)

        def copy(g):  # (issued on the copy stream once the group's buffer is free)
            (j0, j1), (lo, _) = bounds[g], spans[g]
            with self._on(self.copy_stream):
                self._ring.claim(g % len(ring), self.copy_stream)
                load.copies += self.store.copy_records(batch, ring[g % len(ring)], j0, j1, lo)
                if self.copy_stream is not None:
                    copied.append(torch.cuda.Event())
                    copied[-1].record(self.copy_stream)

        # Where preparing copies nothing (the CUDA decoder reads its descriptors from
        # page-locked host memory), the copies run ahead of the decodes (a ring's worth) and
        # the host prepares while they run. Otherwise every group's descriptors go up first,
        # ahead of the bulk copies on the copy engine: queued behind them, they held the whole
        # decode until the whole copy had landed (restore = copy + decode: 1.11-1.15x a raw
        # copy on the H200).
        early = not kvzip_lossless.prepare_copies_nothing(self.device)
        preps = []
        if early:
            with self._on(self.copy_stream):
                preps = [prepare(g) for g in range(len(bounds))]
        ahead = min(len(ring) - 1, len(bounds))
        for g in range(ahead):
            copy(g)
        bads = []
        for g, (j0, j1) in enumerate(bounds):
            if g + ahead < len(bounds):
                copy(g + ahead)  # its buffer's last decode (group g - 1) is already queued
            with self._on(self.decode_stream):
                if not early:
                    preps.append(prepare(g))
                if copied:
                    self.decode_stream.wait_event(copied[g])
                bads.append(preps[g].run()[1])
                self._ring.release(g % len(ring), self.decode_stream)
                if bounded:  # the group's chunks written before the next group's decode
                    self._scatter_on_device(load, good[j0:j1], out, bads[-1].view(-1, S).amax(1))
        with self._on(self.decode_stream):
            load.flags = torch.cat(bads).view(n, S).amax(1)  # per chunk, on the device
            if bounded:
                self._flags_to_host(load)
        load.out = None if bounded else out
        # (the prepared decodes' buffers, allocated on the copy or the decode stream and read
        # on the decode stream: held until the step's sync in wait_loads)
        load.keep += [records, preps, out]
        # (the launches' time, less the preparing done between them)
        prep = st.load_prepare_seconds - prep0
        st.load_launch_seconds += time.perf_counter() - t_launch - prep
        load.host_s = time.perf_counter() - load.t0

    def _scatter_on_device(self, load: _Load, good, out: torch.Tensor, flags) -> None:
        """On the decode stream (current): decoded chunks ``good`` (rows 0.. of ``out``)
        written into the caches by one masked launch (a chunk whose flag is set is not
        written); nothing here waits."""
        b = self.bpc
        plan = [
            (j * b + i, ids[i], j)
            for j, (_, _, ids, skip) in enumerate(good)
            for i in range(skip, b)
        ]  # fmt: skip
        if not plan:
            return
        self._after(load)
        cols = [x for col in zip(*plan, strict=True) for x in col]  # rows, blocks, chunks
        dev = self._device_ids(cols).view(3, len(plan))  # [3, R], uploaded without a sync
        rows = out.view(out.shape[0], out.shape[1] * b, self.block_size, *self.block_shape[1:])
        flags = flags.to(torch.int32)
        scatter.masked_scatter(rows, self.caches, self._bases, dev, flags)
        load.keep += [dev, flags]

    def _after(self, load: _Load) -> None:
        """The current stream (the one about to write the step's chunks into the cache) waits
        on the device for ``load.after``, once."""
        if load.after is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_event(load.after)
        load.after = None

    def _flags_to_host(self, load: _Load) -> None:
        """The step's flags copied to the host behind its writes, and an event after both (the
        chunks are written on the device: ``load.scattered``)."""
        flags = load.flags.to(torch.int32)
        if self.device.type == "cuda":
            load.flags_host = torch.empty(flags.shape, dtype=torch.int32, pin_memory=True)
            load.flags_host.copy_(flags, non_blocking=True)
            load.done = torch.cuda.Event()
            load.done.record()
        else:
            load.flags_host = flags
        load.keep.append(flags)
        load.scattered = True

    def order_loads(self) -> bool:
        """Make the compute stream wait for the started loads' writes into the caches without
        waiting on the host (their failures are read later, by :meth:`wait_loads`, before the
        step's stores). False when the loads' writes need :meth:`wait_loads` first: chunks
        decoded one by one, or written by torch after the host has read the flags."""
        load = self._load
        if load is None or load.ordered:
            return True
        if load.single or (load.blocks and not load.scattered):
            return False
        if self.decode_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.decode_stream)
        load.ordered, load.t_ordered = True, time.perf_counter()
        return True

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)
