"""Run a transformers model with every attention layer reading K and V through a format.

``FormatCache`` is a ``DynamicCache`` whose ``update`` sends the new K and V of a layer through
``fmt.roundtrip`` before storing them, so attention reads exactly what a compressed paged
cache would give back: every token is encoded once when written (its position ``start`` is
its absolute position, so formats that keep sink tokens in bf16 see the right positions),
and the current token's own K/V are read back from the cache too. Prefill and decode take
the same path, which an attention-function hook (which sees the whole cache at every step)
would not give for free.

A ``Windowed`` format (``quality.window``) also keeps each layer's K and V as produced, for
the attention function that reads the last ``R`` of them in bf16.

Left-padded batches pass ``pad`` (left pads per row): cache index ``i`` of row ``b`` holds
absolute position ``i - pad[b]``; pad slots are masked out by attention and left as they are.

Formats that keep the base ``KVFormat.roundtrip`` (every token row on its own through
``roundtrip_rows``, the first ``sink_tokens`` positions of a sequence read from bf16 copies)
go through in one call per layer for the whole batch, the sink slots picked out of each row
by its pads; measured on batch-8 decode of SmolLM2 with int4, one call per row made
generation 1.9x slower than bf16. Formats with their own ``roundtrip`` take the per-row path.

``probes`` lets a reference run check, at no extra forward cost, whether a format is exact
on every K/V the model produced (``roundtrip(x) == x`` bit for bit); such a format would
produce a run identical to the reference, which the callers then reuse.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvzip_formats import KVFormat


def position_free(fmt) -> bool:
    """True when ``fmt.roundtrip`` is the base one: every token row on its own
    (``roundtrip_rows``), the first ``sink_tokens`` positions of a sequence read exactly."""
    from kvzip_eval.quality.window import Windowed

    inner = fmt.format if isinstance(fmt, Windowed) else fmt
    return type(inner).roundtrip is KVFormat.roundtrip


class FormatCache(DynamicCache):
    def __init__(
        self,
        config,
        fmt=None,
        *,
        pad: list[int] | None = None,
        probes: dict | None = None,
    ):
        super().__init__(config=config)
        from kvzip_eval.quality.window import Windowed

        #: a residual window (``Windowed``): the last ``recent`` tokens up to each query are
        #: read in bf16 from ``raw`` (by ``window.band_attention``), the rest through the format
        self.recent = fmt.recent if isinstance(fmt, Windowed) else 0
        self.fmt = fmt.format if isinstance(fmt, Windowed) else fmt
        #: per layer, K and V as the model produced them (kept only with a window)
        self.raw: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pad = list(pad) if pad is not None else None
        self.probes = dict(probes or {})
        #: names of the probes that were bit-exact on every K/V seen so far
        self.exact = set(self.probes)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        start = self.get_seq_length(layer_idx)
        if self.recent:
            k0, v0 = self.raw.get(layer_idx, (None, None))
            self.raw[layer_idx] = (
                key_states if k0 is None else torch.cat([k0, key_states], 2),
                value_states if v0 is None else torch.cat([v0, value_states], 2),
            )
        key_states = self._apply(key_states, "k", layer_idx, start)
        value_states = self._apply(value_states, "v", layer_idx, start)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _sinks(self, x: torch.Tensor, rt: torch.Tensor, n: int, start: int) -> torch.Tensor:
        """``rt`` with the cache slots holding absolute positions ``0..n-1`` taken from ``x``
        (bf16), as ``KVFormat.roundtrip`` reads them; x, rt ``[batch, kv_heads, T, d]``."""
        pads = self.pad if self.pad is not None else [0] * x.shape[0]
        if n <= 0 or start >= n + max(pads):  # no slot of this step is a sink position
            return rt
        pad = torch.tensor(pads, device=x.device)
        pos = start + torch.arange(x.shape[2], device=x.device)[None, :] - pad[:, None]
        sink = ((pos >= 0) & (pos < n))[:, None, :, None]
        return torch.where(sink, x.to(torch.bfloat16).to(rt.dtype), rt)

    def _apply(self, x: torch.Tensor, kind: str, layer: int, start: int) -> torch.Tensor:
        """x: ``[batch, kv_heads, T, head_dim]``, tokens at cache indices start..start+T-1."""
        if self.fmt is None and not self.exact:
            return x
        out = x
        B, H, T, D = x.shape
        flat = x.permute(0, 2, 1, 3).reshape(B * T, H, D)  # pad slots included: masked anyway
        for name in list(self.exact):
            probe = self.probes[name]
            # rows alone decide exactness: sink positions are exact in every format
            if position_free(probe) and not torch.equal(
                probe.roundtrip_rows(flat, kind=kind, layer=layer), flat
            ):
                self.exact.discard(name)
        if self.fmt is not None and position_free(self.fmt):
            rt = self.fmt.roundtrip_rows(flat, kind=kind, layer=layer)
            rt = rt.to(x.dtype).reshape(B, T, H, D).permute(0, 2, 1, 3)
            out = self._sinks(x, rt, self.fmt.sink_tokens, start)
        slow_probes = [n for n in self.exact if not position_free(self.probes[n])]
        slow_fmt = self.fmt is not None and not position_free(self.fmt)
        if not slow_probes and not slow_fmt:
            return out
        out = out.clone()
        for b in range(x.shape[0]):
            pos = start - (self.pad[b] if self.pad is not None else 0)
            skip = max(0, -pos)  # left-pad slots: masked, never read
            if skip >= x.shape[2]:
                continue
            real = x[b, :, skip:].transpose(0, 1)  # [T', kv_heads, head_dim], as formats take it
            for name in slow_probes:
                probe = self.probes[name].roundtrip(real, kind=kind, layer=layer, start=pos + skip)
                if not torch.equal(probe, real):
                    self.exact.discard(name)
            if slow_fmt:
                rt = self.fmt.roundtrip(real, kind=kind, layer=layer, start=pos + skip)
                out[b, :, skip:] = rt.transpose(0, 1).to(x.dtype)
        return out
