"""The interface every KV-cache format implements, and the format registry.

A format turns K or V of one layer, ``[tokens, kv_heads, head_dim]``, into the bytes a paged
cache holds for each token and KV head (a fixed number per format: ``token_head_bytes``), and
back. Each row is ``code_bytes`` of codes followed by ``meta_bytes`` of metadata.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Literal

import torch

Kind = Literal["k", "v"]

#: Per-sequence extras are amortised over this many tokens (docs/protocol.md, "Bit accounting").
REFERENCE_SEQ_LEN = 131_072
#: The bit accounting (docs/protocol.md) is stated at Llama-3.1-8B's shape.
REFERENCE_HEAD_DIM = 128
REFERENCE_NUM_LAYERS = 32

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class FormatError(ValueError):
    """A format was used with input it does not support."""


def check_kv(x: torch.Tensor, *, name: str = "x") -> None:
    """Validate a K or V tensor ``[tokens, kv_heads, head_dim]`` of a float dtype."""
    if not isinstance(x, torch.Tensor):
        raise FormatError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise FormatError(
            f"{name} must have shape [tokens, kv_heads, head_dim], got {tuple(x.shape)}"
        )
    if x.dtype not in _FLOAT_DTYPES:
        raise FormatError(f"{name} has dtype {x.dtype}; supported: bfloat16, float16, float32")
    if x.shape[2] % 2 or x.shape[2] <= 0:
        raise FormatError(f"{name} head_dim must be a positive even number, got {x.shape[2]}")


def check_kind(kind: str) -> None:
    if kind not in ("k", "v"):
        raise FormatError(f"kind must be 'k' or 'v', got {kind!r}")


def check_packed(packed: torch.Tensor, row_bytes: int, *, name: str = "packed") -> None:
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        got = packed.dtype if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise FormatError(f"{name} must be a torch.uint8 tensor, got {got}")
    if packed.dim() != 3 or packed.shape[2] != row_bytes:
        raise FormatError(
            f"{name} must have shape [tokens, kv_heads, {row_bytes}] for this format and "
            f"head_dim, got {tuple(packed.shape)}"
        )


_DEVICE_COPIES: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a format's constant: rotation, codebook, calibrated transform) on ``device``,
    copied once per device and kept: the codecs run on whatever device their input is on."""
    if t.device == device:
        return t
    key = (id(t), str(device))
    hit = _DEVICE_COPIES.get(key)
    if hit is None or hit[0] is not t:  # the entry holds t, so its id cannot be reused
        hit = _DEVICE_COPIES[key] = (t, t.to(device))
    return hit[1]


class KVFormat(ABC):
    """A KV-cache format: a reference codec plus its exact byte accounting."""

    name: str = ""
    needs_calibration: bool = False

    # -- byte accounting --------------------------------------------------------------
    @abstractmethod
    def code_bytes(self, head_dim: int) -> int:
        """Bytes of codes per token per KV head (K or V)."""

    def meta_bytes(self, head_dim: int) -> int:
        """Bytes of metadata (scales, norms, zero points) per token per KV head."""
        return 0

    def token_head_bytes(self, head_dim: int) -> int:
        """Bytes the paged cache holds per token per KV head, for K or for V."""
        return self.code_bytes(head_dim) + self.meta_bytes(head_dim)

    def sequence_extra_bytes(self, head_dim: int, num_layers: int, num_kv_heads: int) -> int:
        """Per-sequence bytes beyond the per-token rows (e.g. bf16 sink tokens), K and V."""
        return 0

    def bits_per_element(
        self,
        head_dim: int = REFERENCE_HEAD_DIM,
        num_layers: int = REFERENCE_NUM_LAYERS,
        seq_len: int = REFERENCE_SEQ_LEN,
        num_kv_heads: int = 8,
    ) -> float:
        """Effective bits per KV element (docs/protocol.md, "Bit accounting").

        Every byte the cache holds for a token, plus per-sequence extras amortised over
        ``seq_len`` tokens; calibration tables are not counted.
        """
        per_token = self.token_head_bytes(head_dim) * 8 / head_dim
        extra = self.sequence_extra_bytes(head_dim, num_layers, num_kv_heads) * 8
        elements = seq_len * num_layers * num_kv_heads * head_dim * 2
        return per_token + extra / elements

    # -- codec ------------------------------------------------------------------------
    @abstractmethod
    def encode(self, x: torch.Tensor, *, kind: Kind, layer: int) -> torch.Tensor:
        """Float ``[tokens, kv_heads, head_dim]`` -> uint8 ``[tokens, kv_heads, row_bytes]``."""

    @abstractmethod
    def decode(
        self, packed: torch.Tensor, *, kind: Kind, layer: int, head_dim: int
    ) -> torch.Tensor:
        """Uint8 ``[tokens, kv_heads, row_bytes]`` -> float32 ``[tokens, kv_heads, head_dim]``."""

    #: Leading positions of every sequence that attention reads back exactly (bf16 copies
    #: kept beside the rows, e.g. the compact formats' sink token); 0 for most formats.
    sink_tokens: int = 0

    def roundtrip(self, x: torch.Tensor, *, kind: Kind, layer: int, start: int = 0) -> torch.Tensor:
        """What attention reads back for tokens at positions ``start .. start+tokens-1``:
        :meth:`roundtrip_rows`, with the first ``sink_tokens`` positions of the sequence
        read from their bf16 copies."""
        out = self.roundtrip_rows(x, kind=kind, layer=layer)
        n = max(0, min(self.sink_tokens - start, x.shape[0]))
        if n:
            out[:n] = x[:n].to(torch.bfloat16).to(out.dtype)
        return out

    def roundtrip_rows(self, x: torch.Tensor, *, kind: Kind, layer: int) -> torch.Tensor:
        """``decode(encode(x))`` cast to ``x.dtype``: every token row on its own, wherever it
        sits in the sequence (sink positions are :meth:`roundtrip`'s business). Callers may
        batch rows of many sequences into one call. Runs on ``x``'s device."""
        check_kv(x)
        packed = self.encode(x, kind=kind, layer=layer)
        return self.decode(packed, kind=kind, layer=layer, head_dim=x.shape[2]).to(x.dtype)

    def __repr__(self) -> str:
        return f"<KVFormat {self.name}>"


FormatFactory = Callable[..., KVFormat]
_REGISTRY: dict[str, FormatFactory] = {}


def register_format(name: str, factory: FormatFactory) -> None:
    """Register ``factory(calibration=None) -> KVFormat`` under ``name``."""
    if name in _REGISTRY:
        raise FormatError(f"format {name!r} is already registered")
    _REGISTRY[name] = factory


def list_formats() -> list[str]:
    """Registered format names, in registration order (baselines first)."""
    return list(_REGISTRY)


def get_format(name: str, calibration=None) -> KVFormat:
    """Instantiate a registered format; formats that need calibration take it here."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise FormatError(
            f"unknown format {name!r}; registered formats: {', '.join(_REGISTRY)}"
        ) from None
    return factory(calibration=calibration)
