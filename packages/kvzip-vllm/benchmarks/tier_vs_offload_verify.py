"""A cheap checking wrapper of ``KvzipConnector`` for ``tier_vs_offload.py``.

Like ``kvzip_gpu_verify.VerifyingKvzipConnector`` it keeps a device copy of every chunk the
tier is asked to store, as the forward computed it, and compares every block the tier
restored with that copy, bit for bit; unlike it, the work is batched so that the times to
first token it runs beside stay the tier's: the step's new stores are copied into a reference
bank (segments of one device tensor ``[rows, layers, *block]``, never copied as it grows);
the step's loads are checked with one gather per layer into one stacked tensor, one gather of
the bank and one comparison per bank segment (about layers + 6 launches a step whatever the
blocks restored, block ids uploaded without a synchronisation), and the count of differing
blocks stays on the device until :func:`counts` is read at the end of the run. The copies
take as much GPU memory as the distinct chunks stored.

Worker side only (the engine runs in the benchmark's process: ``VLLM_ENABLE_V1_MULTIPROCESSING
=0``, one rank), found through :data:`INSTANCES`.
"""

from __future__ import annotations

import cProfile
import functools
import io
import pstats
import time
from collections import defaultdict

import torch

from kvzip_formats import settings
from kvzip_vllm.connector import KvzipConnector

#: the worker-side instances made in this process
INSTANCES: list[CheckingKvzipConnector] = []

#: host seconds and calls per connector hook, both roles of this process (scheduler and
#: worker), the tier's part only: ``checker`` is the comparison's own host time, kept apart
HOOK_SECONDS: dict[str, float] = defaultdict(float)
HOOK_CALLS: dict[str, int] = defaultdict(int)

#: every ``start_load_kv`` call with loads: (wall seconds, this thread's CPU seconds, chunks
#: loaded): a wall time far above the CPU time is a wait (a device sync, a lock, the GIL)
LOAD_CALLS: list[tuple[float, float, int]] = []

#: ``KVZIP_TVO_PROFILE=1``: those calls also run under cProfile (this thread only), its
#: top functions by cumulative time reported in :func:`counts` (``load_profile``)
PROFILE = cProfile.Profile() if settings.TVO_PROFILE.get() == "1" else None

#: every step's timeline (worker side): host times (perf_counter) at ``start_load_kv`` entry
#: and exit, ``wait_for_save`` entry and ``get_block_ids_with_load_errors`` exit, the step's
#: chunks loaded, and CUDA events at ``start_load_kv`` entry and ``wait_for_save`` entry on
#: the compute stream (the device time from the step's restore to the end of its forward)
STEPS: list[dict] = []

#: the hooks vLLM calls on a connector every step (or every request)
HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
)


def _timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            HOOK_SECONDS[name] += time.perf_counter() - t0
            HOOK_CALLS[name] += 1

    return wrapper


