"""Batched encode and decode: many tensors in one call, one kernel launch per step.

This is the API a KV tier uses (spec/blob.md section 9). The blobs it writes and reads are
ordinary version-1 blobs (the same bytes as :func:`kvzip_lossless.compress` with the same
table set and ``rows_per_tile``); what is batched is the work:

- :func:`encode_batch` codes ``n`` bf16 tensors (e.g. every layer's K and V of a 256-token
  chunk) with a :class:`~kvzip_lossless.TableSet`: one encode launch for every tile of every
  tensor, one device-to-host read of the word counts (the only synchronisation of the call),
  then one assembly launch that writes every blob into ONE device buffer. It returns that
  buffer, each blob's offset and length, and each blob's *plan* (a row of
  :data:`PLAN_FIELDS`, int64): what a decode needs besides the bytes, so the caller stores
  the plan beside the blob and a decode does no header parsing on the host.
- :func:`decode_batch` decodes blobs that sit in ONE device buffer at given offsets (e.g.
  copied there from a page-locked arena in one host-to-device copy) into one output buffer:
  one launch checks every header (magic, fields against the plan, CRC-32), one launch decodes
  every tile of every blob (escapes, raw tiles and tile checksums included, in the kernel). It
  returns a per-blob damage flag on the device, without synchronising: read it back once.
- :func:`plan_blobs` computes the plans of blobs held on the host (e.g. made by
  :func:`kvzip_lossless.compress`), with numpy over their headers.

On the CPU the same functions run the CPU coder blob by blob (same bytes, same flags): a CPU
tensor in, a CPU buffer out. Blobs that embed their own table are not batched (their tables
differ per blob; :func:`kvzip_lossless.decompress` reads them): fit a table set on the GPU
instead (:func:`kvzip_lossless.build_kv_tables` counts on the device of its tensors).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvzip_lossless.tables import TableSet
from kvzip_lossless.tiles import ROWS_PER_TILE

#: Columns of a plan row (int64 each), spec/blob.md section 9.
PLAN_FIELDS = (
    "length",  # bytes of the blob (a multiple of 4)
    "numel",  # values the blob decodes to
    "columns",  # header field columns
    "rows_per_tile",  # header field rows_per_tile
    "n_tiles",  # header field n_tiles
    "dir_offset",  # byte offset of the tile directory (40 + 8 * ndim)
    "tiles_start",  # byte offset of tile 0
    "slot",  # table slot in the set, or -1 when every tile is raw (no table)
    "table_id",  # the set's table_id as a signed int64 (0 when no table)
)
PLAN_WIDTH = len(PLAN_FIELDS)
#: Blobs start at multiples of this many bytes in a batch buffer (the decoder reads 32-bit
#: states and 16-bit words at their natural alignment; blob lengths are multiples of 4).
ALIGN = 4


@dataclass
class EncodedBatch:
    """What :func:`encode_batch` returns.

    ``data``: uint8 tensor on the input's device, the blobs back to back (blob ``i`` is
    ``data[offsets[i] : offsets[i] + lengths[i]]``; offsets are multiples of :data:`ALIGN`;
    nothing between blobs). ``offsets``, ``lengths``: int64 numpy ``[n]``. ``plans``: int64
    numpy ``[n, PLAN_WIDTH]`` (:data:`PLAN_FIELDS`). The tensors' shapes are not in the plan
    (they are in each blob's header): the caller knows them.
    """

    data: torch.Tensor
    offsets: np.ndarray
    lengths: np.ndarray
    plans: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets)

    @property
    def nbytes(self) -> int:
        """Bytes of all blobs (``data.numel()``)."""
        return int(self.data.numel())

    def blob(self, i: int) -> bytes:
        """Blob ``i`` as host bytes (a device-to-host copy; for tests and single use)."""
        a = int(self.offsets[i])
        return bytes(self.data[a : a + int(self.lengths[i])].cpu().numpy().tobytes())


def encode_batch(
    tensors: Sequence[torch.Tensor],
    *,
    tables: TableSet,
    slots: Sequence[int],
    rows_per_tile: int = ROWS_PER_TILE,
) -> EncodedBatch:
    """Compress ``n`` bf16 tensors (all on one device; any strides) into one buffer.

    ``slots[i]``: the table of ``tables`` that codes ``tensors[i]``
    (``kv_slot(layer, "k" | "v")``). Blob ``i`` is byte for byte
    ``compress(tensors[i], tables=tables, slot=slots[i], rows_per_tile=rows_per_tile)``.
    On CUDA: one encode launch, one small device-to-host read (word counts and escape
    counts: the one synchronisation), one assembly launch. Raises ValueError / TypeError for
    bad input (not bf16, mixed devices, a slot outside the set, a shape the slot's table does
    not fit).
    """
    raise NotImplementedError("encode_batch: the signature is fixed; the body lands next")


def plan_blobs(blobs: Sequence) -> np.ndarray:
    """Plans (int64 ``[n, PLAN_WIDTH]``) of blobs held on the host (bytes-like), from their
    headers (numpy over all of them). CorruptBlobError for a damaged header; ValueError for a
    blob that embeds its table (not batched: use :func:`kvzip_lossless.decompress`)."""
    raise NotImplementedError("plan_blobs: the signature is fixed; the body lands next")


def decode_batch(
    data: torch.Tensor,
    offsets,
    plans: np.ndarray,
    *,
    tables: TableSet | Sequence[TableSet] | None,
    out: torch.Tensor | None = None,
    out_offsets=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode blobs from one buffer into one output buffer; returns ``(out, bad)``.

    ``data``: uint8 tensor (CUDA or CPU) holding blob ``i`` at byte ``offsets[i]`` (int64,
    multiples of :data:`ALIGN`), ``plans[i]`` its plan (from :func:`encode_batch` or
    :func:`plan_blobs`). ``tables``: the table set(s) the blobs name (picked per blob by
    ``table_id``; None only when every blob is all-raw). ``out``: a contiguous bf16 tensor on
    ``data``'s device receiving blob ``i``'s values at element ``out_offsets[i]`` (default:
    back to back, ``cumsum(numel)``); allocated (flat, ``sum(numel)`` values) when None.

    ``bad``: int32 ``[n]`` on ``data``'s device, nonzero where blob ``i`` is damaged (header,
    stream, escapes or tile checksum; its values in ``out`` are then unspecified). Nothing
    synchronises: read ``bad`` once (``bad.any().item()`` or ``bad.cpu()``). Host work is
    numpy over the ``n`` plans. Raises ValueError on the host for inputs that cannot be
    decoded at all (plans malformed, a table set missing for a ``table_id``, offsets not
    aligned or outside ``data``, ``out`` too small or not bf16).
    """
    raise NotImplementedError("decode_batch: the signature is fixed; the body lands next")


def check_batch(bad: torch.Tensor) -> None:
    """Raise :class:`~kvzip_lossless.CorruptBlobError` naming the damaged blobs if any flag
    of ``bad`` (from :func:`decode_batch`) is set (one device-to-host read)."""
    from kvzip_lossless.blob import CorruptBlobError

    idx = torch.nonzero(bad.cpu()).view(-1).tolist()
    if idx:
        raise CorruptBlobError(f"batched decode: blob(s) {idx[:8]} damaged ({len(idx)} in all)")
