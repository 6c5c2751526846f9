"""The shared tier inside the connector: a :class:`~kvzip_vllm.core.shared_store.SharedBlobStore`
(a Redis server many vLLM instances reach) behind each worker's in-process
:class:`~kvzip_vllm.core.store.BlockStore`, which stays in front as the cache.

- Worker, after a local store: the entry's blobs go onto a bounded queue that one background
  thread writes to the server (:class:`SharedWriter`): a step never waits for the server; a
  full queue drops the put (counted), the block then stays local only.
- Worker, on a load the local store cannot serve: one GET (bounded by the timeouts), the blobs
  put into the local store, then decoded and checked there as every local entry is; a miss,
  an unreachable server or a value failing its digest or its blobs' CRCs is a load error:
  vLLM recomputes the block.
- Scheduler (another process than the worker, or the same): one pipelined EXISTS for the
  request's blocks the local tier does not hold; a server that is down counts nothing.

Every instance on one server must code with the same table set, else a block computed on one
fails to decode on another. The Redis namespace therefore names the table set: the digest of
the ``tables_path`` file's bytes, or ``embedded`` when every blob embeds its own table
(``fit_tokens=0``). A table set fitted by each store from its own first blocks (the default
without ``tables_path``) differs from instance to instance and is refused with the tier on.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections.abc import Sequence

log = logging.getLogger("vllm.kvzip.connector")

#: puts waiting for the server at most (about 0.5 MB each on the embedded model, 1.4 MB on
#: an 8B model's 16-token blocks); beyond it a put is dropped, never waited for
QUEUE_BLOCKS = 256


def shared_namespace(settings) -> str:
    """The Redis key prefix: ``kvzip-<table set>`` (see the module docstring)."""
    if settings.tables_path:
        with open(settings.tables_path, "rb") as f:
            digest = hashlib.blake2b(f.read(), digest_size=8).hexdigest()
        return f"kvzip-tables-{digest}"
    return "kvzip-embedded"


def open_shared(settings):
    """The settings' shared store, or None when ``shared_url`` is not set."""
    if not settings.shared_url:
        return None
    from kvzip_vllm.core.shared_store import SharedBlobStore

    extra = {}
    if settings.shared_timeout_s is not None:
        extra = {
            "connect_timeout_s": settings.shared_timeout_s,
            "read_timeout_s": settings.shared_timeout_s,
        }
    store = SharedBlobStore(
        settings.shared_url,
        settings.shared_budget_bytes,
        namespace=shared_namespace(settings),
        **extra,
    )
    log.info(
        "kvzip tier: shared store %s, budget %.1f MB, namespace %s (%s)",
        settings.shared_url,
        settings.shared_budget_bytes / 1e6,
        store.settings.namespace,
        "up" if store.stats["shared_up"] else "down: answering misses",
    )
    return store


class SharedWriter:
    """Puts to the shared store from one background thread, through a bounded queue."""

    def __init__(self, shared, maxsize: int = QUEUE_BLOCKS):
        self.shared = shared
        self.queued = 0
        self.dropped = 0  # the queue was full: not sent
        self._q: queue.Queue = queue.Queue(maxsize=maxsize)
        self._thread = threading.Thread(target=self._run, name="kvzip-shared-put", daemon=True)
        self._thread.start()

    def submit(self, key: bytes, blobs: Sequence, raw_bytes: int) -> bool:
        """Queue one block's put; False (counted) when the queue is full."""
        try:
            self._q.put_nowait((key, tuple(blobs), raw_bytes))
        except queue.Full:
            self.dropped += 1
            return False
        self.queued += 1
        return True

    def _run(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                key, blobs, raw_bytes = item
                self.shared.put(key, blobs, raw_bytes=raw_bytes)  # never raises on failure
            except Exception:  # noqa: BLE001  (a put not made leaves the block local only)
                log.exception("kvzip tier: shared put failed")
            finally:
                self._q.task_done()

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the queued puts; True if none is left."""
        deadline = time.monotonic() + timeout_s
        while self._q.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout_s: float) -> None:
        """Finish the queued puts (up to ``timeout_s``), then stop the thread."""
        self.flush(timeout_s)
        try:
            self._q.put(None, timeout=max(0.01, timeout_s))
        except queue.Full:
            return
        self._thread.join(timeout=max(0.01, timeout_s))
