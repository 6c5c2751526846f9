"""torch helpers shared by the GPU coders (``gpu.py``'s Triton and ``_cuda.py``'s CUDA C) and
the public layer: host views of tensors, a table's device copies, chunk descriptors, and the
torch-side mantissa packing and checksums (spec/blob.md sections 5-6)."""

from __future__ import annotations

import numpy as np
import torch

from kvzip_lossless.checksum import MASK, value_hashes
from kvzip_lossless.tables import Table

LANES = 32


def as_u16(x: torch.Tensor) -> np.ndarray:
    """A bf16 tensor's bit patterns as a flat uint16 numpy array (on the host)."""
    return x.detach().contiguous().cpu().view(torch.int16).numpy().view(np.uint16).ravel()


def table_tensors(table: Table, device):
    """The table's device copies ``(packed cum<<16|freq, bucket map, base)`` as int32, kept on
    the table itself (freed with it: a blob with an embedded table must not leave ~130 KB of
    GPU memory behind in a module-level cache)."""
    key = ("device", str(device))
    if key not in table._derived:
        table._derived[key] = (
            torch.from_numpy(table.packed().astype(np.int32)).to(device),
            torch.tensor(table.buckets, dtype=torch.int32, device=device),
            torch.from_numpy(table.base.astype(np.int32)).to(device),
        )
    return table._derived[key]


def cum_tensor(table: Table, device) -> torch.Tensor:
    """The table's cumulative frequencies on ``device`` (uint16 ``[columns, buckets, 32]`` as
    int16, kept on the table as :func:`table_tensors`): what the CUDA C decoders search."""
    key = ("device cum16", str(device))
    if key not in table._derived:
        cum = table.cum().astype(np.uint16).view(np.int16)
        table._derived[key] = torch.from_numpy(np.ascontiguousarray(cum)).to(device)
    return table._derived[key]


def encode_desc(rows: int, cols: int, rpt: int, device):
    """Encoder chunk descriptors int64 ``[tiles * chunks, 4]``: (first value of the tile, rows
    of the tile, first column of the chunk, first state of the tile); and (tiles, chunks)."""
    nch = -(-cols // LANES)
    n_tiles = -(-rows // rpt)
    ti = torch.arange(n_tiles, dtype=torch.int64)
    nr = torch.clamp(rows - ti * rpt, max=rpt)
    desc = torch.stack(
        [
            (ti * rpt * cols).repeat_interleave(nch),
            nr.repeat_interleave(nch),
            (torch.arange(nch) * LANES).repeat(n_tiles),
            (ti * cols).repeat_interleave(nch),
        ],
        1,
    )
    return desc.to(device).contiguous(), n_tiles, nch


def checksum(seg16: torch.Tensor) -> torch.Tensor:
    """One tile's checksum (spec section 6) of int16 values, as a signed int64 scalar tensor
    holding the int32 bit pattern (what the kernels' int32 sums hold)."""
    v = seg16.to(torch.int64)
    p = torch.arange(v.numel(), device=v.device, dtype=torch.int64)
    s = value_hashes(p, v).sum() & MASK
    return torch.where(s >= 1 << 31, s - (1 << 32), s)


def tile_checksums(v: torch.Tensor, rows: int, cols: int, rpt: int) -> torch.Tensor:
    """Checksums (int64, in [0, 2^32)) of each tile of values ``v`` (int, flat)."""
    sums = [
        checksum(v[t0 * cols : min(rows, t0 + rpt) * cols]) & MASK for t0 in range(0, rows, rpt)
    ]
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)


def pack_mantissas(v: torch.Tensor, rows: int, cols: int, rpt: int) -> list[torch.Tensor]:
    """Per tile, the 7-bit mantissa fields of values ``v`` (int, flat), MSB first (uint8)."""
    out = []
    for t0 in range(0, rows, rpt):
        seg = v[t0 * cols : min(rows, t0 + rpt) * cols] & 127
        n = seg.numel()
        g = torch.nn.functional.pad(seg.to(torch.int64), (0, (-n) % 8)).view(-1, 8)
        sh = torch.arange(7, -1, -1, device=v.device) * 7
        w = (g << sh).sum(1)
        bsh = torch.arange(6, -1, -1, device=v.device) * 8
        out.append(((w[:, None] >> bsh) & 255).to(torch.uint8).view(-1)[: (7 * n + 7) // 8])
    return out
