"""The tier's loads and stores on the GPU (connector.py uses it when the paged cache is on CUDA).

No vLLM here: the pipeline sees the per-layer paged-cache views (:mod:`kvzip_vllm.blocks`) and
the :class:`~kvzip_vllm.store.BlockStore`. On a CPU device it runs the same steps with no
streams (the Triton decode kernel under ``TRITON_INTERPRET=1``), which is how it is tested
without a GPU.

Loads (``start_loads`` before the forward, ``wait_loads`` before the first layer reads the
cache): on CUDA the store keeps each entry as one page-locked record (its blobs, then its
decode plan's bulk: :func:`kvzip_vllm.store.pack_record`), so each block is one host-to-device
copy from where it lies, with no staging memcpy, and the plans are shifted on the device (host
staging and plan shift took 54.9 of the 56.3 ms of a 64-block restore on the H200 before,
results/vllm/cuda_tier_restore.md; on this project's 2-core CPU host they were 18 ms of memcpy
and 8-15 ms of numpy, now 0.7 ms of numpy and ~270 small device ops). Every copy is
issued first on a copy stream, in a few block groups; on a decode stream each group's plan is
shifted on the device (:meth:`DecodeStep.prepare`) and decoded, one kernel launch per
table-set slot for the group's blocks (:mod:`kvzip_vllm.batch_decode`), as soon as its copies
have landed. ``wait_loads`` makes the compute stream wait, reads one damage flag per block (the
step's only synchronisation), drops damaged entries from the store and reports their blocks as
failed (vLLM recomputes them), and copies the good ones from the decode buffer into the paged
cache on the compute stream: a damaged blob's output never reaches the cache.

Stores (``start_stores`` after the forward): the blocks are gathered token-major on the compute
stream (so vLLM may reuse them at once); a worker thread encodes them on its own stream (GPU
encoder for CUDA tensors once the table set exists), plans their decode, and puts them in the
store; ``collect`` reports the keys stored and dropped (evicted, skipped, damaged or missing).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

import kvzip_lossless
from kvzip_vllm.batch_decode import BlockPlan, DecodeStep, plan_block
from kvzip_vllm.blocks import as_ids, gather_token_major, scatter_token_major
from kvzip_vllm.store import RECORD_ALIGN, BlockStore, pack_record

logger = logging.getLogger("kvzip_vllm.cuda_pipeline")

#: Block groups per load step: the copies of group g+1 overlap the decode of group g. Each
#: group costs the host ~45 small device ops (its plan shift) and one decode launch per slot
#: (60 for Llama-8B), an estimated 0.5-1 ms; a group of 32 such blocks is 58 MB of records at
#: the synthetic data's 1.075x, ~1 ms of copy at the H200's 55 GB/s (2.30 ms per 125.8 MB,
#: results/vllm/cuda_tier_restore.md): so groups of at least 32 blocks, at most 8 groups.
BLOCKS_PER_GROUP, MAX_GROUPS = 32, 8


@dataclass
class _Load:
    t0: float
    failed: set[int] = field(default_factory=set)
    dropped: list[bytes] = field(default_factory=list)
    # decoded chunks: (req, key, block ids, skip)
    blocks: list[tuple[str, bytes, tuple[int, ...], int]] = field(default_factory=list)
    out: torch.Tensor | None = None  # [2 * layers, n, chunk_tokens, kv_heads, head_size]
    flags: torch.Tensor | None = None  # [2 * layers * n] damage flags, slot-major
    keep: list = field(default_factory=list)  # tensors alive until the step is done
    leased: list = field(default_factory=list)  # store entries read by the step's copies
    copies: int = 0  # host-to-device copies issued for the step's records
    host_plan_s: float = 0.0  # host time: the step's per-blob plan (DecodeStep)
    host_s: float = 0.0  # host time of start_loads (lookups, plan, copies and launches)


def plan_blobs(blobs: tuple[bytes, ...], tables) -> tuple[BlockPlan, int, np.ndarray]:
    """``BlockStore.put``'s ``plan`` hook: the decode plan of a chunk's blobs, its host bytes,
    and its tail (kept after the blobs in the entry's record)."""
    plan = plan_block(blobs, tables)
    return plan.without_tail(), plan.host_bytes, plan.tail


def _load_item(item) -> tuple[str, bytes, tuple[int, ...], int]:
    """``(req_id, key, block_ids[, skip])``; an int block id is a chunk of one block."""
    req_id, key, ids, *rest = item
    return req_id, key, as_ids(ids), int(rest[0]) if rest else 0


class CudaTierPipeline:
    def __init__(
        self, store: BlockStore, caches: list[torch.Tensor], block_size: int, bpc: int = 1
    ):
        if not caches:
            raise ValueError("caches must hold one paged-cache view per layer, got none")
        if bpc < 1:
            raise ValueError(f"blocks per chunk must be >= 1, got {bpc}")
        self.store = store
        self.caches = caches
        self.block_size = block_size
        self.bpc = bpc  # paged-cache blocks per stored chunk
        self.device = caches[0].device
        _, h, n, c = caches[0].shape
        self.block_shape = (n * bpc, h, c // 2)  # token-major [chunk_tokens, kv_heads, head]
        cuda = self.device.type == "cuda"
        if cuda:  # builds kvzip-lossless's CUDA coder now (nvcc, ~10 s once), not mid-step
            from kvzip_lossless import gpu

            logger.info("kvzip tier: GPU coder %s", gpu.default_backend(self.device))
        new_stream = (lambda: torch.cuda.Stream(self.device)) if cuda else (lambda: None)
        self.copy_stream, self.decode_stream, self.store_stream = (new_stream() for _ in range(3))
        if cuda:  # the arena page-locked: records are copied to the GPU from where they lie
            store.pin()
        # every entry holds its decode plan (also those the shared tier's fetches put)
        store.planner = self._plan_entry
        self._batch_ok: bool | None = None  # kvzip-lossless's batched coder runs here
        self._batch_tables = None
        self._tables, self._slot_tables = store.tables, {}  # device copies of the set's tables
        self._load: _Load | None = None
        self.last_host_s: dict[str, float] = {}  # host time of the last load step, by part
        self.last_copies = 0  # host-to-device copies of the last load step
        self._carry: set[int] = set()  # failures of loads finished by a later start_loads
        self._dropped: list[bytes] = []
        self._done: queue.Queue = queue.Queue()
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._store_loop, daemon=True)
        self._thread.start()

    # -- helpers ------------------------------------------------------------------------
    def _on(self, stream):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    # -- loads --------------------------------------------------------------------------
    def start_loads(self, loads) -> None:
        """Begin restoring ``(req_id, key, block_ids, skip)`` chunks into the paged cache
        (asynchronous): the chunk's blocks after the first ``skip`` are written."""
        self._carry = self.wait_loads()  # a previous step's loads, if never waited for
        load = self._load = _Load(time.perf_counter())
        n_tensors = 2 * len(self.caches)
        numel = int(np.prod(self.block_shape))
        good, plans, blobs, records, offs, batched = [], [], [], [], [], []
        cuda = self.device.type == "cuda"
        for item in loads:
            req_id, key, ids, skip = _load_item(item)
            if len(ids) != self.bpc or not 0 <= skip < self.bpc:
                raise ValueError(
                    f"a load names {len(ids)} blocks (skip {skip}); a chunk is {self.bpc} blocks"
                )
            entry = self.store.lease(key)
            plan = None
            if entry is not None:
                load.leased.append(entry)
                entry_blobs, plan, data, off = entry.blobs, entry.aux, None, entry.off
                if isinstance(plan, np.ndarray):  # batch plans (kvzip_lossless.PLAN_FIELDS)
                    if self._plans_match(plan, entry, n_tensors, numel):
                        batched.append(entry)
                        good.append((req_id, key, ids, skip))
                        plans.append(plan)
                        blobs.append(entry_blobs)
                        records.append(self.store.record(entry))
                        offs.append(off)
                        continue
                    plan = None  # decoded by the step below, planned now
                try:
                    if not isinstance(plan, BlockPlan):  # stored without one (the CPU path)
                        plan = plan_block(entry_blobs, self.store.tables)
                        data, _ = pack_record(entry_blobs, plan.tail, pin_memory=cuda)
                        plan, off = plan.without_tail(), -1
                    else:
                        data = self.store.record(entry)
                    sizes, plan_numel, record_bytes = plan.shape_key
                    if (
                        len(sizes) != n_tensors
                        or plan_numel != numel
                        or tuple(map(len, entry_blobs)) != sizes
                        or data.numel() != record_bytes
                    ):
                        raise kvzip_lossless.CorruptBlobError("entry does not match its plan")
                except kvzip_lossless.CorruptBlobError as e:
                    logger.warning("kvzip tier: chunk %s dropped: %s", key[:4].hex(), e)
                    self.store.drop(key)
                    plan = None
            if plan is None:
                load.failed.update(ids[skip:])
                load.dropped.append(key)
                continue
            good.append((req_id, key, ids, skip))
            plans.append(plan)
            blobs.append(entry_blobs)
            records.append(data)
            offs.append(off)
        n = len(good)
        if n == 0:
            return
        if len(batched) == n and self._batched():
            return self._start_batched(load, good, plans, records, offs)
        if batched:  # a step of mixed entries: the batch-planned ones planned here too
            for j, plan in enumerate(plans):
                if isinstance(plan, np.ndarray):
                    full = plan_block(blobs[j], self.store.tables)
                    records[j], _ = pack_record(blobs[j], full.tail, pin_memory=cuda)
                    plans[j], offs[j] = full.without_tail(), -1
        # in arena order: records of consecutive extents go to the device in one copy
        order = sorted(range(n), key=lambda j: (offs[j] < 0, offs[j]))
        good, plans, blobs, records, offs = (
            [x[j] for j in order] for x in (good, plans, blobs, records, offs)
        )
        load.blocks = good
        t_host = time.perf_counter()
        if self._tables is not self.store.tables:
            self._tables, self._slot_tables = self.store.tables, {}
        step = DecodeStep(plans, blobs, self.device, self._tables, self._slot_tables)
        load.host_plan_s = time.perf_counter() - t_host
        blob_dev = torch.empty(step.total, dtype=torch.uint8, device=self.device)
        out = torch.empty(
            (n_tensors, n, *self.block_shape), dtype=torch.bfloat16, device=self.device
        )
        cur = torch.cuda.current_stream(self.device) if self.decode_stream is not None else None
        for stream in (self.copy_stream, self.decode_stream):
            if stream is not None:
                stream.wait_stream(cur)  # the buffers above were allocated on the compute stream
        with self._on(self.decode_stream):
            step.upload()
        # every record straight from the store's (page-locked) arena, no host staging copy;
        # a run of records that lie back to back in the arena (and so in the step) is one
        # copy; all copies issued first (the copy engine never waits for the host's decode
        # launches), each chunk group's plan shift and decode waits for its own copies only
        groups = max(1, min(MAX_GROUPS, n // BLOCKS_PER_GROUP))
        bounds = np.linspace(0, n, groups + 1).astype(int)
        events = []
        arena = self.store.arena.buf
        with self._on(self.copy_stream):
            for j0, j1 in zip(bounds[:-1], bounds[1:], strict=True):
                j = j0
                while j < j1:
                    k = j + 1
                    if offs[j] >= 0:
                        while (
                            k < j1
                            and offs[k] >= 0
                            and offs[k] - offs[j] == int(step.rec_base[k] - step.rec_base[j])
                        ):
                            k += 1
                    a = int(step.rec_base[j])
                    if k - j > 1:
                        end = offs[k - 1] + records[k - 1].numel()
                        src = arena[offs[j] : end]
                    else:
                        src = records[j]
                    blob_dev[a : a + src.numel()].copy_(src, non_blocking=True)
                    load.copies += 1
                    j = k
                if self.copy_stream is not None:
                    events.append(torch.cuda.Event())
                    events[-1].record(self.copy_stream)
        for g, (j0, j1) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            with self._on(self.decode_stream):
                if events:
                    self.decode_stream.wait_event(events[g])
                step.prepare(j0, j1, blob_dev)
                step.decode(j0, j1, blob_dev, out)
        with self._on(self.decode_stream):
            load.flags = step.finish(blob_dev, out).view(-1, n).amax(0)  # per chunk
        load.out = out
        # the records stay leased until the step is done (an entry evicted meanwhile keeps
        # its arena extent until then; an unplanned one's own pinned copy stays referenced)
        load.keep += [blob_dev, step, records]
        load.host_s = time.perf_counter() - load.t0

    def wait_loads(self) -> set[int]:
        """Finish the started loads; returns the block ids that failed (missing or damaged:
        vLLM must recompute them). Idempotent: an empty set when nothing is pending."""
        load, self._load = self._load, None
        failed, self._carry = self._carry, set()
        if load is None:
            return failed
        failed |= load.failed
        self.last_host_s = {"start_loads": load.host_s, "plan": load.host_plan_s}
        self.last_copies = load.copies
        s = self.store.stats
        hits: dict[str, int] = {}
        tokens = 0
        try:
            if load.blocks:
                n, b = len(load.blocks), self.bpc
                if self.decode_stream is not None:
                    torch.cuda.current_stream(self.device).wait_stream(self.decode_stream)
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
                if rows:
                    out = load.out.view(load.out.shape[0], n * b, self.block_size,
                                        *self.block_shape[1:])  # fmt: skip
                    if rows != list(range(n * b)):
                        out = out[:, torch.tensor(rows, device=self.device)]
                    ids = torch.tensor(dest, device=self.device)
                    for layer, cache in enumerate(self.caches):
                        scatter_token_major(cache, ids, out[2 * layer], out[2 * layer + 1])
        finally:
            self.store.unlease(load.leased)  # the copies have landed (the sync above)
        s.restore_hits += len(hits)
        s.blocks_restored += sum(hits.values())
        s.tokens_restored += tokens
        s.load_errors += len(load.dropped)  # one key per failed chunk
        s.restore_seconds += time.perf_counter() - load.t0
        self._dropped.extend(load.dropped)
        return failed

    # -- stores -------------------------------------------------------------------------
    def start_stores(self, stores) -> None:
        """Queue ``(key, block_ids)`` chunks for storing; their bytes are copied before this
        returns (on the compute stream), so vLLM may reuse the blocks."""
        if not stores:
            return
        keys = [key for key, _ in stores]
        flat = []
        for _, ids in stores:
            ids = as_ids(ids)
            if len(ids) != self.bpc:
                raise ValueError(f"a store names {len(ids)} blocks; a chunk is {self.bpc}")
            flat.extend(ids)
        ids = torch.tensor(flat, device=self.device)
        m, (t, h, d) = len(stores), self.block_shape
        staged = [
            tuple(x.view(m, t, h, d) for x in gather_token_major(cache, ids))
            for cache in self.caches
        ]
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self._jobs.put((keys, staged, event))

    def _store_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                self._jobs.task_done()
                return
            keys, staged, event = job
            try:
                with self._on(self.store_stream):
                    if event is not None:
                        self.store_stream.wait_event(event)
                    if self._batched():
                        self._store_batched(keys, staged)
                        keys = []
                    for j, key in enumerate(keys):
                        layers = [(k[j], v[j]) for k, v in staged]
                        try:
                            nbytes, evicted = self.store.put(
                                key, layers, plan=lambda b: plan_blobs(b, self.store.tables)
                            )
                        except Exception:  # noqa: BLE001 (report the chunk as not stored)
                            logger.exception("kvzip tier: storing a chunk failed")
                            self.store.stats.store_errors += 1
                            nbytes, evicted = 0, []
                        self._done.put((key, nbytes, evicted))
                    if self.store_stream is not None:
                        self.store_stream.synchronize()  # staged is read there until now
            finally:
                self._jobs.task_done()

    # -- kvzip-lossless's public batched coder ------------------------------------------
    def _batched(self) -> bool:
        """Whether kvzip-lossless's batched coder (``encode_batch`` / ``decode_batch``) codes
        this step: a table set is there and a probe round trip on this device works (an
        older kvzip-lossless without it: the per-blob coder and this module's batched
        decode run instead)."""
        tables = self.store.tables
        if tables is None:
            return False
        if self._batch_ok is None or self._batch_tables is not tables:
            self._batch_tables = tables
            self._batch_ok = _probe_batched(self.device, tables, self.block_shape)
            logger.info("kvzip tier: kvzip-lossless batched coder %s",
                        "on" if self._batch_ok else "not available")  # fmt: skip
        return self._batch_ok

    def _plan_entry(self, blobs):
        """The store's planner for entries put without a plan (e.g. fetched from the shared
        tier): batch plans when the batched coder runs, else this module's decode plan."""
        if self._batched():
            try:
                plans = np.ascontiguousarray(kvzip_lossless.plan_blobs(blobs), np.int64)
                return plans, plans.nbytes, None
            except (ValueError, NotImplementedError):  # e.g. a blob embedding its table
                pass
        return plan_blobs(blobs, self.store.tables)

    def _plans_match(self, plans: np.ndarray, entry, n_tensors: int, numel: int) -> bool:
        """An entry's batch plans agree with its blobs and this cache's shape."""
        return (
            plans.shape == (n_tensors, len(kvzip_lossless.PLAN_FIELDS))
            and (plans[:, 1] == numel).all()
            and tuple(plans[:, 0].tolist()) == tuple(map(len, entry.blobs))
            and int(plans[:, 0].sum()) == entry.size
        )

    def _start_batched(self, load: _Load, good, plans, records, offs) -> None:
        """A load step through ``kvzip_lossless.decode_batch``: the records (blobs back to
        back) copied to one device buffer (one copy per run of records lying back to back in
        the arena), one decode call per chunk group as its copies land."""
        n, S = len(good), 2 * len(self.caches)
        numel = int(np.prod(self.block_shape))
        order = sorted(range(n), key=lambda j: offs[j])
        good, plans, records, offs = ([x[j] for j in order] for x in (good, plans, records, offs))
        load.blocks = good
        t_host = time.perf_counter()
        sizes = np.array([r.numel() for r in records], np.int64)
        ext = -(-sizes // RECORD_ALIGN) * RECORD_ALIGN
        rec_base = np.concatenate([[0], np.cumsum(ext)[:-1]]).astype(np.int64)
        all_plans = np.concatenate(plans)  # [n * S, PLAN_WIDTH], chunk-major
        lengths = all_plans[:, 0].reshape(n, S)
        in_rec = np.cumsum(lengths, 1) - lengths
        offsets = (rec_base[:, None] + in_rec).ravel()
        j_idx, s_idx = np.divmod(np.arange(n * S), S)
        out_offsets = (s_idx * n + j_idx) * numel  # out is [S, n, *chunk shape]: slot-major
        load.host_plan_s = time.perf_counter() - t_host
        blob_dev = torch.empty(int(ext.sum()), dtype=torch.uint8, device=self.device)
        out = torch.empty((S, n, *self.block_shape), dtype=torch.bfloat16, device=self.device)
        cur = torch.cuda.current_stream(self.device) if self.decode_stream is not None else None
        for stream in (self.copy_stream, self.decode_stream):
            if stream is not None:
                stream.wait_stream(cur)
        groups = max(1, min(MAX_GROUPS, n // BLOCKS_PER_GROUP))
        bounds = np.linspace(0, n, groups + 1).astype(int)
        events = []
        arena = self.store.arena.buf
        with self._on(self.copy_stream):
            for j0, j1 in zip(bounds[:-1], bounds[1:], strict=True):
                j = j0
                while j < j1:
                    k = j + 1
                    while k < j1 and offs[k] - offs[j] == int(rec_base[k] - rec_base[j]):
                        k += 1
                    a, end = int(rec_base[j]), offs[k - 1] + int(sizes[k - 1])
                    blob_dev[a : a + end - offs[j]].copy_(arena[offs[j] : end], non_blocking=True)
                    load.copies += 1
                    j = k
                if self.copy_stream is not None:
                    events.append(torch.cuda.Event())
                    events[-1].record(self.copy_stream)
        flat, bads = out.view(-1), []
        with self._on(self.decode_stream):
            for g, (j0, j1) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
                if events:
                    self.decode_stream.wait_event(events[g])
                i0, i1 = j0 * S, j1 * S
                _, bad = kvzip_lossless.decode_batch(
                    blob_dev, offsets[i0:i1], all_plans[i0:i1], tables=self.store.tables,
                    out=flat, out_offsets=out_offsets[i0:i1],
                )  # fmt: skip
                bads.append(bad)
            load.flags = torch.cat(bads).view(n, S).amax(1)  # per chunk, on the device
        load.out = out
        load.keep += [blob_dev, records]
        load.host_s = time.perf_counter() - load.t0

    def _store_batched(self, keys: list[bytes], staged) -> None:
        """Code a store job's chunks with one ``kvzip_lossless.encode_batch`` call (every
        layer's K and V of every chunk), copy each chunk's blobs from the device into its
        arena extent (page-locked: asynchronous), one synchronisation for the job."""
        t0 = time.perf_counter()
        S = 2 * len(staged)
        todo = []
        for j, key in enumerate(keys):
            if key in self.store:  # held already (another request stored it)
                nbytes, _ = self.store.put_blobs(key, (), 0)
                self._done.put((key, nbytes, []))
            else:
                todo.append(j)
        if not todo:
            return
        tensors, slots = [], []
        for j in todo:
            for layer, (k, v) in enumerate(staged):
                tensors += [k[j], v[j]]
                slots += [kvzip_lossless.kv_slot(layer, "k"), kvzip_lossless.kv_slot(layer, "v")]
        try:
            enc = kvzip_lossless.encode_batch(tensors, tables=self.store.tables, slots=slots)
        except Exception:  # noqa: BLE001 (every chunk of the job reported not stored)
            logger.exception("kvzip tier: storing %d chunks failed", len(todo))
            self.store.stats.store_errors += len(todo)
            for j in todo:
                self._done.put((keys[j], 0, []))
            return
        raw = sum(t.numel() * t.element_size() for t in tensors[:S])
        arena, pending = self.store.arena.buf, []
        for c, j in enumerate(todo):
            i0, i1 = c * S, (c + 1) * S
            a = int(enc.offsets[i0])
            size = int(enc.offsets[i1 - 1] + enc.lengths[i1 - 1]) - a
            plans = np.ascontiguousarray(enc.plans[i0:i1], np.int64)
            off, evicted = self.store.reserve(size, plans.nbytes)
            if off is None:  # larger than the budget, or no room now
                self._done.put((keys[j], 0, evicted))
                continue
            arena[off : off + size].copy_(enc.data[a : a + size], non_blocking=True)
            pending.append((keys[j], off, size, enc.lengths[i0:i1], plans, evicted))
        if self.store_stream is not None:
            self.store_stream.synchronize()  # the job's copies are in the arena
        for key, off, size, lengths, plans, evicted in pending:
            nbytes = self.store.commit(key, off, size, lengths, raw, plans, plans.nbytes)
            self._done.put((key, nbytes, evicted))
        self.store.stats.store_seconds += time.perf_counter() - t0

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
            (stored if nbytes else dropped).append(key)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)


def _probe_batched(device, tables, shape) -> bool:
    """A round trip of two small tensors through ``encode_batch`` / ``decode_batch`` on
    ``device`` with ``tables``: False when kvzip-lossless has no batched coder yet (or it
    fails here; logged)."""
    try:
        g = torch.Generator().manual_seed(0)
        xs = [torch.randn(*shape, generator=g).to(torch.bfloat16).to(device) for _ in range(2)]
        slots = [kvzip_lossless.kv_slot(0, "k"), kvzip_lossless.kv_slot(0, "v")]
        enc = kvzip_lossless.encode_batch(xs, tables=tables, slots=slots)
        out, bad = kvzip_lossless.decode_batch(enc.data, enc.offsets, enc.plans, tables=tables)
        want = torch.cat([x.reshape(-1) for x in xs]).view(torch.int16)
        return not bool(bad.any()) and torch.equal(out.reshape(-1).view(torch.int16), want)
    except (NotImplementedError, AttributeError):
        return False
    except Exception:  # noqa: BLE001
        logger.exception("kvzip tier: kvzip-lossless's batched coder failed its probe")
        return False
