"""Row layout of the compact formats: code planes first, then the fp16 token scale.

A row holds the codes of one token and KV head (K or V) after the format's transform, in
transformed channel order ``0..head_dim-1``, split into groups of consecutive channels, each
with its own bit width ``b`` (1..8). A ``b``-bit code is split into bit planes of width 4, 2
and 1 (the binary digits of ``b``, widest first: 5 = 4+1, 3 = 2+1, 4 = 4, 2 = 2), the low
bits of the code in the widest plane. Planes are laid out widest first across groups (all
4-bit planes in group order, then all 2-bit planes, then all 1-bit planes), so that at
head_dim 128 every plane is a multiple of 8 bytes and the widest ones start 16-byte aligned.
Within a plane of width ``w``, channel ``i`` of the group sits in byte ``i*w // 8`` at bit
``(i*w) % 8`` (little-endian bit order, as ``int4``'s nibbles). See spec/4bit.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from kvzip_formats.base import FormatError

PLANE_WIDTHS = (4, 2, 1)
META_BYTES = 2  # one float16 token scale


@dataclass(frozen=True)
class Plane:
    group: int  # index into the group list
    start: int  # first transformed channel of the group
    size: int  # channels in the group
    width: int  # bits per channel in this plane (4, 2 or 1)
    shift: int  # which bits of the code: (code >> shift) & (2**width - 1)
    offset: int  # first byte of the plane in the row

    @property
    def nbytes(self) -> int:
        return self.size * self.width // 8


@dataclass(frozen=True)
class RowLayout:
    """Groups ``((channels, bits), ...)`` covering ``head_dim`` channels, in transformed order."""

    groups: tuple[tuple[int, int], ...]

    def __post_init__(self):
        for n, b in self.groups:
            if not 1 <= b <= 7 or n <= 0 or n % 8:
                raise FormatError(
                    f"group ({n} channels, {b} bits) needs 1..7 bits and channels a multiple of 8"
                )

    @property
    def head_dim(self) -> int:
        return sum(n for n, _ in self.groups)

    @cached_property
    def planes(self) -> tuple[Plane, ...]:
        starts, s = [], 0
        for n, _ in self.groups:
            starts.append(s)
            s += n
        planes, offset = [], 0
        for w in PLANE_WIDTHS:
            for g, (n, b) in enumerate(self.groups):
                if not b & w:
                    continue
                shift = _plane_shift(b, w)
                planes.append(Plane(g, starts[g], n, w, shift, offset))
                offset += n * w // 8
        return tuple(planes)

    @property
    def code_bytes(self) -> int:
        return sum(p.nbytes for p in self.planes)

    @property
    def row_bytes(self) -> int:
        return self.code_bytes + META_BYTES

    @property
    def bits(self) -> float:
        return self.code_bytes * 8 / self.head_dim

    def channel_bits(self) -> torch.Tensor:
        """``[head_dim]`` int64: the bit width of each transformed channel."""
        return torch.cat([torch.full((n,), b, dtype=torch.int64) for n, b in self.groups])

    # -- packing ----------------------------------------------------------------------
    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        """``[..., head_dim]`` integer codes -> ``[..., code_bytes]`` uint8."""
        c = codes.to(torch.int64)
        out = []
        for p in self.planes:
            v = (c[..., p.start : p.start + p.size] >> p.shift) & ((1 << p.width) - 1)
            per = 8 // p.width
            v = v.reshape(*v.shape[:-1], p.size // per, per)
            sh = torch.arange(per, dtype=torch.int64, device=c.device) * p.width
            out.append((v << sh).sum(-1).to(torch.uint8))
        return torch.cat(out, -1)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """``[..., code_bytes]`` uint8 -> ``[..., head_dim]`` int64 codes."""
        codes = torch.zeros(
            *packed.shape[:-1], self.head_dim, dtype=torch.int64, device=packed.device
        )
        for p in self.planes:
            per = 8 // p.width
            byt = packed[..., p.offset : p.offset + p.nbytes].to(torch.int64)
            sh = torch.arange(per, dtype=torch.int64, device=packed.device) * p.width
            v = ((byt.unsqueeze(-1) >> sh) & ((1 << p.width) - 1)).flatten(-2)
            codes[..., p.start : p.start + p.size] |= v << p.shift
        return codes


def _plane_shift(bits: int, width: int) -> int:
    """Bit position in the code of the plane of ``width``: wider planes hold lower bits."""
    return sum(w for w in PLANE_WIDTHS if w > width and bits & w)
