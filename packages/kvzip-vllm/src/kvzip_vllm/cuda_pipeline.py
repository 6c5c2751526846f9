"""The connector's CUDA path: GPU encode/decode with kvzip-lossless, copies overlapped.

Written against vLLM 0.33 on CUDA; not run by this package's tests (vLLM runs on the CPU
here, and kvzip-lossless's GPU codec and its restore pipeline are tested and timed on their
own). What it does:

- Loads: the blocks of one step are decoded on two side streams in turn, so block i's
  host-to-device copy and decode overlap block i+1's; each decoded block is scattered into
  the paged cache on its stream. ``wait_loads`` (called before the first layer reads the
  cache) makes the compute stream wait for both.
- Stores: after the forward, the blocks to store are copied device-to-device into staging
  tensors on the compute stream (so vLLM may free the blocks at once); a worker thread
  encodes them on its own stream with the GPU encoder and hands the blobs to the store;
  completions are reported to the scheduler at the next step.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch

import kvzip_lossless
from kvzip_vllm.store import BlockStore


class CudaTierPipeline:
    def __init__(
        self, store: BlockStore, block_views: Callable[[int], list], device, block_size: int
    ):
        self.store = store
        self.block_size = block_size
        self.block_views = block_views
        self.device = device
        self.load_streams = [torch.cuda.Stream(device), torch.cuda.Stream(device)]
        self.store_stream = torch.cuda.Stream(device)
        self._done: queue.Queue = queue.Queue()
        self._jobs: queue.Queue = queue.Queue()
        self._load_started: float | None = None
        self._thread = threading.Thread(target=self._store_loop, daemon=True)
        self._thread.start()

    # -- loads --------------------------------------------------------------------------
    def start_loads(self, loads) -> set[int]:
        failed: set[int] = set()
        self._load_started = time.perf_counter()
        hits: dict[str, int] = {}
        cur = torch.cuda.current_stream(self.device)
        for i, (req_id, key, block_id) in enumerate(loads):
            stream = self.load_streams[i % 2]
            stream.wait_stream(cur)  # the blocks were just allocated on the compute stream
            blobs = self.store.get_blobs(key)
            if blobs is None:
                failed.add(block_id)
                continue
            try:
                with torch.cuda.stream(stream):
                    for layer, (kd, vd) in enumerate(self.block_views(block_id)):
                        for blob, dst in zip(
                            blobs[2 * layer : 2 * layer + 2], (kd, vd), strict=True
                        ):
                            t = kvzip_lossless.decompress(
                                blob, tables=self.store.tables, device=self.device
                            )
                            dst.copy_(t.permute(1, 0, 2), non_blocking=True)
            except kvzip_lossless.CorruptBlobError:
                self.store.drop(key)
                failed.add(block_id)
                continue
            hits[req_id] = hits.get(req_id, 0) + 1
        s = self.store.stats
        s.restore_hits += len(hits)
        s.blocks_restored += sum(hits.values())
        s.tokens_restored += sum(hits.values()) * self.block_size
        s.load_errors += len(failed)
        return failed

    def wait_loads(self) -> None:
        if self._load_started is None:
            return
        cur = torch.cuda.current_stream(self.device)
        for stream in self.load_streams:
            cur.wait_stream(stream)
        for stream in self.load_streams:
            stream.synchronize()
        self.store.stats.restore_seconds += time.perf_counter() - self._load_started
        self._load_started = None

    # -- stores -------------------------------------------------------------------------
    def start_stores(self, stores) -> None:
        for key, block_id in stores:
            # D2D copies on the compute stream: the block may be freed once this returns
            layers = [
                (kd.permute(1, 0, 2).contiguous(), vd.permute(1, 0, 2).contiguous())
                for kd, vd in self.block_views(block_id)
            ]
            event = torch.cuda.Event()
            event.record()
            self._jobs.put((key, layers, event))

    def _store_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            key, layers, event = job
            with torch.cuda.stream(self.store_stream):
                self.store_stream.wait_event(event)
                nbytes, evicted = self.store.put(key, layers)  # GPU encoder for CUDA tensors
            self._done.put((key, nbytes, evicted))

    def collect(self) -> tuple[list[bytes], list[bytes]]:
        stored, dropped = [], []
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
