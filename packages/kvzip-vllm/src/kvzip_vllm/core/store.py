"""The capacity tier's store: compressed KV chunks in one host arena, a byte budget, LRU eviction.

One entry per chunk of ``chunk_tokens`` tokens (a whole number of vLLM's blocks), keyed by
:func:`block_key`: the model, the codec and its format version, the cache layout, the chunk
size and the chained prefix hash of the chunk's last block (vLLM's block hashes chain every
earlier block's tokens, and LoRA / multimodal / salt extras, so equal keys mean equal
prefixes). An entry holds one blob per layer and kind, ``[chunk_tokens, kv_heads, head_size]``
token-major (the codec's rows are tokens, with the previous token as context), coded with the
per-model table set (``kvzip_lossless.TableSet``, slot ``kv_slot(layer, kind)``) once there
is one. A chunk whose entry was evicted is simply not found, never replaced by another.

Memory: every entry's record (its blobs back to back, then any tail the ``plan`` hook
returned) lies in one :class:`Arena` of ``budget_bytes`` bytes allocated once
(page-locked on a CUDA host, :meth:`BlockStore.pin`, so a restore copies records to the GPU
from where they lie), carved in :data:`RECORD_ALIGN`-byte units. ``bytes_held`` is the arena
bytes the held entries take (their aligned extents) plus what is kept beside them (the GPU
path's batch plans, ``kvzip_lossless.PLAN_FIELDS``: 72 bytes a blob): it never
exceeds the budget, and the page-locked memory is the arena, at most the budget. The GPU
path's spill (raw chunks waiting to be coded while its device queue is full) takes extents of
the same arena (:meth:`BlockStore.reserve_spill`), counted in ``bytes_held`` meanwhile.

Table set: given (``tables_path``, e.g. fitted offline on calibration text), or fitted by the
store from the first ``fit_tokens`` tokens it stores (those chunks keep the tables each blob
embeds; every later one references the set).
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

import kvzip_lossless
from kvzip_vllm.core.stats import TierStats

logger = logging.getLogger("kvzip_vllm.store")

#: An entry's record: its blobs back to back, zeros to a multiple of this, then the tail that
#: the ``plan`` hook returned, if any (the GPU path keeps none: its plans lie beside). The
#: arena hands out extents in multiples of it too, so records of consecutive extents are laid
#: out as a restore step places them on the device (one copy for a run of them).
RECORD_ALIGN = 16


def record_tail_offset(blob_bytes: int) -> int:
    """Where an entry's tail starts in its record, after ``blob_bytes`` bytes of blobs."""
    return -(-blob_bytes // RECORD_ALIGN) * RECORD_ALIGN


def record_bytes(blobs, tail: np.ndarray | None = None) -> int:
    """The size of an entry's record for ``blobs`` and ``tail`` (before alignment)."""
    tail_off = record_tail_offset(sum(memoryview(b).nbytes for b in blobs))
    return tail_off + (0 if tail is None else np.asarray(tail).nbytes)


def write_record(dst: np.ndarray, blobs, tail: np.ndarray | None) -> tuple[memoryview, ...]:
    """Write ``blobs`` and ``tail`` into ``dst`` (uint8, :func:`record_bytes` long or more);
    returns the blobs as read-only-by-convention views into it (what the CPU path decodes)."""
    views, a = [], 0
    for b in blobs:
        src = np.frombuffer(b, np.uint8)
        dst[a : a + src.size] = src
        views.append(memoryview(dst[a : a + src.size]))
        a += src.size
    tail_off = record_tail_offset(a)
    dst[a:tail_off] = 0
    if tail is not None:
        t = np.ascontiguousarray(tail).view(np.uint8).ravel()
        dst[tail_off : tail_off + t.size] = t
    return tuple(views)


def pack_record(
    blobs, tail: np.ndarray | None = None, *, pin_memory: bool = False
) -> tuple[torch.Tensor, tuple[memoryview, ...]]:
    """One uint8 tensor holding ``blobs`` and ``tail`` on its own (page-locked when
    ``pin_memory``), laid out as a record in the arena; the blobs as views into it."""
    n = record_bytes(blobs, tail)
    data = torch.empty(n, dtype=torch.uint8, pin_memory=pin_memory and n > 0)
    return data, write_record(data.numpy(), blobs, tail)


def _extent(n: int) -> int:
    return -(-n // RECORD_ALIGN) * RECORD_ALIGN


def _host_register(t: torch.Tensor) -> bool:
    """Page-lock ``t``'s memory where it lies (cudaHostRegister: exactly its size, unlike
    torch's pinned allocator, which rounds each allocation up to a power of two)."""
    try:
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
        code = rc[0] if isinstance(rc, tuple) else rc
        return int(getattr(code, "value", code)) == 0
    except Exception:  # noqa: BLE001  (no CUDA runtime: stays pageable)
        return False


def _host_unregister(t: torch.Tensor) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    except Exception:  # noqa: BLE001
        pass


class Arena:
    """``capacity`` bytes of host memory (or of ``device``'s) allocated once, handed out in
    extents of :data:`RECORD_ALIGN` bytes (first fit over a coalescing free list)."""

    def __init__(self, capacity: int, device="cpu"):
        self.capacity = capacity // RECORD_ALIGN * RECORD_ALIGN
        self.buf = torch.empty(self.capacity, dtype=torch.uint8, device=device)
        self.np = self.buf.numpy() if self.buf.device.type == "cpu" else None
        self.pinned = False
        self._registered = False
        self._offs: list[int] = [0] if self.capacity else []  # free extents, by offset
        self._sizes: list[int] = [self.capacity] if self.capacity else []
        self.used = 0

    def pin(self) -> bool:
        """Page-lock the whole arena (once; CUDA hosts). True if it is page-locked now."""
        if not self.pinned and self.capacity:
            self.pinned = self._registered = _host_register(self.buf)
            if self._registered:  # unregistered at close() or when the arena is collected:
                # a range left registered makes a later cudaHostRegister of memory reusing
                # its addresses fail ("already mapped", and torch's next CUDA call raise it)
                self._unregister = weakref.finalize(self, _host_unregister, self.buf)
            if not self.pinned:
                logger.warning(
                    "kvzip tier: the %d-byte arena could not be page-locked (cudaHostRegister "
                    "failed): restores copy from pageable memory",
                    self.capacity,
                )
        return self.pinned

    def alloc(self, n: int) -> int | None:
        """The offset of a free extent of ``n`` bytes (rounded up to the alignment), or None."""
        n = _extent(n)
        for i, size in enumerate(self._sizes):
            if size >= n:
                off = self._offs[i]
                if size == n:
                    del self._offs[i], self._sizes[i]
                else:
                    self._offs[i] += n
                    self._sizes[i] -= n
                self.used += n
                return off
        return None

    def free(self, off: int, n: int) -> None:
        n = _extent(n)
        self.used -= n
        i = bisect.bisect_left(self._offs, off)
        if i > 0 and self._offs[i - 1] + self._sizes[i - 1] == off:  # joins the one before
            i -= 1
            self._sizes[i] += n
        else:
            self._offs.insert(i, off)
            self._sizes.insert(i, n)
        if i + 1 < len(self._offs) and self._offs[i] + self._sizes[i] == self._offs[i + 1]:
            self._sizes[i] += self._sizes.pop(i + 1)
            del self._offs[i + 1]

    def largest_free(self) -> int:
        return max(self._sizes, default=0)

    def view(self, off: int, n: int) -> torch.Tensor:
        return self.buf[off : off + n]

    def close(self) -> None:
        if self._registered:
            self._unregister()
            self._registered = self.pinned = False


def block_key(namespace: bytes, block_hash: bytes) -> bytes:
    """The store key of one chunk: sha256 over the namespace and vLLM's chained block hash of
    the chunk's last block."""
    return hashlib.sha256(namespace + b"\0" + bytes(block_hash)).digest()


def shard_key(key: bytes, rank: int, world: int) -> bytes:
    """The key of tensor-parallel rank ``rank``'s shard (its KV heads) of the chunk the
    scheduler keys ``key``: ``key`` itself with one rank, else hashed with the rank and the
    world size, so a shard is never restored on another rank or layout."""
    if world == 1:
        return key
    return block_key(f"tp_rank={rank}|tp_world={world}".encode(), key)


def namespace(
    *,
    model: str,
    layout: str,
    block_size: int,
    dtype: str,
    tp_world: int = 1,
    chunk_tokens: int | None = None,
) -> bytes:
    """Everything besides the tokens that decides a chunk's bytes (codec version included).
    ``tp_world``: the tensor-parallel size the chunks are sharded for (each rank then keys
    its shard by its rank too: ``KvzipWorker.shard_key``); ``chunk_tokens``: the tokens per
    entry (None: one block)."""
    parts = [
        f"model={model}",
        f"codec=kvzip_lossless/{kvzip_lossless.FORMAT_VERSION}",
        f"layout={layout}",
        f"block_size={block_size}",
        f"dtype={dtype}",
        f"tp_world={tp_world}",
    ]
    if chunk_tokens is not None and chunk_tokens != block_size:
        parts.append(f"chunk_tokens={chunk_tokens}")
    return "|".join(parts).encode()


@dataclass
class RecordBatch:
    """Records of a batched read (:meth:`BlockStore.record_batch`): each blob's start in the
    destination buffer (``offsets``, ``[n * blobs]``), the buffer's bytes, and per record its
    start there, its offset in the arena and its size (for :meth:`BlockStore.copy_records`)."""

    offsets: np.ndarray
    nbytes: int
    base: np.ndarray
    src: np.ndarray
    size: np.ndarray


@dataclass
class _Entry:
    blobs: tuple[memoryview, ...]  # views into the arena
    nbytes: int  # arena extent plus ``aux_bytes``: what it holds against the budget
    raw_bytes: int
    aux: object = None  # the GPU path's batch plans (int64 [blobs, len(PLAN_FIELDS)])
    off: int = 0  # the record's offset in the arena
    size: int = 0  # the record's bytes (its extent: rounded up to RECORD_ALIGN)
    leases: int = 0  # loads in flight reading the record (its extent is reused after them)
    gone: bool = False  # no longer held; the extent is freed when the last lease ends


class BlockStore:
    """Compressed KV chunks within ``budget_bytes``, least recently used evicted first."""

    def __init__(
        self,
        budget_bytes: int,
        *,
        tables: kvzip_lossless.TableSet | None = None,
        fit_tokens: int = 1024,
        pin_memory: bool = False,
    ):
        if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._reserved = 0  # bytes of extents reserved, not yet committed
        self.arena = Arena(budget_bytes)
        self.stats = TierStats(budget_bytes=budget_bytes, arena_bytes=self.arena.capacity)
        self.tables = tables
        self.fit_tokens = fit_tokens
        #: ``plan(blobs) -> (aux, aux_bytes, tail)`` for entries put without one (the shared
        #: tier's fetches): set by the CUDA pipeline, so every entry holds its decode plan
        self.planner: Callable | None = None
        self._fit: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # chunks for the fit
        self._sized = threading.Event()
        self._sized.set()
        if tables is not None:
            self._size_tables(tables)
        if pin_memory:
            self.pin()

    # -- memory -------------------------------------------------------------------------
    def pin(self) -> bool:
        """Page-lock the arena (the CUDA pipeline does, once): restores then copy records to
        the GPU straight from it."""
        self.stats.arena_pinned = self.arena.pin()
        return self.stats.arena_pinned

    @property
    def pin_memory(self) -> bool:
        return self.arena.pinned

    @pin_memory.setter
    def pin_memory(self, value: bool) -> None:
        if value:
            self.pin()

    def close(self) -> None:
        with self._lock:
            self.arena.close()
            self.stats.arena_pinned = False

    def set_tables(self, tables: kvzip_lossless.TableSet, fit_tokens: int = 0) -> None:
        """The per-model table set, fitted by the caller from the first ``fit_tokens``
        tokens stored (the GPU path fits it on the device)."""
        self.tables = tables
        self._size_tables(tables)
        self.stats.table_fit_tokens = fit_tokens
        self._fit = []

    def _size_tables(self, tables: kvzip_lossless.TableSet) -> None:
        """``stats.table_bytes``: the set's raw bytes now, its stored size (its file: LZMA,
        seconds of CPU for an 8B model's set) once a thread of its own has it. The set is
        fitted mid-serving on the store thread, which would otherwise code nothing meanwhile
        (LZMA releases the GIL while it compresses)."""
        self.stats.table_bytes = len(tables.to_bytes())
        done = self._sized = threading.Event()

        def size() -> None:
            try:
                nbytes = tables.nbytes
                if self.tables is tables:
                    self.stats.table_bytes = nbytes
            finally:
                done.set()

        threading.Thread(target=size, name="kvzip-table-size", daemon=True).start()

    def table_sized(self, timeout: float | None = None) -> bool:
        """Wait until ``stats.table_bytes`` is the table set's stored size (tests)."""
        return self._sized.wait(timeout)

    def _maybe_fit(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Collect chunks until ``fit_tokens`` tokens, then fit the table set from them."""
        if self.tables is not None or self.fit_tokens <= 0:
            return
        self._fit.append([(k.cpu(), v.cpu()) for k, v in layers])
        tokens = sum(block[0][0].shape[0] for block in self._fit)
        if tokens >= self.fit_tokens:
            self.tables = kvzip_lossless.build_kv_tables(self._fit)
            self._size_tables(self.tables)
            self.stats.table_fit_tokens = tokens
            self._fit = []

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def touch(self, key: bytes) -> int:
        """The bytes held for ``key``, marking it most recently used; 0 if it is not held (a
        store of a key held already: nothing is coded or written again)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return 0
            self._entries.move_to_end(key)
            return entry.nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._entries)

    def encode(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[bytes, ...]:
        """The blobs of one chunk (layer 0 K, layer 0 V, layer 1 K, ...): with the table set
        once there is one, else each embedding its own table (coded on the host, which fits
        that table there anyway)."""
        tables = self.tables
        blobs = []
        for layer, kv in enumerate(layers):
            for kind, t in zip(("k", "v"), kv, strict=True):
                if tables is None:
                    blobs.append(kvzip_lossless.compress(t.cpu()))
                else:
                    slot = kvzip_lossless.kv_slot(layer, kind)
                    blobs.append(kvzip_lossless.compress(t, tables=tables, slot=slot))
        return tuple(blobs)

    def put(
        self,
        key: bytes,
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        plan: Callable[[tuple[bytes, ...]], tuple[object, int, np.ndarray | None]] | None = None,
    ) -> tuple[int, list[bytes]]:
        """Compress and hold one chunk under ``key``: per layer ``(K, V)`` bf16
        ``[chunk_tokens, kv_heads, head_size]``. ``plan(blobs)`` may return ``(aux,
        aux_bytes, tail)``: ``aux`` kept beside the blobs, ``tail`` (bytes) after them in the
        entry's record (the GPU path's decode plans; their bytes count against the budget).

        Returns (bytes held for the entry, 0 if not stored; keys evicted to make room).
        """
        held = self.touch(key)
        if held:
            return held, []
        t0 = time.perf_counter()
        blobs = self.encode(layers)
        raw = sum(t.numel() * t.element_size() for kv in layers for t in kv)
        result = self.put_blobs(key, blobs, raw, time.perf_counter() - t0, plan=plan)
        self._maybe_fit(layers)
        return result

    def put_blobs(
        self,
        key: bytes,
        blobs: tuple[bytes, ...],
        raw_bytes: int,
        seconds: float = 0.0,
        *,
        aux: object = None,
        aux_bytes: int = 0,
        tail: np.ndarray | None = None,
        plan: Callable | None = None,
    ) -> tuple[int, list[bytes]]:
        """Hold already coded ``blobs`` under ``key`` (see :meth:`put`)."""
        with self._lock:
            self.stats.store_seconds += seconds
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key].nbytes, []
        plan = plan or (self.planner if tail is None and aux is None else None)
        if plan is not None and blobs:
            aux, aux_bytes, tail = plan(blobs)
        blob_bytes = sum(memoryview(b).nbytes for b in blobs)
        size = record_bytes(blobs, tail)
        off, evicted = self.reserve(size, aux_bytes)
        if off is None:
            return 0, evicted
        views = write_record(self.arena.np[off : off + size], blobs, tail)  # outside the lock
        return self._commit(key, off, size, views, raw_bytes, aux, aux_bytes, blob_bytes), evicted

    def reserve(self, size: int, aux_bytes: int = 0) -> tuple[int | None, list[bytes]]:
        """Room in the arena for a record of ``size`` bytes (and ``aux_bytes`` beside it):
        the least recently used entries evicted until it fits. Returns (its offset, or None
        when it cannot fit: counted as skipped; the keys evicted). The caller writes the
        record there, then :meth:`commit` (or :meth:`abort`)."""
        evicted: list[bytes] = []
        nbytes = _extent(size) + aux_bytes
        with self._lock:
            s = self.stats
            if nbytes > self.budget_bytes or _extent(size) > self.arena.capacity:
                s.blocks_skipped += 1
                return None, evicted
            while True:
                if s.bytes_held + nbytes <= self.budget_bytes:
                    off = self.arena.alloc(size)
                    if off is not None:
                        self._reserved += nbytes
                        s.bytes_held += nbytes  # counted from now: the budget holds meanwhile
                        s.peak_bytes_held = max(s.peak_bytes_held, s.bytes_held)
                        return off, evicted
                if not self._entries:
                    s.blocks_skipped += 1  # the room is held by loads in flight: not now
                    return None, evicted
                old_key, old = self._entries.popitem(last=False)
                self._release(old)
                s.evictions += 1
                evicted.append(old_key)

    def reserve_spill(self, size: int) -> tuple[int | None, list[bytes]]:
        """An extent of the arena for ``size`` bytes of raw chunks waiting to be coded (the GPU
        path's spill when its device queue is full), counted in ``bytes_held`` (least recently
        used entries evicted to make room, as a store would): (its offset, or None when it
        cannot fit now; the keys evicted). Nothing is counted skipped. Give it back with
        :meth:`release_spill`."""
        evicted: list[bytes] = []
        n = _extent(size)
        with self._lock:
            s = self.stats
            if n > self.budget_bytes or n > self.arena.capacity:
                return None, evicted
            while True:
                if s.bytes_held + n <= self.budget_bytes:
                    off = self.arena.alloc(size)
                    if off is not None:
                        s.bytes_held += n
                        s.spill_bytes_held += n
                        s.spill_peak_bytes = max(s.spill_peak_bytes, s.spill_bytes_held)
                        s.peak_bytes_held = max(s.peak_bytes_held, s.bytes_held)
                        return off, evicted
                if not self._entries:
                    return None, evicted
                old_key, old = self._entries.popitem(last=False)
                self._release(old)
                s.evictions += 1
                evicted.append(old_key)

    def release_spill(self, off: int, size: int) -> None:
        """Give back a spill extent from :meth:`reserve_spill` (its chunks are coded)."""
        with self._lock:
            self.arena.free(off, size)
            self.stats.bytes_held -= _extent(size)
            self.stats.spill_bytes_held -= _extent(size)

    def abort(self, off: int, size: int, aux_bytes: int = 0) -> None:
        """Give back an extent from :meth:`reserve` that was not committed."""
        with self._lock:
            self.arena.free(off, size)
            self._reserved -= _extent(size) + aux_bytes
            self.stats.bytes_held -= _extent(size) + aux_bytes

    def commit(
        self,
        key: bytes,
        off: int,
        size: int,
        blob_sizes,
        raw_bytes: int,
        aux: object = None,
        aux_bytes: int = 0,
    ) -> int:
        """Hold the record written at ``off`` (from :meth:`reserve`): blobs of ``blob_sizes``
        back to back from its start. Returns the bytes held for it (0: the key was held
        already; the extent is given back)."""
        views, a = [], 0
        arr = self.arena.np
        for n in blob_sizes:
            views.append(memoryview(arr[off + a : off + a + int(n)]))
            a += int(n)
        return self._commit(key, off, size, tuple(views), raw_bytes, aux, aux_bytes, a)

    def _commit(self, key, off, size, views, raw_bytes, aux, aux_bytes, blob_bytes) -> int:
        nbytes = _extent(size) + aux_bytes
        with self._lock:
            s = self.stats
            self._reserved -= nbytes
            if key in self._entries:  # stored meanwhile by another thread
                self.arena.free(off, size)
                s.bytes_held -= nbytes
                return self._entries[key].nbytes
            self._entries[key] = _Entry(views, nbytes, raw_bytes, aux, off, size)
            s.raw_bytes_held += raw_bytes
            s.blocks_held += 1
            s.blocks_stored += 1
            s.bytes_stored += blob_bytes
            s.raw_bytes_stored += raw_bytes
        return nbytes

    def _release(self, entry: _Entry) -> None:
        """An entry no longer held (under the lock): its budget now, its extent once no load
        reads it."""
        s = self.stats
        s.bytes_held -= entry.nbytes
        s.raw_bytes_held -= entry.raw_bytes
        s.blocks_held -= 1
        entry.gone = True
        if entry.leases == 0:
            self.arena.free(entry.off, entry.size)

    def get_entry(
        self, key: bytes, *, lease: bool = False
    ) -> tuple[tuple[memoryview, ...], object, torch.Tensor] | None:
        """The blobs of ``key``, what was kept beside them and its record (a view into the
        arena), marking it most recently used; None if not held. With ``lease`` the record's
        extent is not reused until :meth:`unlease` (a load copying from it)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.stats.misses += 1
                return None
            self._entries.move_to_end(key)
            if lease:
                entry.leases += 1
            return entry.blobs, entry.aux, self.arena.view(entry.off, entry.size)

    def lease(self, key: bytes):
        """The entry of ``key`` (leased, see :meth:`get_entry`) and its arena offset, or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.stats.misses += 1
                return None
            self._entries.move_to_end(key)
            entry.leases += 1
            return entry

    def unlease(self, entries) -> None:
        """End the leases of ``entries`` (from :meth:`lease`)."""
        with self._lock:
            for entry in entries:
                entry.leases -= 1
                if entry.leases == 0 and entry.gone:
                    self.arena.free(entry.off, entry.size)

    def record(self, entry: _Entry) -> torch.Tensor:
        return self.arena.view(entry.off, entry.size)

    # -- what a batched reader needs, without the record layout -------------------------
    def extent(self, off: int, n: int) -> torch.Tensor:
        """The ``n`` bytes of an extent from :meth:`reserve` or :meth:`reserve_spill` (a uint8
        view into the arena, page-locked where it is): where a writer puts a record's blobs
        back to back from its start, or a spill its raw chunks."""
        return self.arena.view(off, n)

    def record_order(self, entries) -> list[int]:
        """The order in which to read ``entries`` (leased): as they lie in the arena, so that
        records stored one after another are copied by one :meth:`copy_records` call."""
        return sorted(range(len(entries)), key=lambda j: entries[j].off)

    def record_batch(self, entries, blob_lengths: np.ndarray) -> RecordBatch:
        """Where the records of ``entries`` (leased, in :meth:`record_order`) land when copied
        back to back into one buffer, each from an aligned start, and where each of their blobs
        (``blob_lengths`` ``[n, blobs]``) starts there."""
        sizes = np.array([e.size for e in entries], np.int64)
        ext = -(-sizes // RECORD_ALIGN) * RECORD_ALIGN
        base = np.concatenate([[0], np.cumsum(ext)[:-1]]).astype(np.int64)
        in_rec = np.cumsum(blob_lengths, 1) - blob_lengths  # blobs back to back in a record
        offsets = (base[:, None] + in_rec).ravel()
        src = np.array([e.off for e in entries], np.int64)
        return RecordBatch(offsets, int(ext.sum()), base, src, sizes)

    def copy_records(
        self, batch: RecordBatch, dst: torch.Tensor, j0: int, j1: int, shift: int = 0
    ) -> int:
        """Copy the records ``j0 .. j1 - 1`` of ``batch`` into ``dst`` (asynchronously from
        page-locked memory), each ``shift`` bytes before its place in the batch's buffer (a
        group of records into a buffer of its own: ``shift`` is the group's first byte): one
        copy per run of records lying back to back in the arena. Returns the copies issued."""
        if not 0 <= shift <= int(batch.base[j0]) or (
            int(batch.base[j1 - 1] + batch.size[j1 - 1]) - shift > dst.numel()
        ):
            raise ValueError(
                f"records {j0}..{j1 - 1} shifted by {shift} do not fit a {dst.numel()}-byte buffer"
            )
        src, base, sizes, buf = batch.src, batch.base, batch.size, self.arena.buf
        copies, j = 0, j0
        while j < j1:
            k = j + 1
            while k < j1 and src[k] - src[j] == base[k] - base[j]:
                k += 1
            a, s0, end = int(base[j]) - shift, int(src[j]), int(src[k - 1] + sizes[k - 1])
            dst[a : a + end - s0].copy_(buf[s0:end], non_blocking=True)
            copies += 1
            j = k
        return copies

    def get_blobs(self, key: bytes) -> tuple[bytes, ...] | None:
        """The blobs of ``key`` (marking it most recently used), or None if not held."""
        got = self.get_entry(key)
        return None if got is None else got[0]

    def get(self, key: bytes, outs: list[torch.Tensor]) -> bool:
        """Decode ``key`` into ``outs`` (one per blob: layer 0 K, layer 0 V, layer 1 K, ...),
        bit-exact; False if not held or damaged. Every blob is decoded and checksummed before
        any output is written; a damaged entry is dropped, so it is never served.
        """
        entry = self.lease(key)
        if entry is None:
            return False
        try:
            blobs = entry.blobs
            if len(blobs) != len(outs):
                raise ValueError(f"entry holds {len(blobs)} tensors, {len(outs)} outputs given")
            decoded = [
                kvzip_lossless.decompress(b, tables=self.tables, device=o.device)
                for b, o in zip(blobs, outs, strict=True)
            ]
            for d, out in zip(decoded, outs, strict=True):
                if d.shape != out.shape:
                    raise kvzip_lossless.CorruptBlobError(
                        f"blob shape {tuple(d.shape)} != chunk shape {tuple(out.shape)}"
                    )
        except kvzip_lossless.CorruptBlobError:
            self.drop(key)
            return False
        finally:
            self.unlease([entry])
        for d, out in zip(decoded, outs, strict=True):
            out.copy_(d)
        return True

    def drop(self, key: bytes) -> bool:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self._release(entry)
            return True

    def clear(self) -> None:
        with self._lock:
            while self._entries:
                self._release(self._entries.popitem(last=False)[1])
