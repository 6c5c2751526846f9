"""The torch paths over a layer's paged cache (``paged.PagedAttention`` chooses them): the
reference write (the format's ``encode`` scattered into the pages) and attention (float32 over
the format's ``decode`` of every cached token, every query length), and the prefill workspace
(the chunk's sequences' cached pages decoded into one bf16 workspace, then a variable-length
attention kernel over it: vLLM's FlashAttention where the backend passes it, ``sdpa_varlen``
otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from kvzip_formats.ops import gather_rows
from kvzip_kernels._paged_cache import PATH_CALLS, PagedCache


def sdpa_varlen(q, k, v, cu_q: Sequence[int], cu_k: Sequence[int], scale: float, out) -> None:
    """Causal attention of packed sequences (``q`` ``[tokens, heads, d]``, ``k``/``v``
    ``[keys, kv_heads, d]``, host offsets ``cu_q``/``cu_k``), each sequence's queries being its
    last keys' positions (FlashAttention's bottom-right causal mask), by torch's
    ``scaled_dot_product_attention``; into ``out`` ``[tokens, heads, d]``."""
    rep = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if qe == qs:
            continue
        nq, nk = qe - qs, ke - ks
        mask = (
            torch.arange(nk, device=q.device)[None, :]
            <= torch.arange(nk - nq, nk, device=q.device)[:, None]
        )
        o = torch.nn.functional.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1),
            k[ks:ke].repeat_interleave(rep, 1).transpose(0, 1),
            v[ks:ke].repeat_interleave(rep, 1).transpose(0, 1),
            attn_mask=mask,
            scale=scale,
        )
        out[qs:qe] = o.transpose(0, 1).to(out.dtype)


#: ``varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, out)``: the prefill workspace's kernel
#: (cu_q/cu_k int32 device tensors, max_q/max_k ints)
VarlenAttention = Callable[..., None]


class TorchPaths(PagedCache):
    """The reference write and attention and the prefill workspace of ``paged.PagedAttention``
    (which sets ``scale`` and ``varlen``)."""

    scale: float
    varlen: VarlenAttention | None

    def write_reference(self, key, value, kv_cache, slot_mapping, *, layer: int, sinks=None):
        PATH_CALLS["write_reference"] += 1
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
        self.write_sinks(key, value, kv_cache, sinks)

    def workspace(
        self, kv_cache, block_table, lens, requests, *, layer: int, sinks=None, window=None,
        fresh=None,
    ):  # fmt: skip
        """The cached K and V of the sequences ``requests`` decoded into one packed bf16
        workspace ``[sum of their lengths, num_kv_heads, head_size]`` each (sinks in place),
        and the sequences' start offsets in it (a host list, ``len(requests) + 1``)."""
        g = self.geometry
        cu = [0]
        for i in requests:
            cu.append(cu[-1] + lens[i])
        out = []
        for kind, pages in zip("kv", self.pages(kv_cache), strict=True):
            rows = torch.cat(
                [
                    gather_rows(pages, self.layouts[kind], block_table[i], lens[i], kind)
                    for i in requests
                ]
            )
            x = self.fmt.decode(rows, kind=kind, layer=layer, head_dim=g.head_size)
            out.append(x.to(torch.bfloat16))
        if self.sink_tokens:
            idx = torch.tensor(list(requests), device=sinks.slots.device)
            sk, sv = self.sinks_of(kv_cache, sinks.select(idx), layer=layer)
            src = [
                (j, p)
                for j, i in enumerate(requests)
                for p in range(min(lens[i], self.sink_tokens))
            ]
            if src:
                dst = torch.tensor([cu[j] + p for j, p in src], device=out[0].device)
                j = torch.tensor([a for a, _ in src], device=sk.device)
                p = torch.tensor([b for _, b in src], device=sk.device)
                out[0][dst] = sk[j, p].to(out[0].device)
                out[1][dst] = sv[j, p].to(out[1].device)
        if window is not None:  # fresh: per request its new tokens' (k, v)
            PATH_CALLS["workspace_window"] += 1
            for j, i in enumerate(requests):
                self.place_window(out[0], out[1], kv_cache, window, i, *fresh[j], base=cu[j])
        return out[0], out[1], cu

    def attend_workspace(
        self, query, kv_cache, qsl, lens, block_table, *, layer: int, out, requests, sinks=None,
        window=None, key=None, value=None,
    ) -> torch.Tensor:  # fmt: skip
        """Prefill chunks: the sequences' pages decoded into a bf16 workspace, then one
        variable-length causal attention (``varlen``, or ``sdpa_varlen``) over it."""
        g = self.geometry
        reqs = [i for i in requests if qsl[i + 1] > qsl[i]]
        if not reqs:
            return out
        fresh = None
        if window is not None:
            fresh = [
                (self._fresh(key, slice(qsl[i], qsl[i + 1])),
                 self._fresh(value, slice(qsl[i], qsl[i + 1])))
                for i in reqs
            ]  # fmt: skip
        k, v, cu_k = self.workspace(
            kv_cache, block_table, lens, reqs, layer=layer, sinks=sinks, window=window,
            fresh=fresh,
        )  # fmt: skip
        rows = torch.cat([torch.arange(qsl[i], qsl[i + 1]) for i in reqs]).to(query.device)
        q = query[rows].reshape(-1, g.num_heads, g.head_size).to(torch.bfloat16)
        cu_q = [0]
        for i in reqs:
            cu_q.append(cu_q[-1] + qsl[i + 1] - qsl[i])
        o = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
        PATH_CALLS["prefill_workspace"] += 1
        PATH_CALLS[f"varlen:{getattr(self.varlen or sdpa_varlen, '__name__', 'varlen')}"] += 1
        if self.varlen is None:
            sdpa_varlen(q, k, v, cu_q, cu_k, self.scale, o)
        else:
            dev = q.device
            self.varlen(
                q,
                k,
                v,
                torch.tensor(cu_q, dtype=torch.int32, device=dev),
                torch.tensor(cu_k, dtype=torch.int32, device=dev),
                max(b - a for a, b in zip(cu_q, cu_q[1:], strict=False)),
                max(b - a for a, b in zip(cu_k, cu_k[1:], strict=False)),
                self.scale,
                o,
            )
        out[rows] = o.reshape(len(rows), *out.shape[1:]).to(out.dtype)
        return out

    def attend_reference(
        self,
        query,
        kv_cache,
        qsl,
        seq_lens_cpu,
        block_table,
        *,
        layer: int,
        out,
        requests=None,
        sinks=None,
        window=None,
        key=None,
        value=None,
    ) -> torch.Tensor:
        """float32 attention over the format's decode of every cached token (sinks from the
        pool; a residual window's tokens and the new ones in bf16), per request; ``qsl``: the
        query start offsets ``[batch + 1]`` (a list)."""
        PATH_CALLS["attend_reference"] += 1
        g = self.geometry
        k_pages, v_pages = self.pages(kv_cache)
        rep = g.num_heads // g.num_kv_heads
        lens = seq_lens_cpu.tolist()
        sk = sv = None
        if self.sink_tokens:
            sk, sv = self.sinks_of(kv_cache, sinks, layer=layer)
        for i in range(len(lens)) if requests is None else requests:
            qs, qe, seq_len = qsl[i], qsl[i + 1], lens[i]
            if qe == qs:
                continue
            k = self.gather(k_pages, block_table[i], seq_len, "k", layer, sk, i)
            v = self.gather(v_pages, block_table[i], seq_len, "v", layer, sv, i)
            if window is not None:
                rows = slice(qs, qe)
                self.place_window(
                    k, v, kv_cache, window, i, self._fresh(key, rows), self._fresh(value, rows)
                )
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

    def gather(self, pages, blocks, seq_len: int, kind: str, layer: int, sink=None, i=0):
        """Decoded K or V of one sequence, float32 ``[seq_len, num_kv_heads, head_size]``
        (its first positions from ``sink[i]``, the step's bf16 sinks, where given)."""
        rows = gather_rows(pages, self.layouts[kind], blocks, seq_len, kind)
        x = self.fmt.decode(rows, kind=kind, layer=layer, head_dim=self.head_size)
        n = min(self.sink_tokens, seq_len)
        if n and sink is not None:
            x[:n] = sink[i, :n].float().to(x.device)
        return x
