"""``fp8``: float8 e4m3 with one per-tensor scale, as vLLM's default fp8 KV cache.

vLLM's default (no calibrated scales) uses ``k_scale = v_scale = 1.0``; values beyond the
e4m3 range (+-448) saturate, as vLLM's cache-write kernels do.
"""

from __future__ import annotations

import torch

from kvzip_formats.base import FormatError, KVFormat, check_kind, check_kv, check_packed

E4M3_MAX = 448.0


class FP8(KVFormat):
    name = "fp8"

    def __init__(self, k_scale: float = 1.0, v_scale: float = 1.0):
        if not (k_scale > 0 and v_scale > 0):
            raise FormatError(f"fp8 scales must be positive, got k={k_scale}, v={v_scale}")
        self.scales = {"k": float(k_scale), "v": float(v_scale)}

    def code_bytes(self, head_dim: int) -> int:
        return head_dim

    def encode(self, x, *, kind, layer):
        check_kv(x)
        check_kind(kind)
        y = (x.float() / self.scales[kind]).clamp(-E4M3_MAX, E4M3_MAX)
        return y.to(torch.float8_e4m3fn).view(torch.uint8)

    def decode(self, packed, *, kind, layer, head_dim):
        check_kind(kind)
        check_packed(packed, self.token_head_bytes(head_dim))
        return packed.view(torch.float8_e4m3fn).float() * self.scales[kind]
