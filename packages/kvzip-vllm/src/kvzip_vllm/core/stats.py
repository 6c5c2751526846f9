"""The tier's counters (:class:`TierStats`): what a user reads from the connector's stats file
(JSON at ``stats_path``), and where the tier's time went. The store (:mod:`.store`) holds one;
the CUDA pipeline's store and load paths and the connector's worker add to it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class TierStats:
    """Counters a user can read (the connector writes them as JSON to ``stats_path``). The
    ``blocks_*`` counters count entries (chunks of ``chunk_tokens`` tokens)."""

    budget_bytes: int = 0
    arena_bytes: int = 0  # the arena (page-locked on a CUDA host): allocated once, <= budget
    arena_pinned: bool = False
    blocks_held: int = 0
    bytes_held: int = 0  # arena bytes the held entries take, plus their decode plans' arrays
    raw_bytes_held: int = 0  # bf16 bytes those chunks would take uncompressed
    blocks_stored: int = 0  # cumulative
    bytes_stored: int = 0  # cumulative compressed bytes written (blobs only)
    raw_bytes_stored: int = 0  # cumulative bf16 bytes compressed
    blocks_skipped: int = 0  # larger than the whole budget (or no room the arena can make)
    evictions: int = 0
    restore_hits: int = 0  # requests whose prefix was restored (at least one chunk)
    blocks_restored: int = 0
    tokens_restored: int = 0
    restore_seconds: float = 0.0
    # where a load's time goes: the whole of ``submit_load`` (every path); GPU path: the host
    # part of starting the step's loads (leases, plans, copies and decodes launched) and
    # ``wait_loads`` (the step's one sync and the scatter into the cache)
    load_submit_seconds: float = 0.0
    load_host_seconds: float = 0.0
    # ... of it, the CPU time of the thread that ran it (time.thread_time): where the host part
    # is much longer than this, the thread waited (for the GIL, a lock, a synchronisation),
    # not worked
    load_host_cpu_seconds: float = 0.0
    load_wait_seconds: float = 0.0
    # ... of the host part: looking the chunks up (leases, plan checks, waits for stores in
    # flight), the step's offsets, allocating its device buffers, preparing the decodes, and
    # launching the copies, decodes and writes
    load_lookup_seconds: float = 0.0
    load_plan_seconds: float = 0.0
    load_alloc_seconds: float = 0.0
    load_prepare_seconds: float = 0.0
    load_launch_seconds: float = 0.0
    # asynchronous loads (the default): jobs run on the tier's load thread, off the engine's
    # step, and their time there (submit to written, queueing behind earlier jobs included);
    # the explicit exceptions where a step waits for them anyway (an emptying of the tier, a
    # shutdown) and how long those steps waited
    load_jobs_async: int = 0
    load_jobs_merged: int = 0  # jobs run together with the one before them (one pass, one sync)
    load_async_seconds: float = 0.0
    step_waits_for_loads: int = 0
    step_wait_for_loads_seconds: float = 0.0
    # steps that scheduled nothing and waited, the GIL released, for the load thread
    # (``idle_wait_s``): how many, their time, and those a finished load ended early
    idle_waits: int = 0
    idle_wait_seconds: float = 0.0
    idle_waits_ended_by_load: int = 0
    store_seconds: float = 0.0
    load_errors: int = 0  # chunks missing or failing their checksum at load: recomputed
    # chunks not stored because a chunk before them in their request failed to load this
    # step (they were computed on KV that was not restored; vLLM recomputes and stores them)
    stores_refused_after_load_error: int = 0
    store_errors: int = 0  # stores that raised (the chunk is not held; recomputed if needed)
    # GPU path: chunks not stored because the queue of staged copies was full
    # (``store_queue_bytes``); peak bytes that queue held
    stores_dropped_queue_full: int = 0
    store_queue_peak_bytes: int = 0
    # GPU path, the queue full: chunks spilled raw (bf16) to page-locked host extents of the
    # arena, coded later (their extents count in ``bytes_held`` meanwhile: the budget holds);
    # chunks whose step waited for room instead (no host room either) and the time waited
    stores_spilled_host: int = 0
    spill_bytes_held: int = 0
    spill_peak_bytes: int = 0
    stores_waited_queue_full: int = 0
    #: spilled chunks whose copy back to the device ran while the job before them was coded
    stores_unspilled_ahead: int = 0
    # store jobs whose device copies the reserved store queue had no room for (fragmented):
    # allocated by torch instead (``store_queue_reserved``)
    stores_stage_allocated: int = 0
    store_wait_seconds: float = 0.0
    #: loads of chunks still being stored (the scheduler counts them held): waited for
    loads_waited_for_store: int = 0
    # GPU path: the store thread's time coding (from the step's KV computed to the chunks
    # held), and the bf16 bytes it coded: their ratio is its throughput
    store_busy_seconds: float = 0.0
    # ... of which in kvzip-lossless's encode_batch (its kernels, its one synchronisation and
    # its host layout), and placing the blobs (reserve, copies to the arena, commit)
    store_encode_seconds: float = 0.0
    store_copy_seconds: float = 0.0
    # ... and bringing spilled chunks back to the device (the wait for their copies included)
    # and the job's last synchronisation
    store_unspill_seconds: float = 0.0
    store_sync_seconds: float = 0.0
    # ... and holding jobs for the table set's fit, then fitting it (``fit_tokens``); and
    # coding the jobs (store_encode_seconds and store_copy_seconds are its calls' part)
    store_fit_seconds: float = 0.0
    store_code_seconds: float = 0.0
    # ... of which the store thread ran on a CPU (Python, the driver's calls): the rest it
    # waited, for the GIL (the engine loop holds it between switch intervals) or the device
    store_thread_cpu_seconds: float = 0.0
    misses: int = field(default=0)
    table_bytes: int = 0  # the per-model table set (stored once), 0 until fitted/loaded
    table_fit_tokens: int = 0  # tokens the set was fitted on by the store (0: loaded)
    peak_bytes_held: int = 0

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
