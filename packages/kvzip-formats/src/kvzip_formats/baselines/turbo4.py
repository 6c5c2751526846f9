"""``turbo4``: TurboQuant-style MSE quantiser at 4 bits, from the paper's description.

Each vector ``x`` (one token, one KV head) is stored as its fp16 norm and 4-bit codes of the
unit vector after a fixed random rotation ``R``; each rotated coordinate of a random unit
vector is close to N(0, 1/d), so the codes index a Lloyd-Max codebook for that distribution.
Row: ``head_dim/2`` code bytes (nibbles as in ``int4``), then the fp16 norm (4.125 bits at
head_dim 128). Decode: ``norm * (codebook[codes] / sqrt(d)) @ R.T``.
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
from kvzip_formats.lloyd_max import gaussian_codebook
from kvzip_formats.packing import bytes_to_f16, f16_to_bytes, pack_nibbles, unpack_nibbles
from kvzip_formats.rotation import random_orthogonal

ROTATION_SEED = 0


class Turbo4(KVFormat):
    name = "turbo4"
    bits = 4

    def __init__(self):
        self.codebook = torch.tensor(gaussian_codebook(self.bits), dtype=torch.float32)

    def code_bytes(self, head_dim: int) -> int:
        return head_dim // 2

    def meta_bytes(self, head_dim: int) -> int:
        return 2

    def encode(self, x, *, kind, layer):
        check_kv(x)
        check_kind(kind)
        d = x.shape[-1]
        x = x.float()
        if not torch.isfinite(x).all():
            raise FormatError("turbo4 encodes finite values only; got NaN or inf")
        norm = x.norm(dim=-1, keepdim=True)
        unit = torch.where(norm > 0, x / norm.clamp_min(1e-30), torch.zeros_like(x))
        y = unit @ on_device(random_orthogonal(d, ROTATION_SEED), x.device) * d**0.5
        cb = on_device(self.codebook, x.device)
        edges = (cb[1:] + cb[:-1]) / 2
        codes = torch.bucketize(y, edges)
        return torch.cat((pack_nibbles(codes), f16_to_bytes(norm.squeeze(-1))), -1)

    def decode(self, packed, *, kind, layer, head_dim):
        check_kind(kind)
        check_packed(packed, self.token_head_bytes(head_dim))
        n = head_dim // 2
        codes = unpack_nibbles(packed[..., :n]).long()
        norm = bytes_to_f16(packed[..., n : n + 2]).float().unsqueeze(-1)
        unit = on_device(self.codebook, packed.device)[codes] / head_dim**0.5
        rot = on_device(random_orthogonal(head_dim, ROTATION_SEED), packed.device)
        return norm * (unit @ rot.T)
