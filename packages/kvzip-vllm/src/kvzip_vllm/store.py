"""The capacity tier's store: compressed KV blocks in CPU memory, a byte budget, LRU eviction.

One entry per KV block, keyed by :func:`block_key`: the model, the codec and its format
version, the cache layout and the block's chained prefix hash. An entry holds one blob per
layer and kind, ``[block_size, kv_heads, head_size]`` token-major (the codec's rows are
tokens, with the previous token as context), coded with the per-model table set
(``kvzip_lossless.TableSet``, slot ``kv_slot(layer, kind)``) once there is one.

Table set: given (``tables_path``, e.g. fitted offline on calibration text), or fitted by the
store from the first ``fit_tokens`` tokens it stores (those blocks keep the tables each blob
embeds; every later one references the set). Measured on the embedded model, 768 held-out
tokens in 128-token blocks: tables embedded per block 1.47x, a set fitted on 1,024 other tokens
1.51x (plus the set's 0.84 MB once). vLLM's block hashes chain
every earlier block's tokens (and LoRA / multimodal / salt extras), so equal keys mean equal
prefixes; a block whose entry was evicted is simply not found, never replaced by another.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

import kvzip_lossless

#: An entry's record: its blobs back to back, zeros to a multiple of this, then the tail that
#: the ``plan`` hook returned (the GPU path's decode plan in the layout its kernels read).
RECORD_ALIGN = 16


def record_tail_offset(blob_bytes: int) -> int:
    """Where an entry's tail starts in its record, after ``blob_bytes`` bytes of blobs."""
    return -(-blob_bytes // RECORD_ALIGN) * RECORD_ALIGN


def pack_record(
    blobs, tail: np.ndarray | None = None, *, pin_memory: bool = False
) -> tuple[torch.Tensor, tuple[memoryview, ...]]:
    """One uint8 tensor holding ``blobs`` and ``tail`` (layout: :data:`RECORD_ALIGN`), page-
    locked when ``pin_memory`` (the GPU path copies it to the device straight from there), and
    the blobs as read-only-by-convention views into it (what the CPU path decodes)."""
    sizes = [memoryview(b).nbytes for b in blobs]
    tail_off = record_tail_offset(sum(sizes))
    tail = np.zeros(0, np.uint8) if tail is None else np.ascontiguousarray(tail).view(np.uint8)
    n = tail_off + tail.nbytes
    data = torch.empty(n, dtype=torch.uint8, pin_memory=pin_memory and n > 0)
    arr = data.numpy()
    views, a = [], 0
    for b, size in zip(blobs, sizes, strict=True):
        arr[a : a + size] = np.frombuffer(b, np.uint8)
        views.append(memoryview(arr[a : a + size]))
        a += size
    arr[a:tail_off] = 0
    arr[tail_off:] = tail
    return data, tuple(views)


def record_bytes(blobs, tail: np.ndarray | None = None) -> int:
    """The size of :func:`pack_record`'s tensor for ``blobs`` and ``tail``."""
    tail_off = record_tail_offset(sum(memoryview(b).nbytes for b in blobs))
    return tail_off + (0 if tail is None else np.asarray(tail).nbytes)


def pinned_overhead(n: int) -> int:
    """Bytes torch's pinned host allocator takes beyond ``n`` for one ``n``-byte tensor: it
    rounds every allocation up to a power of two."""
    return 0 if n <= 0 else (1 << (n - 1).bit_length()) - n


def block_key(namespace: bytes, block_hash: bytes) -> bytes:
    """The store key of one KV block: sha256 over the namespace and vLLM's chained block hash."""
    return hashlib.sha256(namespace + b"\0" + bytes(block_hash)).digest()


def shard_key(key: bytes, rank: int, world: int) -> bytes:
    """The key of tensor-parallel rank ``rank``'s shard (its KV heads) of the block the
    scheduler keys ``key``: ``key`` itself with one rank, else hashed with the rank and the
    world size, so a shard is never restored on another rank or layout."""
    if world == 1:
        return key
    return block_key(f"tp_rank={rank}|tp_world={world}".encode(), key)


def namespace(*, model: str, layout: str, block_size: int, dtype: str, tp_world: int = 1) -> bytes:
    """Everything besides the tokens that decides a block's bytes (codec version included).
    ``tp_world``: the tensor-parallel size the blocks are sharded for (each rank then keys
    its shard by its rank too: ``KvzipWorker.shard_key``)."""
    parts = [
        f"model={model}",
        f"codec=kvzip_lossless/{kvzip_lossless.FORMAT_VERSION}",
        f"layout={layout}",
        f"block_size={block_size}",
        f"dtype={dtype}",
        f"tp_world={tp_world}",
    ]
    return "|".join(parts).encode()


@dataclass
class TierStats:
    """Counters a user can read (the connector writes them as JSON to ``stats_path``)."""

    budget_bytes: int = 0
    blocks_held: int = 0
    bytes_held: int = 0  # compressed bytes held now (with the GPU path's decode plans)
    raw_bytes_held: int = 0  # bf16 bytes those blocks would take uncompressed
    blocks_stored: int = 0  # cumulative
    bytes_stored: int = 0  # cumulative compressed bytes written (blobs only)
    raw_bytes_stored: int = 0  # cumulative bf16 bytes compressed
    blocks_skipped: int = 0  # larger than the whole budget
    evictions: int = 0
    restore_hits: int = 0  # requests whose prefix was restored (at least one block)
    blocks_restored: int = 0
    tokens_restored: int = 0
    restore_seconds: float = 0.0
    store_seconds: float = 0.0
    load_errors: int = 0  # blocks missing or failing their checksum at load: recomputed
    # blocks not stored because a block before them in their request failed to load this
    # step (they were computed on KV that was not restored; vLLM recomputes and stores them)
    stores_refused_after_load_error: int = 0
    store_errors: int = 0  # stores that raised (the block is not held; recomputed if needed)
    misses: int = field(default=0)
    table_bytes: int = 0  # the per-model table set (stored once), 0 until fitted/loaded
    table_fit_tokens: int = 0  # tokens the set was fitted on by the store (0: loaded)

    @property
    def bytes_saved(self) -> int:
        return self.raw_bytes_held - self.bytes_held

    @property
    def ratio(self) -> float:
        return self.raw_bytes_stored / self.bytes_stored if self.bytes_stored else 0.0

    @property
    def ratio_with_tables(self) -> float:
        total = self.bytes_stored + self.table_bytes
        return self.raw_bytes_stored / total if total else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["bytes_saved"] = self.bytes_saved
        d["ratio"] = round(self.ratio, 4)
        d["ratio_with_tables"] = round(self.ratio_with_tables, 4)
        return d


@dataclass
class _Entry:
    blobs: tuple[memoryview, ...]  # views into ``data``
    nbytes: int  # blob and tail bytes plus ``aux_bytes``: what it holds against the budget
    raw_bytes: int
    aux: object = None  # the GPU path's decode plans (kvzip_vllm.batch_decode.BlockPlan)
    data: torch.Tensor | None = None  # the record: blobs, then the tail (pack_record)


class BlockStore:
    """Compressed KV blocks within ``budget_bytes``, least recently used evicted first."""

    def __init__(
        self,
        budget_bytes: int,
        *,
        tables: kvzip_lossless.TableSet | None = None,
        fit_tokens: int = 1024,
        pin_memory: bool = False,
    ):
        if not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = TierStats(budget_bytes=budget_bytes)
        self.tables = tables
        self.fit_tokens = fit_tokens
        # records page-locked (set by the CUDA pipeline): a restore then copies each entry to
        # the GPU from where it lies, with no staging copy (54.9 of a 56.3 ms restore of 64
        # blocks went to host staging and plans on the H200, results/vllm/cuda_tier_restore.md,
        # before). torch's pinned allocator rounds each record up to a power of two (and keeps
        # freed ones for reuse): a pinned entry is charged that rounded size, so the budget
        # bounds the page-locked memory the records take.
        self.pin_memory = pin_memory
        self._fit: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # blocks for the fit
        if tables is not None:
            self.stats.table_bytes = tables.nbytes

    def _maybe_fit(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Collect blocks until ``fit_tokens`` tokens, then fit the table set from them."""
        if self.tables is not None or self.fit_tokens <= 0:
            return
        self._fit.append([(k.cpu(), v.cpu()) for k, v in layers])
        tokens = sum(block[0][0].shape[0] for block in self._fit)
        if tokens >= self.fit_tokens:
            self.tables = kvzip_lossless.build_kv_tables(self._fit)
            self.stats.table_bytes = self.tables.nbytes
            self.stats.table_fit_tokens = tokens
            self._fit = []

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def encode(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[bytes, ...]:
        """The blobs of one block (layer 0 K, layer 0 V, layer 1 K, ...): with the table set
        once there is one, else each embedding its own table. CUDA tensors are coded on the
        GPU, except those embedding a table: they are coded on the host, which fits that table
        there anyway, and kvzip-lossless's GPU coder keeps the device copy of every table it
        has seen (so one per embedded-table blob, never freed)."""
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
        """Compress and hold one block under ``key``: per layer ``(K, V)`` bf16
        ``[block_size, kv_heads, head_size]``. ``plan(blobs)`` may return ``(aux, aux_bytes,
        tail)``: ``aux`` kept beside the blobs, ``tail`` (bytes) after them in the entry's
        record (the GPU path's decode plans; their bytes count against the budget).

        Returns (bytes held for the entry, 0 if not stored; keys evicted to make room).
        """
        if key in self._entries:
            return self.put_blobs(key, (), 0)
        t0 = time.perf_counter()
        blobs = self.encode(layers)
        aux, aux_bytes, tail = plan(blobs) if plan is not None else (None, 0, None)
        raw = sum(t.numel() * t.element_size() for kv in layers for t in kv)
        result = self.put_blobs(
            key, blobs, raw, time.perf_counter() - t0, aux=aux, aux_bytes=aux_bytes, tail=tail
        )
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
    ) -> tuple[int, list[bytes]]:
        blob_bytes = sum(memoryview(b).nbytes for b in blobs)
        nbytes = blob_bytes + aux_bytes + (0 if tail is None else tail.nbytes)
        evicted: list[bytes] = []
        data = views = None
        if self.pin_memory:
            nbytes += pinned_overhead(record_bytes(blobs, tail))
        if key not in self._entries and nbytes <= self.budget_bytes:  # packed outside the lock
            data, views = pack_record(blobs, tail, pin_memory=self.pin_memory)
        with self._lock:
            s = self.stats
            s.store_seconds += seconds
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key].nbytes, evicted
            if nbytes > self.budget_bytes:
                s.blocks_skipped += 1
                return 0, evicted
            while s.bytes_held + nbytes > self.budget_bytes:
                old_key, old = self._entries.popitem(last=False)
                s.bytes_held -= old.nbytes
                s.raw_bytes_held -= old.raw_bytes
                s.blocks_held -= 1
                s.evictions += 1
                evicted.append(old_key)
            if data is None:  # raced with a drop of the same key
                data, views = pack_record(blobs, tail, pin_memory=self.pin_memory)
            self._entries[key] = _Entry(views, nbytes, raw_bytes, aux, data)
            s.bytes_held += nbytes
            s.raw_bytes_held += raw_bytes
            s.blocks_held += 1
            s.blocks_stored += 1
            s.bytes_stored += blob_bytes
            s.raw_bytes_stored += raw_bytes
        return nbytes, evicted

    def get_entry(self, key: bytes) -> tuple[tuple[memoryview, ...], object, torch.Tensor] | None:
        """The blobs of ``key``, what was kept beside them and its record (marking it most
        recently used), or None if not held."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.stats.misses += 1
                return None
            self._entries.move_to_end(key)
            return entry.blobs, entry.aux, entry.data

    def get_blobs(self, key: bytes) -> tuple[bytes, ...] | None:
        """The blobs of ``key`` (marking it most recently used), or None if not held."""
        got = self.get_entry(key)
        return None if got is None else got[0]

    def get(self, key: bytes, outs: list[torch.Tensor]) -> bool:
        """Decode ``key`` into ``outs`` (one per blob: layer 0 K, layer 0 V, layer 1 K, ...),
        bit-exact; False if not held or damaged. Every blob is decoded and checksummed before
        any output is written; a damaged entry is dropped, so it is never served.
        """
        blobs = self.get_blobs(key)
        if blobs is None:
            return False
        if len(blobs) != len(outs):
            raise ValueError(f"entry holds {len(blobs)} tensors, {len(outs)} outputs given")
        try:
            decoded = [
                kvzip_lossless.decompress(b, tables=self.tables, device=o.device)
                for b, o in zip(blobs, outs, strict=True)
            ]
            for d, out in zip(decoded, outs, strict=True):
                if d.shape != out.shape:
                    raise kvzip_lossless.CorruptBlobError(
                        f"blob shape {tuple(d.shape)} != block shape {tuple(out.shape)}"
                    )
            for d, out in zip(decoded, outs, strict=True):
                out.copy_(d)
        except kvzip_lossless.CorruptBlobError:
            self.drop(key)
            return False
        return True

    def drop(self, key: bytes) -> bool:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self.stats.bytes_held -= entry.nbytes
            self.stats.raw_bytes_held -= entry.raw_bytes
            self.stats.blocks_held -= 1
            return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            s = self.stats
            s.bytes_held = s.raw_bytes_held = s.blocks_held = 0
