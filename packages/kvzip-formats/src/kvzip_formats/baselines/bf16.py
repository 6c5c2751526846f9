"""``bf16``: the reference format; the bytes are the bf16 values themselves."""

from __future__ import annotations

import torch

from kvzip_formats.base import KVFormat, check_kind, check_kv, check_packed


class BF16(KVFormat):
    name = "bf16"

    def code_bytes(self, head_dim: int) -> int:
        return 2 * head_dim

    def encode(self, x, *, kind, layer):
        check_kv(x)
        check_kind(kind)
        t, h, d = x.shape
        return x.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(t, h, 2 * d)

    def decode(self, packed, *, kind, layer, head_dim):
        check_kind(kind)
        check_packed(packed, self.token_head_bytes(head_dim))
        t, h, _ = packed.shape
        return packed.contiguous().view(torch.bfloat16).reshape(t, h, head_dim).float()

    def roundtrip_rows(self, x, *, kind, layer):
        check_kv(x)
        return x.to(torch.bfloat16).to(x.dtype)
