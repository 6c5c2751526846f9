"""``int4`` (plain) and ``int4-rot`` (Hadamard-rotated) per-token-per-head asymmetric int4.

Row layout per token and KV head (``head_dim/2 + 4`` bytes; 4.25 bits at head_dim 128)::

    uint8 codes[head_dim/2]   # element 2i in the low nibble of byte i, 2i+1 in the high
    f16   scale               # little-endian
    f16   zero

Rounding (exact): ``zero = f16(min)``, ``scale = f16((max - min) / 15)``, then in float32 with
those fp16-rounded values ``code = clamp(round_half_even((x - zero) / scale), 0, 15)``
(``scale == 0`` gives code 0). Decode: ``code * scale + zero``.
``int4-rot`` applies the orthonormal Hadamard matrix ``H`` along head_dim first (as vLLM's
``int4_per_token_head``); decode multiplies by ``H`` again (``H @ H = I``).
"""

from __future__ import annotations

import torch

from kvzip_formats.base import (
    FormatError,
    KVFormat,
    check_kind,
    check_kv,
    check_packed,
    on_device,
)
from kvzip_formats.packing import bytes_to_f16, f16_to_bytes, pack_nibbles, unpack_nibbles
from kvzip_formats.rotation import hadamard

F16_MAX = 65504.0


def quantize_minmax(
    x: torch.Tensor, levels: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min-max quantisation along the last axis; returns (codes, scale16, zero16)."""
    x = x.float()
    lo = x.amin(-1, keepdim=True)
    hi = x.amax(-1, keepdim=True)
    zero = lo.to(torch.float16)
    scale = ((hi - lo) / (levels - 1)).to(torch.float16)
    s32, z32 = scale.float(), zero.float()
    safe = torch.where(s32 > 0, s32, torch.ones_like(s32))
    codes = torch.round((x - z32) / safe).clamp(0, levels - 1)
    codes = torch.where(s32 > 0, codes, torch.zeros_like(codes))
    return codes.to(torch.uint8), scale.squeeze(-1), zero.squeeze(-1)


class INT4(KVFormat):
    name = "int4"
    rotate = False

    def code_bytes(self, head_dim: int) -> int:
        return head_dim // 2

    def meta_bytes(self, head_dim: int) -> int:
        return 4

    def encode(self, x, *, kind, layer):
        check_kv(x)
        check_kind(kind)
        x = x.float()
        if not torch.isfinite(x).all() or x.abs().amax() > F16_MAX:
            raise FormatError(
                f"{self.name} encodes finite values within the float16 range (|x| <= 65504); "
                "got NaN, inf or a larger value"
            )
        if self.rotate:
            x = x @ on_device(hadamard(x.shape[-1]), x.device)
        codes, scale, zero = quantize_minmax(x, 16)
        return torch.cat((pack_nibbles(codes), f16_to_bytes(scale), f16_to_bytes(zero)), -1)

    def decode(self, packed, *, kind, layer, head_dim):
        check_kind(kind)
        check_packed(packed, self.token_head_bytes(head_dim))
        n = head_dim // 2
        codes = unpack_nibbles(packed[..., :n]).float()
        scale = bytes_to_f16(packed[..., n : n + 2]).float().unsqueeze(-1)
        zero = bytes_to_f16(packed[..., n + 2 : n + 4]).float().unsqueeze(-1)
        y = codes * scale + zero
        if self.rotate:
            y = y @ on_device(hadamard(head_dim), y.device)
        return y


class INT4Rot(INT4):
    name = "int4-rot"
    rotate = True
