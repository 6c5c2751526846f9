"""The tier benchmark's bit-exactness checker: ``KvzipConnector`` whose worker keeps a
fingerprint of every block it is asked to store, as the forward computed it, and compares the
fingerprint of every block it restored with it.

A block's fingerprint (:func:`fingerprints`, per layer) is ``LANES`` random linear forms of its
16-bit words, computed exactly in float64 (each form's weights below ``2 ** bits``, sized so no
sum leaves float64's 53 exact bits): two blocks that differ in any bit have equal forms with
probability at most ``2 ** -bits`` each, so a differing block passes all ``LANES`` unseen with
probability below ``2 ** -(LANES * 16)`` at the 8B shape's 21-bit weights (2 ** -63). Keeping
fingerprints, not copies, lets the checker run beside a GPU cache that fills the device (a copy
of every stored chunk took as much device memory as the distinct chunks stored: 8 GB more in
the middle of a run on an 80 GB H100, whose engine then ran out of memory).

The work is batched so that the times to first token it runs beside stay the tier's: a store
job's new chunks are fingerprinted into a reference bank (segments of ``[rows, layers, LANES]``,
never copied as it grows); a finished load job is checked with one fingerprint pass per layer
and one comparison per bank segment, and the count of differing blocks stays on the device
until :func:`counts` is read at the end of the run.

The worker is hooked where the tier reports finished loads: ``KvzipWorker._loads_finished``
(asynchronous loads, on the step's thread before their requests are reported finished) and
``_take`` (synchronous loads, ``load_mode='sync'``). The jobs' loads and stores are seen where
the worker hands them to the tier core (``submit_load`` / ``submit_store``). The engine runs in the
benchmark's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one rank): :data:`INSTANCES`. Where
it runs in a process of its own (``vllm serve``), :data:`COUNTS_ENV` names a file the worker
writes its counts to (JSON): at most every :data:`COUNTS_EVERY_S` while checks come in (from
vLLM's once-a-step poll, ``get_finished``), and when it shuts down. vLLM 0.26's engine core can
exit without shutting its connector down (``vllm serve`` stopped by SIGINT), so the counts of
the last checks reach the file without it.
"""

from __future__ import annotations

import json
import os
import time

import torch

from kvzip_vllm.connector import KvzipConnector

#: the checking workers made in this process
INSTANCES: list = []
#: the environment variable naming the file of the counts, written at the worker's shutdown
#: (rank r of a tensor-parallel world: ``counts.json`` -> ``counts.rank{r}.json``)
COUNTS_ENV = "KVZIP_CHECKER_COUNTS"
#: at most this often the counts file is rewritten while checks come in (each write reads the
#: device's counters: one synchronisation)
COUNTS_EVERY_S = 1.0


#: independent random linear forms per block and layer
LANES = 3
#: later copies of a chunk (stored again by another request) fingerprinted beside the first
ALTERNATES = 4
#: blocks fingerprinted at once (a float64 copy of their words: 64 MB at the 8B shape)
PIECE_BLOCKS = 256
#: chunks whose staged copy is fingerprinted where the store path stages it and where it
#: codes it (:meth:`Checker._c_probe`), at most: 12 KB a chunk on the device at the 8B shape
PROBE_CHUNKS = 8192


def form_weights(words: int, device, seed: int = 0) -> torch.Tensor:
    """``[words, LANES]`` float64 weights in ``[1, 2 ** bits)`` for blocks of ``words`` 16-bit
    words, ``bits`` as large as float64 sums them exactly (at most 21)."""
    bits = min(21, 52 - 15 - max(words - 1, 1).bit_length())
    if bits < 12:
        raise ValueError(f"blocks of {words} 16-bit words are too large to fingerprint exactly")
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(1, 1 << bits, (words, LANES), generator=g, dtype=torch.int64)
    return w.to(torch.float64).to(device)


