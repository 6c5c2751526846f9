"""A cheap checking wrapper of ``KvzipConnector`` for ``tier_vs_offload.py``.

Like ``kvzip_gpu_verify.VerifyingKvzipConnector`` it keeps a device copy of every chunk the
tier is asked to store, as the forward computed it, and compares every block the tier
restored with that copy, bit for bit; unlike it, the work is batched so that the times to
first token it runs beside stay the tier's: one gather per layer per step for the step's new
stores, one gather and one comparison per layer per step for the step's loads, and the count
of differing blocks stays on the device (no synchronisation) until :func:`counts` is read at
the end of the run. The copies take as much GPU memory as the distinct chunks stored.

Worker side only (the engine runs in the benchmark's process: ``VLLM_ENABLE_V1_MULTIPROCESSING
=0``, one rank), found through :data:`INSTANCES`.
"""

from __future__ import annotations

import torch

from kvzip_vllm.connector import KvzipConnector

#: the worker-side instances made in this process
INSTANCES: list[CheckingKvzipConnector] = []


class CheckingKvzipConnector(KvzipConnector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._c_init()
        if getattr(self, "worker", None) is not None:
            INSTANCES.append(self)

    def _c_init(self) -> None:
        self._c_caches: list[torch.Tensor] = []
        self._c_refs: dict[bytes, list[torch.Tensor]] = {}
        self._c_differ: torch.Tensor | None = None
        self._c_checked = 0
        self._c_loads_unchecked = 0  # restored blocks of chunks never seen stored here

    def register_kv_caches(self, kv_caches):
        super().register_kv_caches(kv_caches)
        self._c_caches = [kv_caches[name] for name in sorted(kv_caches)]
        self._c_differ = torch.zeros((), dtype=torch.int64, device=self._c_caches[0].device)

    def _gather(self, ids: list[int]) -> list[torch.Tensor]:
        idx = torch.tensor(ids, dtype=torch.long, device=self._c_caches[0].device)
        return [c.index_select(0, idx) for c in self._c_caches]

    def wait_for_save(self):
        if self.has_connector_metadata() and self._c_caches:
            meta = self._get_connector_metadata()
            new = [st for st in getattr(meta, "stores", []) if st.key not in self._c_refs]
            if new:
                got = self._gather([b for st in new for b in st.ids])
                off = 0
                for st in new:
                    n = len(st.ids)
                    self._c_refs[st.key] = [g[off : off + n] for g in got]
                    off += n
        return super().wait_for_save()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = super().get_block_ids_with_load_errors()
        if self.has_connector_metadata() and self._c_caches:
            meta = self._get_connector_metadata()
            ids: list[int] = []
            refs: list[list[torch.Tensor]] = []
            for ld in getattr(meta, "loads", []):
                chunk = self._c_refs.get(ld.key)
                for i, block_id in enumerate(ld.ids):
                    if i < ld.skip or block_id in errors:
                        continue
                    if chunk is None:
                        self._c_loads_unchecked += 1
                        continue
                    ids.append(block_id)
                    refs.append([r[i] for r in chunk])
            if ids:
                got = self._gather(ids)
                for layer, g in enumerate(got):
                    want = torch.stack([r[layer] for r in refs])
                    # bit for bit: the bytes, not the values (a NaN equals its copy here)
                    diff = g.view(torch.uint8) != want.view(torch.uint8)
                    self._c_differ += diff.flatten(1).any(1).sum()
                self._c_checked += len(ids)
        return errors

    def counts(self) -> dict:
        """Blocks checked, differing (one synchronisation), and chunks copied."""
        differ = int(self._c_differ.item()) if self._c_differ is not None else 0
        return {
            "blocks_checked": self._c_checked,
            "blocks_differ": differ,
            "blocks_equal": self._c_checked - differ,
            "restored_blocks_without_copy": self._c_loads_unchecked,
            "chunks_copied": len(self._c_refs),
        }


def counts() -> dict | None:
    """The checker's counts of this process's worker (None: no checking connector ran)."""
    if not INSTANCES:
        return None
    return INSTANCES[-1].counts()
