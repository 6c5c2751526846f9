"""Test-only formats: an identity codec, a damaged one and a recorder of roundtrip calls."""

import torch

from kvzip_formats import KVFormat


class Identity(KVFormat):
    """Stores the bf16 bits of x as bytes: decode(encode(x)) == x for bf16 input."""

    name = "test-identity"

    def code_bytes(self, head_dim):
        return 2 * head_dim

    def encode(self, x, *, kind, layer):
        return x.to(torch.bfloat16).contiguous().view(torch.uint8)

    def decode(self, packed, *, kind, layer, head_dim):
        return packed.contiguous().view(torch.bfloat16).float()


class Damaged(Identity):
    """Keeps 1 bit of information per element (the sign) at the right scale: a broken codec."""

    name = "test-damaged"

    def decode(self, packed, *, kind, layer, head_dim):
        x = super().decode(packed, kind=kind, layer=layer, head_dim=head_dim)
        return torch.sign(x) * x.abs().mean(-1, keepdim=True)


class Recorder(Identity):
    """Identity that records (layer, kind, start, tokens) of every roundtrip; it overrides
    roundtrip, so the hook treats it as position-dependent and calls it row by row."""

    name = "test-recorder"

    def __init__(self):
        self.calls = []

    def roundtrip(self, x, *, kind, layer, start=0):
        self.calls.append((layer, kind, start, x.shape[0]))
        return x.clone()