def _forms(words: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[rows, LANES]``: rows of 16-bit ``words`` times ``weights``, exactly (float64, in
    pieces of ``PIECE_BLOCKS`` rows)."""
    out = [
        words[lo : lo + PIECE_BLOCKS].to(torch.float64) @ weights
        for lo in range(0, words.shape[0], PIECE_BLOCKS)
    ]  # fmt: skip
    return torch.cat(out) if out else weights.new_zeros((0, LANES))


def fingerprints(cache: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[len(idx), LANES]`` float64: the blocks ``idx`` of one layer's paged cache (their
    bytes as 16-bit words) times ``weights``, exactly."""
    out = [
        _forms(cache.index_select(0, idx[lo : lo + PIECE_BLOCKS]).contiguous()
               .view(torch.int16).flatten(1), weights)
        for lo in range(0, len(idx), PIECE_BLOCKS)
    ]  # fmt: skip
    return torch.cat(out) if out else weights.new_zeros((0, LANES))


def _token_major(x: torch.Tensor, block_size: int, weights: torch.Tensor) -> torch.Tensor:
    """``[blocks, LANES]``: the blocks of token-major chunks ``x`` (``[chunks, tokens, ...]``)
    times ``weights`` (a block's words in token-major order), exactly."""
    return _forms(x.reshape(-1, block_size * x[0, 0].numel()).view(torch.int16), weights)


class Checker:
    """The checking half of a worker (a mixin before ``KvzipWorker``: :func:`worker_class`;
    the worker's module is imported when an engine makes its connector, not with this one:
    vLLM imports the connector class before its CPU worker scans the loaded modules, a scan
    that fails once kvzip_lossless's numba is loaded)."""

    #: rows (blocks) of one segment of the reference bank: the bank grows a segment at a time
    #: and never copies what it holds
    SEGMENT_ROWS = 4096

    def _c_init(self) -> None:
        self._c_caches: list[torch.Tensor] = []
        self._c_bank: list[torch.Tensor] = []  # segments; a chunk's key gives its first row
        self._c_weights: torch.Tensor | None = None
        self._c_rows = 0
        self._c_refs: dict[bytes, int] = {}
        self._c_alts: dict[bytes, list[int]] = {}  # later copies of a key: their first rows
        self._c_alt_equal: torch.Tensor | None = None  # differing blocks equal to another copy
        self._c_jobs: dict[int, list] = {}  # load job -> its ChunkLoads
        self._c_differ: torch.Tensor | None = None
        self._c_checked = 0
        self._c_unchecked = 0  # restored blocks of chunks never seen stored here
        #: while True (:func:`pause`), restored blocks are counted, not fingerprinted: a
        #: timed restore without the checker's work in its time
        self.c_paused = False
        self._c_paused_blocks = 0  # restored blocks not checked: restored while paused
        self._c_unwritten = False  # checks since the counts file was last written
        self._c_written_at = float("-inf")
        #: per comparison: where its blocks were restored (request, the chunk's place in its
        #: load job, the block's place in its chunk, the key's loads in that job) and which of
        #: them differ in which layer (``[blocks, layers]`` on the device until read)
        self._c_where: list[tuple[list, torch.Tensor]] = []
        #: the store path's staged copy of a chunk, fingerprinted as the reference is
        #: (``[blocks, layers, LANES]``): where it was staged and where it was coded
        self._c_at_stage: dict[bytes, torch.Tensor] = {}
        self._c_at_encode: dict[bytes, torch.Tensor] = {}
        self._c_tm: tuple[torch.Tensor, torch.Tensor] | None = None  # token-major weights

    def _c_start(self, caches: list[torch.Tensor]) -> None:
        """Check the blocks of ``caches`` (one paged cache per layer): the device counters
        and the fingerprints' weights."""
        c0 = caches[0]
        self._c_caches = caches
        self._c_differ = torch.zeros((), dtype=torch.int64, device=c0.device)
        self._c_alt_equal = torch.zeros((), dtype=torch.int64, device=c0.device)
        self._c_weights = form_weights(c0[0].numel() * c0.element_size() // 2, c0.device)

    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)
        self._c_start([c for _, c in self.layers])
        tier, load, store = self.tier, self.tier.submit_load, self.tier.submit_store

        def submit_load(job_id, loads, *args, **kwargs):
            self._c_jobs[job_id] = list(loads)
            return load(job_id, loads, *args, **kwargs)

        def submit_store(job_id, stores, *args, **kwargs):
            self._c_copy(stores)  # the blocks as the forward wrote them, before the tier has them
            return store(job_id, stores, *args, **kwargs)

        tier.submit_load, tier.submit_store = submit_load, submit_store
        self._c_hook_store_path()

    def _c_hook_store_path(self) -> None:
        """Where the tier stages stores on the device (its GPU pipeline, vLLM's FlashAttention
        page order), fingerprint each chunk's staged copy where it is staged (the step's
        stream, right after the reference) and where the store thread codes it (the store
        stream, right before ``encode_batch``): a block whose stored copy differs from the
        reference is then placed between the forward, the staging, the coding and the tier
        (:meth:`differ_where`)."""
        pipeline = getattr(getattr(self, "tier", None), "pipeline", None)
        layout = getattr(pipeline, "layout", None)
        if pipeline is None or getattr(layout, "k_index", True) is not None:
            return
        c0 = self._c_caches[0]
        _, h, t, d2 = c0.shape
        w = self._c_weights.view(h, t, d2, LANES)  # the reference's weights, word by word
        # a staged block is token-major [t, h, d] per K and V: the same forms over its words
        self._c_tm = tuple(
            w[:, :, part].permute(1, 0, 2, 3).reshape(-1, LANES).contiguous()
            for part in (slice(0, d2 // 2), slice(d2 // 2, d2))
        )
        pipeline.on_stage = lambda keys, staged: self._c_probe(self._c_at_stage, keys, staged)
        pipeline.on_encode = lambda keys, staged, todo: self._c_probe(
            self._c_at_encode, keys, staged, todo
        )

    def _c_probe(self, into: dict, keys, staged, todo=None) -> None:
        """Fingerprint the staged chunks ``todo`` (indices into ``keys``; all by default) of a
        store job (``staged``: per layer (K, V) ``[chunks, chunk_tokens, kv_heads,
        head_size]``) into ``into``, each key's first copy, at most ``PROBE_CHUNKS`` keys."""
        want = [j for j in (range(len(keys)) if todo is None else todo) if keys[j] not in into]
        want = want[: max(0, PROBE_CHUNKS - len(into))]
        if not want or self._c_tm is None:
            return
        bs = self._c_caches[0].shape[2]
        idx = self._index(want)  # (page-locked on CUDA: no wait for the stream)
        wk, wv = self._c_tm
        fp = torch.stack(
            [_token_major(k.index_select(0, idx), bs, wk)
             + _token_major(v.index_select(0, idx), bs, wv) for k, v in staged], 1,
        )  # fmt: skip
        bpc = fp.shape[0] // len(want)
        for n, j in enumerate(want):
            into[keys[j]] = fp[n * bpc : (n + 1) * bpc]

    def _take(self, res) -> None:
        super()._take(res)
        if res.job_id not in getattr(self, "_recving", {}):  # a synchronous load: written now
            self._c_check([res])

    def _loads_finished(self, results) -> None:
        super()._loads_finished(results)  # asynchronous loads: written, not read yet
        self._c_check(results)

    def get_finished(self, finished_req_ids):
        out = super().get_finished(finished_req_ids)
        if self._c_unwritten and time.monotonic() - self._c_written_at >= COUNTS_EVERY_S:
            self._c_write(stored=False)  # (the step's thread: no decoding, no wait for stores)
        return out

    def _c_write(self, stored: bool = True) -> None:
        """The counts to :data:`COUNTS_ENV`'s file, if it names one (whole or not at all);
        ``stored``: with the stored-copy comparison of :meth:`differ_where`."""
        path = os.environ.get(COUNTS_ENV)
        self._c_unwritten, self._c_written_at = False, time.monotonic()
        if not path or not self._c_caches:
            return
        if getattr(self, "world", 1) > 1:
            root, ext = os.path.splitext(path)
            path = f"{root}.rank{self.rank}{ext}"
        with open(f"{path}.tmp", "w") as f:
            json.dump(self.counts(stored), f)
        os.replace(f"{path}.tmp", path)

    def _index(self, ids: list[int]) -> torch.Tensor:
        """``ids`` on the caches' device, through page-locked memory on CUDA (no sync)."""
        t, device = torch.tensor(ids, dtype=torch.long), self._c_caches[0].device
        return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t

    def _by_segment(self, ids: list[int], rows: list[int]) -> dict[int, tuple[list, list]]:
        """``(ids, rows)`` grouped by the bank segment of the row: segment -> (ids, offsets)."""
        out: dict[int, tuple[list, list]] = {}
        for i, r in zip(ids, rows, strict=True):
            seg, off = divmod(r, self.SEGMENT_ROWS)
            a, b = out.setdefault(seg, ([], []))
            a.append(i)
            b.append(off)
        return out

    def _c_copy(self, stores) -> None:
        """Fingerprint the stored chunks' blocks into the bank: a key's first copy is its
        reference; a later copy (another request computed the same chunk, perhaps in another
        batch: its bits may differ) is kept as one of the key's alternates (at most
        ``ALTERNATES``), so that a restored block differing from the reference can be told
        to equal another copy stored (:meth:`differ_where`)."""
        if not self._c_caches:
            return
        take = []
        for st in stores:
            if st.key not in self._c_refs or len(self._c_alts.get(st.key, ())) < ALTERNATES:
                take.append(st)
        if not take:
            return
        ids = [int(b) for st in take for b in st.block_ids]
        first = self._c_rows
        need, c0 = first + len(ids), self._c_caches[0]
        while len(self._c_bank) * self.SEGMENT_ROWS < need:
            shape = (self.SEGMENT_ROWS, len(self._c_caches), LANES)
            self._c_bank.append(torch.empty(shape, dtype=torch.float64, device=c0.device))
        for seg, (blocks, offs) in self._by_segment(ids, list(range(first, need))).items():
            idx, lo = self._index(blocks), offs[0]  # a segment's rows are consecutive
            rows = self._c_bank[seg][lo : lo + len(offs)]
            for layer, c in enumerate(self._c_caches):
                rows[:, layer].copy_(fingerprints(c, idx, self._c_weights))
        self._c_rows = need
        for st in take:
            if st.key in self._c_refs:
                self._c_alts.setdefault(st.key, []).append(first)
            else:
                self._c_refs[st.key] = first
            first += len(st.block_ids)

    def _bank_rows(self, rows: list[int]) -> torch.Tensor:
        """The bank's ``rows`` (any segments), in their order: ``[len(rows), layers, LANES]``."""
        out = torch.empty((len(rows), len(self._c_caches), LANES), dtype=torch.float64,
                          device=self._c_caches[0].device)  # fmt: skip
        for seg, (pos, offs) in self._by_segment(list(range(len(rows))), rows).items():
            out[self._index(pos)] = self._c_bank[seg].index_select(0, self._index(offs))
        return out

    def _c_check(self, results) -> None:
        """Compare the blocks the finished load jobs restored with the bank's copies."""
        ids: list[int] = []
        rows: list[int] = []
        where: list[tuple] = []
        alt_rows: list[int] = []  # rows of later copies of the restored blocks' keys ...
        alt_of: list[int] = []  # ... and which of the checked blocks each is a copy of
        for res in results:
            loads = self._c_jobs.pop(res.job_id, None)
            if not loads:
                continue  # a store job
            if self.c_paused:
                self._c_paused_blocks += sum(len(ld.block_ids) - ld.skip for ld in loads)
                continue
            failed = {(f.req_id, f.key) for f in res.failed}
            times: dict[bytes, int] = {}
            for ld in loads:
                times[ld.key] = times.get(ld.key, 0) + 1
            for pos, ld in enumerate(loads):
                if (ld.req_id, ld.key) in failed:
                    continue
                base = self._c_refs.get(ld.key)
                for i, block_id in enumerate(ld.block_ids):
                    if i < ld.skip or block_id in res.failed_blocks:
                        continue
                    if base is None:
                        self._c_unchecked += 1
                    else:
                        ids.append(int(block_id))
                        rows.append(base + i)
                        where.append((str(ld.req_id), pos, len(loads), i, times[ld.key], ld.key))
                        for alt in self._c_alts.get(ld.key, ()):
                            alt_rows.append(alt + i)
                            alt_of.append(len(ids) - 1)
        got_all = None
        if alt_of and ids:  # every checked block's fingerprints, for the alternates below
            got_all = torch.empty((len(ids), len(self._c_caches), LANES), dtype=torch.float64,
                                  device=self._c_caches[0].device)  # fmt: skip
        for seg, (pos, offs) in self._by_segment(list(range(len(ids))), rows).items():
            got_idx = self._index([ids[j] for j in pos])
            got = torch.stack(
                [fingerprints(c, got_idx, self._c_weights) for c in self._c_caches], 1
            )
            if got_all is not None:
                got_all[self._index(pos)] = got
            want = self._c_bank[seg].index_select(0, self._index(offs))
            # (the bytes' fingerprints, not the values: a NaN equals its copy here)
            bad = (got != want).any(-1)  # [blocks, layers]
            self._c_differ += bad.any(1).sum()
            self._c_where.append(([where[j] for j in pos], bad))
        self._c_checked += len(ids)
        self._c_unwritten = True
        if got_all is not None:  # a block differing from its reference, equal to a later copy
            of = self._index(alt_of)
            got = got_all[of]
            ref = self._bank_rows([rows[j] for j in alt_of])
            alt = self._bank_rows(alt_rows)
            hit = (got != ref).flatten(1).any(1) & (got == alt).flatten(1).all(1)
            # (a block with several alternates counted once)
            per = torch.zeros(len(ids), dtype=torch.int64, device=hit.device)
            per.index_add_(0, of, hit.to(torch.int64))
            self._c_alt_equal += (per > 0).sum()

    def differ_where(self, examples: int = 8, stored: bool = True) -> dict:
        """Where the restored blocks that differ were (one synchronisation): their count per
        request, the places of their chunks in their load jobs per request (first, last), per
        number of loads of their key in their load job, the layers that differ (each with its
        count), and the first ``examples`` as (request, the chunk's place / the job's chunks,
        the block's place in its chunk, the key's loads in the job, layers differing, whether
        the tier's stored copy of the block, decoded again on the CPU, equals the reference:
        True says the restore or a later write changed the block, False that the tier holds
        other bits than the forward computed, None that it no longer holds it or, without
        ``stored``, that it was not asked; then the layers in which the store path's staged
        copy differed from the reference where it was staged, and where it was coded, None
        where not fingerprinted). ``control``: the same for the first block that compared
        equal (its stored copy should equal the reference: the comparison's own check)."""
        by_req: dict[str, int] = {}
        places: dict[str, list[int]] = {}
        by_times: dict[int, int] = {}
        by_layer: dict[int, int] = {}
        first: list = []
        for meta, bad in self._c_where:
            bad = bad.cpu()
            for j in bad.any(1).nonzero().flatten().tolist():
                req, pos, n, i, times, key = meta[j]
                layers = bad[j].nonzero().flatten().tolist()
                by_req[req] = by_req.get(req, 0) + 1
                lo_hi = places.setdefault(req, [pos, pos])
                lo_hi[0], lo_hi[1] = min(lo_hi[0], pos), max(lo_hi[1], pos)
                by_times[times] = by_times.get(times, 0) + 1
                for layer in layers:
                    by_layer[layer] = by_layer.get(layer, 0) + 1
                if len(first) < examples:
                    same = self._c_stored_equals_reference(key, i) if stored else None
                    first.append([req, f"{pos}/{n}", i, times, len(layers), same,
                                  *self._c_probes(key, i)])  # fmt: skip
        alt_equal = int(self._c_alt_equal.item()) if self._c_alt_equal is not None else 0
        control = None
        for meta, bad in self._c_where:
            ok = (~bad.cpu().any(1)).nonzero().flatten().tolist()
            if ok:
                req, pos, n, i, times, key = meta[ok[0]]
                same = self._c_stored_equals_reference(key, i) if stored else None
                control = [req, f"{pos}/{n}", i, times, 0, same, *self._c_probes(key, i)]
                break
        return {
            "equal_to_another_copy_stored": alt_equal,
            "keys_stored_more_than_once": len(self._c_alts),
            "by_request": by_req,
            "chunk_places_by_request": places,
            "by_loads_of_key_in_job": by_times,
            "layers_differing": len(by_layer),
            "by_layer": dict(sorted(by_layer.items())),
            "examples": first,
            "control": control,
        }

    def _c_probes(self, key: bytes, i: int) -> list[int | None]:
        """Layers in which block ``i`` of ``key``'s staged copy differed from the reference:
        where the store path staged it, where it coded it (None: not fingerprinted)."""
        ref = self._bank_rows([self._c_refs[key] + i])[0]
        return [
            int((fp[i] != ref).any(-1).sum()) if (fp := at.get(key)) is not None else None
            for at in (self._c_at_stage, self._c_at_encode)
        ]

    def _c_stored_equals_reference(self, key: bytes, i: int) -> bool | None:
        """Block ``i`` of the tier's stored copy of ``key`` (decoded on the CPU, apart from
        the GPU restore path, laid out as the cache lays it out) against the reference's
        fingerprints; None where the tier no longer holds it or cannot say."""
        tier = getattr(self, "tier", None)
        if tier is None or not hasattr(tier.layout, "block_size"):
            return None
        try:
            tier.drain()  # (no store in flight while the store is read)
            outs = self.read_block(key, "cpu")
        except Exception:  # noqa: BLE001 (a diagnosis only: it cannot say)
            return None
        if outs is None:
            return None
        bs, ref = tier.layout.block_size, self._bank_rows([self._c_refs[key] + i])[0]
        zero = torch.zeros(1, dtype=torch.long, device=self._c_caches[0].device)
        for layer, c in enumerate(self._c_caches):
            k, v = (outs[2 * layer + h][i * bs : (i + 1) * bs].to(c.device) for h in (0, 1))
            block = torch.zeros((1, *c.shape[1:]), dtype=c.dtype, device=c.device)
            tier.layout.scatter(block, zero, k, v)
            if not torch.equal(fingerprints(block, zero, self._c_weights)[0], ref[layer]):
                return False
        return True

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self._c_write()

    def counts(self, stored: bool = True) -> dict:
        """Blocks checked and differing (one synchronisation), chunks copied."""
        differ = int(self._c_differ.item()) if self._c_differ is not None else 0
        out = {
            "blocks_checked": self._c_checked,
            "blocks_differ": differ,
            "blocks_equal": self._c_checked - differ,
            "restored_blocks_without_copy": self._c_unchecked,
            "chunks_copied": len(self._c_refs),
        }
        if self._c_paused_blocks:
            out["restored_blocks_while_paused"] = self._c_paused_blocks
        if differ:
            out["differ_where"] = self.differ_where(stored=stored)
        return out


def worker_class() -> type:
    """``KvzipWorker`` with the :class:`Checker` in front."""
    from kvzip_vllm.tier.worker import KvzipWorker

    return type("CheckingWorker", (Checker, KvzipWorker), {})


def checking(worker):
    """Make a ``KvzipWorker`` check what it restores (before its caches are registered)."""
    worker.__class__ = worker_class()
    worker._c_init()
    INSTANCES.append(worker)
    return worker


class CheckingKvzipConnector(KvzipConnector):
    """``KvzipConnector`` whose worker checks what it restores (the scheduler unchanged)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.worker is not None:
            checking(self.worker)


def pause(paused: bool) -> None:
    """Stop (True) or resume (False) checking the restores of this process's checking
    workers; their stores are still fingerprinted. A 131,072-token 8B restore's check reads
    its 17 GB of blocks as float64 words on the compute stream (about 180 GB of memory
    traffic) and launches about 5,000 kernels on the step's thread, all before the request's
    first token: paused, a timed restore holds the tier's time only."""
    for c in INSTANCES:
        c.c_paused = paused


def counts() -> dict | None:
    """The checker's counts of this process's worker (None: no checking connector ran)."""
    return INSTANCES[-1].counts() if INSTANCES else None
