"""A checking wrapper of ``KvzipConnector`` for the GPU end-to-end run (``gpu_e2e.py``).

On the worker it keeps a device copy of every block it is asked to store, as the forward
computed it, and after every load compares each restored block of the paged cache with that
copy, bit for bit (``torch.equal`` on the raw bf16). The counts go to ``KVZIP_VERIFY_PATH``
(JSON; ``verify.rank<r>.json`` per rank under tensor parallelism). Diagnostic only: the copies
cost as much GPU memory as the blocks stored.
"""

from __future__ import annotations

import json
import os

import torch

from kvzip_vllm.connector import KvzipConnector


class VerifyingKvzipConnector(KvzipConnector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._v_caches: list[torch.Tensor] = []
        self._v_copies: dict[bytes, list[torch.Tensor]] = {}
        self._v_counts = {"stored_copies": 0, "checked": 0, "equal": 0, "differ": 0}
        self._v_path = os.environ.get("KVZIP_VERIFY_PATH")
        worker = getattr(self, "worker", None)  # worker side: one file per rank under TP
        if self._v_path and worker is not None and worker.world > 1:
            root, ext = os.path.splitext(self._v_path)
            self._v_path = f"{root}.rank{worker.rank}{ext}"

    def register_kv_caches(self, kv_caches):
        super().register_kv_caches(kv_caches)
        self._v_caches = [kv_caches[name] for name in sorted(kv_caches)]

    def _v_block(self, block_id: int) -> list[torch.Tensor]:
        return [c[block_id].clone() for c in self._v_caches]

    def wait_for_save(self):
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            for st in getattr(meta, "stores", []):  # kvzip_vllm.tier.metadata.Store
                key = st.key  # a chunk: its blocks st.ids
                if key not in self._v_copies:
                    self._v_copies[key] = [self._v_block(b) for b in st.ids]
                    self._v_counts["stored_copies"] += 1
        return super().wait_for_save()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = super().get_block_ids_with_load_errors()
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            for ld in getattr(meta, "loads", []):  # kvzip_vllm.tier.metadata.Load
                chunk = self._v_copies.get(ld.key)
                for i, block_id in enumerate(ld.ids):  # the blocks the load wrote
                    if chunk is None or i < ld.skip or block_id in errors:
                        continue
                    got = self._v_block(block_id)
                    same = all(torch.equal(a, b) for a, b in zip(chunk[i], got, strict=True))
                    self._v_counts["checked"] += 1
                    self._v_counts["equal" if same else "differ"] += 1
        if self._v_path:
            with open(self._v_path, "w") as f:
                json.dump(self._v_counts, f)
        return errors
