"""A benchmark-only KV connector for ``kvzip bench serving``: every new request's prompt (all
but its last token) is "loaded" by writing a valid, random cache block into each of its
blocks, so that decode can be timed with hundreds of long sequences resident without
prefilling them first (what a prefill-decode split hands over).

vLLM ships the same idea as ``DecodeBenchConnector``, but it writes one constant (0.015) into
the cache tensor, which for a uint8 cache (fp8, kvzip's compact formats) is the byte 0: codes
that decode to zeros. This one writes a block that the cache's own format produced from random
K/V (bf16: the values; fp8: e4m3 bytes; kvzip formats: the backend's write path), copied into
every block of the request, so the decode kernels read realistic bytes. :data:`FILL` is
flipped in-process (the engine runs in the benchmark's process): prefill is timed with
``FILL = False``.

kvzip's attention backend refuses every KV connector (a loaded block would arrive without its
bf16 sink slots). This one loads placeholder blocks only, whose sinks do not matter for a
speed measurement: :func:`allow_fill_connector`, called by the benchmark in its own engine
process only, lets exactly this connector through. The shipped package has no switch for it.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

#: Flipped by the benchmark: False lets requests prefill for real.
FILL = True

#: The name this connector is configured by (``kv_connector``).
CONNECTOR = "KvzipBenchFill"

#: Blocks written so far in this process (all layers' copies count once): what a run filled.
FILLED_BLOCKS = 0


def allow_fill_connector(backend) -> object:
    """Make ``backend`` (the module ``kvzip_vllm.backend``) take a config whose connector is
    this one, and refuse every other connector as before. Idempotent. Returns the check now
    in place."""
    shipped = getattr(backend, "_shipped_connector_refused", backend._connector_refused)

    def refused(cfg, *args, **kwargs) -> bool:
        kt = getattr(cfg, "kv_transfer_config", None)
        if kt is not None and getattr(kt, "kv_connector", None) == CONNECTOR:
            return False
        return shipped(cfg, *args, **kwargs)

    backend._shipped_connector_refused = shipped
    backend._connector_refused = refused
    return refused


class FillMetadata(KVConnectorMetadata):
    def __init__(self, fills: list[list[int]]):
        self.fills = fills


class KvzipBenchFill(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        self._cache_dtype = str(vllm_config.cache_config.cache_dtype)
        self._pending: list[list[int]] = []
        self._seen: set[str] = set()
        self._caches: dict[str, torch.Tensor] = {}
        self._template: dict[str, torch.Tensor] = {}

    # -- scheduler ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        if not FILL or request.request_id in self._seen:
            return 0, False
        return max(0, request.num_tokens - 1 - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if num_external_tokens <= 0:
            return
        self._seen.add(request.request_id)
        ids = blocks.get_block_ids()[0]
        self._pending.append(list(ids[: -(-num_external_tokens // self._block_size)]))

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta, self._pending = FillMetadata(self._pending), []
        return meta

    def request_finished(self, request, block_ids):
        self._seen.discard(request.request_id)
        return False, None

    # -- worker ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._caches = dict(kv_caches)

    def _make_template(self, cache: torch.Tensor) -> torch.Tensor:
        g = torch.Generator(device=cache.device).manual_seed(1234)
        shape = cache.shape[1:]
        if cache.dtype in (torch.bfloat16, torch.float16):
            return torch.randn(shape, generator=g, device=cache.device).to(cache.dtype)
        if self._cache_dtype.startswith("fp8"):
            x = torch.randn(shape, generator=g, device=cache.device)
            return x.to(torch.float8_e4m3fn).view(torch.uint8)
        # a kvzip format: its own write path encodes random K/V into one block
        from kvzip_kernels.paged import PagedAttention
        from kvzip_vllm.settings import backend_settings, load_format

        s = backend_settings()
        cfg = self._vllm_config.model_config
        h, bs = cache.shape[1], cache.shape[2]
        d = cfg.get_head_size()
        pa = PagedAttention(
            load_format(s.kv_format, s.calibration),
            num_heads=cfg.get_num_attention_heads(self._vllm_config.parallel_config),
            num_kv_heads=h,
            head_size=d,
            block_size=bs,
            scale=d**-0.5,
            kernels=False,
            # the cache's layout includes a residual window's reserve (KVZIP_KV_FORMAT=NAME+rN)
            recent=s.recent,
            window_slot_tokens=s.window_slot_tokens,
        )
        # a scratch cache with room for one sink slot; the template is its block 1, written
        # as the first block of a sequence (position 0 is a sink token)
        one = torch.zeros((max(2, 2 * pa.blocks_per_slot), *shape), dtype=torch.uint8,
                          device=cache.device)  # fmt: skip
        k = torch.randn(bs, h, d, generator=g, device=cache.device).to(torch.bfloat16)
        v = torch.randn(bs, h, d, generator=g, device=cache.device).to(torch.bfloat16)
        slots = torch.arange(bs, device=cache.device) + bs
        sinks = None
        if pa.sink_tokens:
            from kvzip_kernels.sinks import plan_step, sink_plan

            fresh, rows = sink_plan([0, bs], [bs], pa.sink_tokens)
            first = torch.tensor([1], device=cache.device)
            sinks = plan_step(pa.new_pool(one), first, fresh, rows)
        pa.write(k, v, one, slots, layer=0, sinks=sinks)
        return one[1].clone()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, FillMetadata) or not meta.fills:
            return
        ids = [b for blocks in meta.fills for b in blocks]
        if not ids:
            return
        for name, cache in self._caches.items():
            t = self._template.get(name)
            if t is None:
                t = self._template[name] = self._make_template(cache)
            idx = torch.tensor(ids, dtype=torch.long, device=cache.device)
            cache.index_copy_(0, idx, t.unsqueeze(0).expand(len(ids), *t.shape))
        global FILLED_BLOCKS
        FILLED_BLOCKS += len(ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return

    def wait_for_save(self):
        return
