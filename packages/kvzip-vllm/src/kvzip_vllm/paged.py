"""The backend's device compute on vLLM's paged cache, without vLLM (testable on its own).

One attention layer's cache, as vLLM hands it to the backend: uint8 ``[num_blocks,
num_kv_heads, block_size, tbh_k + tbh_v]`` (``tbh``: the format's bytes per token and KV head
for K and for V). vLLM only ever addresses whole blocks of it (allocation, prefix caching,
block copies), so the inside of a block is kvzip's: the K pages of every KV head, then their V
pages, each page in kvzip's paged layout (``kvzip_formats/spec/paged_layout.md``)::

    block b: K page (head 0) .. K page (head H-1) | V page (head 0) .. V page (head H-1)

so that ``pages()`` gives K and V as ``[num_blocks, num_kv_heads, page_bytes]`` views whose
only stride is the block's (``H * (page_bytes_k + page_bytes_v)``), the form kvzip-kernels
address with ``block_stride=``. (K page then V page per (block, head) would put a stride on
the head dimension too, which the kernels do not take.)

Formats with bf16 sink tokens (the compact formats; spec/4bit.md section 8) keep each
sequence's first positions in a side store per layer, one entry per block:
``[num_blocks + 1, sink_tokens, 2 (K, V), num_kv_heads, head_size]`` bf16, written for the
positions ``< sink_tokens`` of every block and read for a sequence's first block (the last
entry takes the writes of all other tokens, so the write needs no host sync).

Two paths, the same bytes and (within the kernels' earned tolerance) the same attention:

- reference (torch): the format's ``encode`` scattered into the pages, attention in float32
  over the format's ``decode`` of every cached token, sinks from the store; every query
  length (prefill chunks included);
- kernels (kvzip-kernels): ``cache_write`` and, for requests with one new token,
  ``paged_decode`` with ``block_stride=`` and ``sinks=``. They run wherever Triton runs: CUDA,
  and the CPU under ``TRITON_INTERPRET=1`` (the tests' CPU twin).

A format, head size or block size the kernels refuse (e.g. ``3bit`` at head size 64) is found
once per process by a probe call on well-formed inputs, which only their documented refusal
(``FormatError``) may fail; the reason is logged and that configuration takes the reference
path. Errors on real calls are never caught.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass

import torch

from kvzip_formats import FormatError
from kvzip_formats.ops import PagedLayout, gather_rows

logger = logging.getLogger("vllm.kvzip.paged")


def triton_runs(device: torch.device) -> bool:
    """Whether kvzip-kernels' Triton kernels run on ``device``: CUDA, or the CPU under the
    Triton interpreter (``TRITON_INTERPRET=1``, read by Triton at import)."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class Geometry:
    """What the kernels' support depends on (the probe's cache key)."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int


class PagedAttention:
    """One layer's cache write and attention over vLLM's cache in a kvzip format.

    ``kernels``: ``None`` uses kvzip-kernels wherever Triton runs (``triton_runs``),
    ``False`` never (vLLM on the CPU: the issue's reference path), ``True`` requires them.
    """

    def __init__(
        self,
        fmt,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        block_size: int,
        scale: float,
        kernels: bool | None = None,
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        self.fmt = fmt
        self.geometry = Geometry(num_heads, num_kv_heads, head_size, block_size)
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_size, self.block_size = head_size, block_size
        self.scale = float(scale)
        self.kernels = kernels
        self.layouts = {
            kind: PagedLayout.of(fmt, head_size, block_size, kind) for kind in ("k", "v")
        }
        # sink tokens: the first positions of every sequence in bf16 (spec/4bit.md section 8);
        # sink_tokens x heads x head_size x 2 x bf16 per block and layer (1 sink, 3 heads, d 64:
        # 768 bytes next to a 26,112-byte 4bit block of 128 tokens, +2.9%)
        self.sink_tokens = int(fmt.sink_tokens)
        self.sinks: torch.Tensor | None = None  # [num_blocks + 1, sink_tokens, 2, heads, d]

    # -- layout -----------------------------------------------------------------------
    @property
    def token_head_bytes(self) -> int:
        """The cache's last dimension: K's and V's bytes per token and KV head."""
        return sum(lay.token_head_bytes for lay in self.layouts.values())

    def new_cache(self, num_blocks: int, device="cpu") -> torch.Tensor:
        """A zeroed cache shaped as vLLM allocates it (for tests and benchmarks)."""
        g = self.geometry
        return torch.zeros(
            num_blocks,
            g.num_kv_heads,
            g.block_size,
            self.token_head_bytes,
            dtype=torch.uint8,
            device=device,
        )

    def pages(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V pages ``[num_blocks, num_kv_heads, page_bytes]``: views into ``kv_cache``
        (never copies) strided by the block only, ``stride(0)`` bytes per block."""
        nb, h = kv_cache.shape[0], self.num_kv_heads
        want = (h, self.block_size, self.token_head_bytes)
        if (
            kv_cache.dtype != torch.uint8
            or kv_cache.dim() != 4
            or tuple(kv_cache.shape[1:]) != want
        ):
            raise ValueError(
                f"kv_cache must be uint8 [num_blocks, {', '.join(map(str, want))}], got "
                f"{kv_cache.dtype} {tuple(kv_cache.shape)}"
            )
        kv_cache.view(nb, -1)  # raises rather than copies if a block is not contiguous
        # the block stride as the kernels check it (a one-block view would report another)
        stride = kv_cache.stride(0) if nb > 1 else h * self.block_size * self.token_head_bytes
        pk, pv = self.layouts["k"].page_bytes, self.layouts["v"].page_bytes
        base = kv_cache.storage_offset()
        return (
            kv_cache.as_strided((nb, h, pk), (stride, pk, 1), base),
            kv_cache.as_strided((nb, h, pv), (stride, pv, 1), base + h * pk),
        )

    # -- path choice ------------------------------------------------------------------
    def use_kernels(self, device: torch.device) -> bool:
        if self.kernels is False or not triton_runs(device):
            if self.kernels:
                raise RuntimeError(f"kernels=True but Triton does not run on {device}")
            return False
        why = _kernel_refusal(self.fmt, self.geometry, self.sink_tokens, str(device))
        if why and self.kernels:
            raise RuntimeError(f"kernels=True but kvzip-kernels refuse this layer: {why}")
        return why is None

    # -- cache write ------------------------------------------------------------------
    def write(self, key, value, kv_cache, slot_mapping, *, layer: int) -> None:
        """Write the new tokens' K and V ``[num_tokens, num_kv_heads, head_size]`` at
        ``slot_mapping`` ``[num_tokens]`` (``-1`` skips a token), and their sink copies."""
        if self.use_kernels(kv_cache.device):
            self.write_kernels(key, value, kv_cache, slot_mapping, layer=layer)
        else:
            self.write_reference(key, value, kv_cache, slot_mapping, layer=layer)

    def write_reference(self, key, value, kv_cache, slot_mapping, *, layer: int) -> None:
        n = slot_mapping.shape[0]
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].to(torch.int64)
        blk, off = slots // self.block_size, slots % self.block_size
        for kind, x, pages in zip("kv", (key, value), self.pages(kv_cache), strict=True):
            lay = self.layouts[kind]
            rows = self.fmt.encode(x[:n][keep], kind=kind, layer=layer)
            lay.codes_view(pages, kind)[blk, :, off] = rows[..., : lay.code_bytes]
            if lay.meta_bytes:
                lay.meta_view(pages)[blk, :, off] = rows[..., lay.code_bytes :]
        self._write_sinks(key[:n], value[:n], kv_cache, slot_mapping)

    def write_kernels(self, key, value, kv_cache, slot_mapping, *, layer: int) -> None:
        import kvzip_kernels

        n = slot_mapping.shape[0]
        for kind, x, pages in zip("kv", (key, value), self.pages(kv_cache), strict=True):
            kvzip_kernels.cache_write(
                self.fmt,
                x[:n],
                pages,
                slot_mapping,
                kind=kind,
                layer=layer,
                block_size=self.block_size,
                # vLLM's slots are valid; the range check reads them on the host (a sync)
                check_slots=False,
                block_stride=pages.stride(0),
            )
        self._write_sinks(key[:n], value[:n], kv_cache, slot_mapping)

    def _sink_store(self, kv_cache: torch.Tensor) -> torch.Tensor:
        nb = kv_cache.shape[0]
        if self.sinks is not None:
            if self.sinks.shape[0] != nb + 1 or self.sinks.device != kv_cache.device:
                raise ValueError(
                    f"kv_cache ({nb} blocks on {kv_cache.device}) is not the cache whose sink "
                    f"tokens this layer holds ({self.sinks.shape[0] - 1} blocks on "
                    f"{self.sinks.device})"
                )
        else:
            g = self.geometry
            self.sinks = torch.zeros(
                nb + 1,
                self.sink_tokens,
                2,
                g.num_kv_heads,
                g.head_size,
                dtype=torch.bfloat16,
                device=kv_cache.device,
            )
        return self.sinks

    def _write_sinks(self, k, v, kv_cache, slot_mapping) -> None:
        if not self.sink_tokens:
            return
        store = self._sink_store(kv_cache)
        s, nb = self.sink_tokens, kv_cache.shape[0]
        slots = slot_mapping.to(torch.int64)
        off = slots % self.block_size
        # positions >= sink_tokens of a block (and skipped tokens) go to the spare last entry:
        # no boolean mask, so no device-to-host sync per layer
        idx = torch.where((slots >= 0) & (off < s), slots // self.block_size * s + off, nb * s)
        flat = store.view(-1, 2, self.num_kv_heads, self.head_size)
        flat[idx, 0] = k.to(torch.bfloat16)
        flat[idx, 1] = v.to(torch.bfloat16)

    def sinks_of(self, kv_cache, block_table) -> tuple[torch.Tensor, torch.Tensor]:
        """The bf16 sink K and V ``[batch, sink_tokens, num_kv_heads, head_size]`` of the
        sequences of ``block_table`` (from their first block's entry)."""
        first = self._sink_store(kv_cache)[block_table[:, 0].to(torch.int64)]
        return first[:, :, 0], first[:, :, 1]

    # -- attention --------------------------------------------------------------------
    def attend(
        self,
        query,
        kv_cache,
        *,
        query_start_loc_cpu,
        seq_lens_cpu,
        seq_lens,
        block_table,
        layer: int,
        out,
    ) -> torch.Tensor:
        """Causal attention of the new tokens ``query`` ``[num_tokens, num_heads * head_size]``
        (or ``[num_tokens, num_heads, head_size]``) over the cache into ``out`` (same rows).
        Requests with one new token go to the decode kernel where it runs, the rest (prefill
        chunks) to the reference path."""
        qsl = query_start_loc_cpu.tolist()
        qlen = [qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)]
        lens = seq_lens_cpu.tolist()
        # the decode kernel attends every sink of the store: a sequence shorter than the sink
        # tokens takes the reference path (the shipped formats have one: never the case)
        one = [i for i, n in enumerate(qlen) if n == 1 and lens[i] >= self.sink_tokens]
        if one and self.use_kernels(kv_cache.device):
            if len(one) == len(qlen):  # a decode-only batch: no gather
                self.decode_kernels(
                    query[: len(one)],
                    kv_cache,
                    block_table=block_table,
                    seq_lens=seq_lens,
                    max_seq_len=int(seq_lens_cpu.max()),
                    layer=layer,
                    out=out[: len(one)],
                )
                return out
            rows = torch.tensor([qsl[i] for i in one], device=query.device)
            idx = torch.tensor(one, device=block_table.device)
            got = self.decode_kernels(
                query[rows],
                kv_cache,
                block_table=block_table[idx],
                seq_lens=seq_lens[idx],
                max_seq_len=int(seq_lens_cpu[one].max()),
                layer=layer,
            )
            out[rows] = got.reshape(len(one), *out.shape[1:]).to(out.dtype)
            rest = sorted(set(range(len(qlen))) - set(one))
        else:
            rest = range(len(qlen))
        self.attend_reference(
            query, kv_cache, qsl, seq_lens_cpu, block_table, layer=layer, out=out, requests=rest
        )
        return out

    def decode_kernels(
        self, query, kv_cache, *, block_table, seq_lens, max_seq_len: int, layer: int, out=None
    ) -> torch.Tensor:
        """kvzip-kernels' decode for one new token per sequence: ``query`` ``[batch, ...]``;
        returns ``[batch, num_heads, head_size]`` (``out``'s storage where it is bf16). Every
        sequence must hold at least ``sink_tokens`` tokens (``attend`` sees to it)."""
        import kvzip_kernels

        b, g = query.shape[0], self.geometry
        k_pages, v_pages = self.pages(kv_cache)
        target = None
        if out is not None and out.dtype == torch.bfloat16 and out.is_contiguous():
            target = out.view(b, g.num_heads, g.head_size)
        res = kvzip_kernels.paged_decode(
            self.fmt,
            query.reshape(b, g.num_heads, g.head_size).to(torch.bfloat16),
            k_pages,
            v_pages,
            block_table.to(torch.int32),
            seq_lens.to(torch.int32),
            block_size=g.block_size,
            layer=layer,
            sm_scale=self.scale,
            max_seq_len=max_seq_len,
            out=target,
            block_stride=k_pages.stride(0),
            sinks=self.sinks_of(kv_cache, block_table) if self.sink_tokens else None,
        )
        if out is not None and target is None:
            out.copy_(res.reshape(out.shape))
        return res

    def attend_reference(
        self, query, kv_cache, qsl, seq_lens_cpu, block_table, *, layer: int, out, requests=None
    ) -> torch.Tensor:
        """float32 attention over the format's decode of every cached token (sinks from the
        store), per request; ``qsl``: the query start offsets ``[batch + 1]`` (a list)."""
        g = self.geometry
        k_pages, v_pages = self.pages(kv_cache)
        rep = g.num_heads // g.num_kv_heads
        lens = seq_lens_cpu.tolist()
        for i in range(len(lens)) if requests is None else requests:
            qs, qe, seq_len = qsl[i], qsl[i + 1], lens[i]
            if qe == qs:
                continue
            k = self.gather(k_pages, kv_cache, block_table[i], seq_len, "k", layer)
            v = self.gather(v_pages, kv_cache, block_table[i], seq_len, "v", layer)
            q = query[qs:qe].reshape(qe - qs, g.num_heads, g.head_size).float()
            k = k.repeat_interleave(rep, dim=1)  # [n, hq, d]
            v = v.repeat_interleave(rep, dim=1)
            s = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            # query token t sits at position seq_len - (qe - qs) + t and sees keys <= it
            qpos = torch.arange(seq_len - (qe - qs), seq_len, device=s.device)
            kpos = torch.arange(seq_len, device=s.device)
            s.masked_fill_(kpos[None, None, :] > qpos[None, :, None], -math.inf)
            o = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)
            out[qs:qe].copy_(o.reshape(out[qs:qe].shape).to(out.dtype))
        return out

    def gather(self, pages, kv_cache, blocks, seq_len: int, kind: str, layer: int) -> torch.Tensor:
        """Decoded K or V of one sequence, float32 ``[seq_len, num_kv_heads, head_size]``."""
        rows = gather_rows(pages, self.layouts[kind], blocks, seq_len, kind)
        x = self.fmt.decode(rows, kind=kind, layer=layer, head_dim=self.head_size)
        n = min(self.sink_tokens, seq_len)
        if n:
            x[:n] = self._sink_store(kv_cache)[int(blocks[0]), :n, "kv".index(kind)].float()
        return x


@functools.cache
def _kernel_refusal(fmt, g: Geometry, sink_tokens: int, device: str) -> str | None:
    """Why kvzip-kernels refuse this configuration (None if they take it), found by one decode
    call on a one-block cache laid out as vLLM's: every input is well formed, so a
    ``FormatError`` can only be the kernels' documented refusal (a format without kernels,
    a head size, a row layout the decode kernel cannot read, sinks for a format without
    them). The decode checks everything the write checks. Logged once per process."""
    import kvzip_kernels

    p = PagedAttention(
        fmt,
        num_heads=g.num_heads,
        num_kv_heads=g.num_kv_heads,
        head_size=g.head_size,
        block_size=g.block_size,
        scale=1.0,
        kernels=False,
    )
    cache = p.new_cache(1, device)
    k_pages, v_pages = p.pages(cache)
    one = torch.ones(1, dtype=torch.int32, device=device)
    sink = torch.zeros(1, 1, g.num_kv_heads, g.head_size, dtype=torch.bfloat16, device=device)
    try:
        kvzip_kernels.paged_decode(
            fmt,
            torch.zeros(1, g.num_heads, g.head_size, dtype=torch.bfloat16, device=device),
            k_pages,
            v_pages,
            torch.zeros(1, 1, dtype=torch.int32, device=device),
            one,
            block_size=g.block_size,
            sm_scale=1.0,
            max_seq_len=1,
            block_stride=k_pages.stride(0),
            sinks=(sink, sink) if sink_tokens else None,
        )
    except FormatError as e:
        why = f"{type(e).__name__}: {e}"
        logger.warning(
            "kvzip: kvzip-kernels do not take format %s at %s (%s); this layer uses the torch "
            "reference path on %s (correct, slower)",
            getattr(fmt, "name", fmt),
            g,
            why,
            device,
        )
        return why
    return None