class CheckingKvzipConnector(KvzipConnector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._c_init()
        if getattr(self, "worker", None) is not None:
            INSTANCES.append(self)

    #: rows (blocks) of one segment of the reference bank: the bank grows a segment at a time
    #: and never copies what it holds (a bank that doubled needed its old and new copies at
    #: once: at the 8B shape, 32 GB of stored blocks asked for 64 GB more and ran out)
    SEGMENT_ROWS = 4096

    def _c_init(self) -> None:
        self._c_caches: list[torch.Tensor] = []
        # the reference bank: segments of SEGMENT_ROWS rows, each one device tensor [rows,
        # layers, *block]; rows are appended in order, a chunk's key gives its first block's
        self._c_bank: list[torch.Tensor] = []
        self._c_rows = 0
        self._c_refs: dict[bytes, int] = {}
        self._c_differ: torch.Tensor | None = None
        self._c_checked = 0
        self._c_loads_unchecked = 0  # restored blocks of chunks never seen stored here

    def register_kv_caches(self, kv_caches):
        super().register_kv_caches(kv_caches)
        self._c_caches = [kv_caches[name] for name in sorted(kv_caches)]
        self._c_differ = torch.zeros((), dtype=torch.int64, device=self._c_caches[0].device)

    def _index(self, ids: list[int]) -> torch.Tensor:
        """``ids`` on the caches' device, through page-locked memory on CUDA (no sync)."""
        t, device = torch.tensor(ids, dtype=torch.long), self._c_caches[0].device
        return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t

    def _by_segment(self, ids: list[int], rows: list[int]) -> dict[int, tuple[list, list]]:
        """``(ids, rows)`` pairs grouped by the bank segment of the row: segment -> (ids,
        offsets in the segment), in order."""
        out: dict[int, tuple[list, list]] = {}
        for i, r in zip(ids, rows, strict=True):
            seg, off = divmod(r, self.SEGMENT_ROWS)
            a, b = out.setdefault(seg, ([], []))
            a.append(i)
            b.append(off)
        return out

    def _append(self, ids: list[int]) -> int:
        """Copy blocks ``ids`` of every layer into the bank; returns the first row used."""
        first = self._c_rows
        need = first + len(ids)
        c0 = self._c_caches[0]
        while len(self._c_bank) * self.SEGMENT_ROWS < need:
            shape = (self.SEGMENT_ROWS, len(self._c_caches), *c0.shape[1:])
            self._c_bank.append(torch.empty(shape, dtype=c0.dtype, device=c0.device))
        for seg, (blocks, offs) in self._by_segment(ids, list(range(first, need))).items():
            idx, lo = self._index(blocks), offs[0]  # a segment's rows are consecutive
            rows = self._c_bank[seg][lo : lo + len(offs)]
            for layer, c in enumerate(self._c_caches):
                rows[:, layer].copy_(c.index_select(0, idx))
        self._c_rows = need
        return first

    def _c_wait_for_save(self):
        if self.has_connector_metadata() and self._c_caches:
            meta = self._get_connector_metadata()
            new = [st for st in getattr(meta, "stores", []) if st.key not in self._c_refs]
            if new:
                first = self._append([b for st in new for b in st.ids])
                for st in new:
                    self._c_refs[st.key] = first
                    first += len(st.ids)

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        n = len(getattr(meta, "loads", ()) or ())
        t0, c0 = time.perf_counter(), time.thread_time()
        step = {"sld0": t0, "loads": n, "ev": []}
        if self._c_caches and self._c_caches[0].is_cuda:
            step["ev"].append(torch.cuda.Event(enable_timing=True))
            step["ev"][0].record()
        STEPS.append(step)
        try:
            if n and PROFILE is not None:
                PROFILE.enable()
            return super().start_load_kv(forward_context, **kwargs)
        finally:
            if n and PROFILE is not None:
                PROFILE.disable()
            wall = time.perf_counter() - t0
            step["sld1"] = t0 + wall
            HOOK_SECONDS["start_load_kv"] += wall
            HOOK_CALLS["start_load_kv"] += 1
            if n:
                LOAD_CALLS.append((wall, time.thread_time() - c0, n))

    def wait_for_save(self):
        t0 = time.perf_counter()
        if STEPS and "wfs0" not in STEPS[-1]:
            STEPS[-1]["wfs0"] = t0
            if STEPS[-1]["ev"]:
                STEPS[-1]["ev"].append(torch.cuda.Event(enable_timing=True))
                STEPS[-1]["ev"][1].record()
        self._c_wait_for_save()
        HOOK_SECONDS["checker"] += time.perf_counter() - t0
        return _timed("wait_for_save", super().wait_for_save)()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = _timed("get_block_ids_with_load_errors", super().get_block_ids_with_load_errors)()
        t0 = time.perf_counter()
        self._c_check(errors)
        t1 = time.perf_counter()
        HOOK_SECONDS["checker"] += t1 - t0
        if STEPS and "gbe1" not in STEPS[-1]:
            STEPS[-1]["gbe1"] = t1
        return errors

    def _c_check(self, errors: set[int]) -> None:
        if self.has_connector_metadata() and self._c_caches:
            meta = self._get_connector_metadata()
            ids: list[int] = []
            rows: list[int] = []
            for ld in getattr(meta, "loads", []):
                base = self._c_refs.get(ld.key)
                for i, block_id in enumerate(ld.ids):
                    if i < ld.skip or block_id in errors:
                        continue
                    if base is None:
                        self._c_loads_unchecked += 1
                        continue
                    ids.append(block_id)
                    rows.append(base + i)
            for seg, (got_ids, offs) in self._by_segment(ids, rows).items():
                got_idx, want_idx = self._index(got_ids), self._index(offs)
                got = torch.stack([c.index_select(0, got_idx) for c in self._c_caches], 1)
                want = self._c_bank[seg].index_select(0, want_idx)
                # bit for bit: the bytes, not the values (a NaN equals its copy here)
                diff = got.view(torch.uint8) != want.view(torch.uint8)
                self._c_differ += diff.flatten(1).any(1).sum()
            self._c_checked += len(ids)

    def counts(self) -> dict:
        """Blocks checked, differing (one synchronisation), and chunks copied."""
        differ = int(self._c_differ.item()) if self._c_differ is not None else 0
        return {
            "blocks_checked": self._c_checked,
            "blocks_differ": differ,
            "blocks_equal": self._c_checked - differ,
            "restored_blocks_without_copy": self._c_loads_unchecked,
            "chunks_copied": len(self._c_refs),
            "hook_seconds": {k: round(v, 6) for k, v in sorted(HOOK_SECONDS.items())},
            "hook_calls": dict(sorted(HOOK_CALLS.items())),
            "load_calls": [[round(w, 6), round(c, 6), n] for w, c, n in LOAD_CALLS],
            "load_profile": _profile_top(),
            "steps": _timeline(),
        }


# the tier's own hooks, timed on the subclass (the two it overrides time their ``super()``)
for _name in HOOKS:
    if _name not in CheckingKvzipConnector.__dict__ and hasattr(KvzipConnector, _name):
        setattr(CheckingKvzipConnector, _name, _timed(_name, getattr(KvzipConnector, _name)))


def _timeline() -> list[dict]:
    """:data:`STEPS` as milliseconds: ``load`` (start_load_kv), ``forward`` (its exit to
    wait_for_save: the forward's host time), ``after`` (wait_for_save to the end of
    get_block_ids_with_load_errors), ``rest`` (to the next step's start: sampling, the
    scheduler, the engine's own work), ``device`` (the compute stream from the step's start to
    its forward's end, CUDA), ``loads`` (chunks)."""
    if any(len(s["ev"]) == 2 for s in STEPS):
        torch.cuda.synchronize()
    out = []
    for s, nxt in zip(STEPS, [*STEPS[1:], None], strict=True):
        if "sld1" not in s or "wfs0" not in s or "gbe1" not in s:
            continue
        row = {
            "loads": s["loads"],
            "load": (s["sld1"] - s["sld0"]) * 1e3,
            "forward": (s["wfs0"] - s["sld1"]) * 1e3,
            "after": (s["gbe1"] - s["wfs0"]) * 1e3,
            "rest": (nxt["sld0"] - s["gbe1"]) * 1e3 if nxt is not None else None,
        }
        if len(s["ev"]) == 2:
            row["device"] = s["ev"][0].elapsed_time(s["ev"][1])
        out.append({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
    return out


def _profile_top(lines: int = 45) -> list[str] | None:
    """The profiled loads' top functions by cumulative time (None: not profiled)."""
    if PROFILE is None:
        return None
    buf = io.StringIO()
    pstats.Stats(PROFILE, stream=buf).sort_stats("cumulative").print_stats(lines)
    return [ln.rstrip() for ln in buf.getvalue().splitlines() if ln.strip()]


def counts() -> dict | None:
    """The checker's counts of this process's worker (None: no checking connector ran)."""
    if not INSTANCES:
        return None
    return INSTANCES[-1].counts()
