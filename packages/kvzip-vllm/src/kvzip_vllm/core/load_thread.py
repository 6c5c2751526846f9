"""The tier's load thread (:class:`LoadRunner`): asynchronous load jobs run off the engine's
step, jobs queued together taken up as one pass. No vLLM here;
:class:`~kvzip_vllm.core.transfer.KvTier` runs its passes on it."""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (transfer imports this module)
    from kvzip_vllm.core.transfer import ChunkLoad, TransferResult

logger = logging.getLogger("kvzip_vllm.core.transfer")


class LoadRunner:
    """The tier's load thread: asynchronous load jobs run off the engine's step, the jobs
    queued when the thread comes to them taken together, up to ``max_chunks`` chunks (one job
    at least): ``run([(job_id, loads), ...]) -> [TransferResult, ...]``, one result per job.
    Jobs whose run raises are reported by ``fail(job_id, loads)``, every chunk failed, so no
    request waits for them forever."""

    def __init__(self, run, fail, max_chunks: int = 1):
        self._run, self._fail, self._max_chunks = run, fail, max_chunks
        self._cv = threading.Condition()
        self._queue: list[tuple[int, list[ChunkLoad]]] = []
        self._pending: set[int] = set()
        self._done: list[TransferResult] = []
        self._closed = False
        self._held = 0  # submitters holding the queue (:meth:`holding`)
        self._thread = threading.Thread(target=self._loop, name="kvzip-tier-load", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        with self._cv:
            return len(self._pending)

    @contextlib.contextmanager
    def holding(self):
        """Jobs submitted inside are not taken up until the block ends."""
        with self._cv:
            self._held += 1
        try:
            yield
        finally:
            with self._cv:
                self._held -= 1
                self._cv.notify_all()

    def submit(self, job_id: int, loads: list[ChunkLoad]) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("the tier's load thread is closed")
            self._pending.add(job_id)
            self._queue.append((job_id, loads))
            self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: (self._queue and not self._held) or self._closed)
                if not self._queue:
                    return
                jobs = [self._queue.pop(0)]
                chunks = len(jobs[0][1])
                while self._queue and chunks + len(self._queue[0][1]) <= self._max_chunks:
                    chunks += len(self._queue[0][1])
                    jobs.append(self._queue.pop(0))
            try:
                results = self._run(jobs)
            except Exception:  # noqa: BLE001  (reported failed: the engine recomputes)
                logger.exception("kvzip tier: load jobs %s failed", [j for j, _ in jobs])
                results = [self._fail(job_id, loads) for job_id, loads in jobs]
            with self._cv:
                self._done.extend(results)
                self._pending.difference_update(j for j, _ in jobs)
                self._cv.notify_all()

    def take(self) -> list[TransferResult]:
        """The jobs finished since the last call (never waits)."""
        with self._cv:
            done, self._done = self._done, []
            return done

    def wait(self, job_ids: set[int] | None, timeout_s: float | None = None) -> bool:
        """Block until the jobs ``job_ids`` (None: all) have finished."""
        with self._cv:
            return self._cv.wait_for(
                lambda: not (self._pending if job_ids is None else self._pending & job_ids),
                timeout_s,
            )

    def wait_any(self, timeout_s: float) -> bool:
        """Block until a job has finished and is not taken yet, or none is pending (or the
        thread is closed), at most ``timeout_s``: True if that came first."""
        with self._cv:
            return self._cv.wait_for(
                lambda: bool(self._done) or not self._pending or self._closed, timeout_s
            )

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()
