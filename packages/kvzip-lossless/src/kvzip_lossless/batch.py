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
- :func:`prepare_decode_batch` is :func:`decode_batch` split at its launches (host work and
  descriptor upload first, kernels at ``run()``), for a restore that copies the blobs in.
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

from kvzip_lossless._prepared import PreparedDecode
from kvzip_lossless.blob import HEAD, MAX_COLUMNS, CorruptBlobError, parse_header
from kvzip_lossless.codec import _check_input, compress, decode_u16
from kvzip_lossless.tables import TableSet
from kvzip_lossless.tiles import ROWS_PER_TILE, resolve_table, table_for

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
    tensors = list(tensors)
    if not isinstance(tables, TableSet):
        raise TypeError(
            f"tables must be a kvzip_lossless.TableSet, got {type(tables).__name__} (the batched "
            "API codes with a table set: fit one with build_kv_tables, on the GPU for CUDA KV)"
        )
    slots = [int(s) for s in slots]
    if len(slots) != len(tensors):
        raise ValueError(f"{len(tensors)} tensors but {len(slots)} slots: give one slot per tensor")
    if not 1 <= rows_per_tile < 1 << 31:
        raise ValueError(f"rows_per_tile must be a positive int32, got {rows_per_tile}")
    if not tensors:
        return EncodedBatch(
            torch.zeros(0, dtype=torch.uint8), np.zeros(0, np.int64), np.zeros(0, np.int64),
            np.zeros((0, PLAN_WIDTH), np.int64),
        )  # fmt: skip
    dev = tensors[0].device
    for i, (x, s) in enumerate(zip(tensors, slots, strict=True)):
        _check_input(x)
        if x.device != dev:
            raise ValueError(f"tensor {i} is on {x.device}, tensor 0 on {dev}: one device a batch")
        resolve_table(tables, s, tuple(x.shape), x.numel())  # slot and shape checks
    if dev.type == "cuda":
        from kvzip_lossless import gpu

        if gpu.available():
            from kvzip_lossless import gpu_batch

            data, offsets, lengths, plans = gpu_batch.encode_batch(
                tensors, tables, slots, rows_per_tile
            )
            return EncodedBatch(data, offsets, lengths, plans)
    blobs = [
        compress(x, tables=tables, slot=s, rows_per_tile=rows_per_tile)
        for x, s in zip(tensors, slots, strict=True)
    ]
    lengths = np.array([len(b) for b in blobs], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    data = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8)
    return EncodedBatch(data.to(dev), offsets, lengths, plan_blobs(blobs))


def plan_blobs(blobs: Sequence) -> np.ndarray:
    """Plans (int64 ``[n, PLAN_WIDTH]``) of blobs held on the host (bytes-like), from their
    headers (numpy over all of them). CorruptBlobError for a damaged header; ValueError for a
    blob that embeds its table (not batched: use :func:`kvzip_lossless.decompress`)."""
    rows = []
    for i, b in enumerate(blobs):
        buf = memoryview(b).cast("B")
        h = parse_header(buf)
        if h.embedded is not None:
            raise ValueError(
                f"blob {i} embeds its own table: not batched (decode it with "
                "kvzip_lossless.decompress, or code with a table set)"
            )
        slot = -1 if h.table_id == 0 else h.table_slot
        dir_off = HEAD.size + 8 * len(h.shape)
        rows.append(
            (len(buf), h.numel, h.columns, h.rows_per_tile, h.n_tiles, dir_off, h.tiles_start,
             slot, _signed(h.table_id))
        )  # fmt: skip
    return np.array(rows, np.int64).reshape(-1, PLAN_WIDTH)


def decode_batch(
    data: torch.Tensor,
    offsets,
    plans: np.ndarray,
    *,
    tables: TableSet | Sequence[TableSet] | None,
    out: torch.Tensor | None = None,
    out_offsets=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode blobs from one buffer into one output buffer; returns ``(out, bad)``: the same
    as ``prepare_decode_batch(...).run()`` (:func:`prepare_decode_batch`).

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
    return prepare_decode_batch(
        data, offsets, plans, tables=tables, out=out, out_offsets=out_offsets
    ).run()


def prepare_copies_nothing(device) -> bool:
    """True when :func:`prepare_decode_batch` for ``device`` queues no host-to-device copy:
    the CUDA C decoder reads its descriptors from page-locked host memory (unified
    addressing). A restore then queues its bulk copies first and prepares while they run;
    otherwise (Triton, which uploads them) it prepares first, ahead of the bulk copies."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    from kvzip_lossless import gpu

    if not gpu.available():
        return False
    from kvzip_lossless import gpu_batch

    return gpu_batch.descriptors_in_host_memory(device)


def prepare_decode_batch(
    data: torch.Tensor,
    offsets,
    plans: np.ndarray,
    *,
    tables: TableSet | Sequence[TableSet] | None,
    out: torch.Tensor | None = None,
    out_offsets=None,
) -> PreparedDecode:
    """:func:`decode_batch` in two steps: every check, the host work and the descriptors'
    host-to-device copy now; the kernels at :meth:`PreparedDecode.run`, when ``data`` holds
    the blobs (its contents are not read before).

    For a restore that copies the blobs into ``data`` itself: prepare every group of blobs
    first, on the stream that will copy, then queue the bulk copies, then run each group on
    another stream as its copy lands. The descriptors' copies are then queued ahead of the
    bulk copies: a descriptor copy queued behind them waits for them all on the copy engine
    and puts the whole decode after the whole copy.
    """
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError("data must be a 1-D uint8 tensor holding the blobs")
    if not data.is_contiguous() or data.data_ptr() % ALIGN:
        raise ValueError(f"data must be contiguous and start at an address multiple of {ALIGN}")
    plans = np.asarray(plans)
    if plans.ndim != 2 or plans.shape[1] != PLAN_WIDTH:
        raise ValueError(f"plans must be int64 [n, {PLAN_WIDTH}] (PLAN_FIELDS), got {plans.shape}")
    plans = plans.astype(np.int64)
    n = len(plans)
    offsets = np.asarray(offsets, np.int64).reshape(-1)
    if offsets.shape != (n,):
        raise ValueError(f"{n} plans but {offsets.size} offsets: give one offset per blob")
    check_plans(plans)
    length, numel = plans[:, 0], plans[:, 1]
    if n and ((offsets % ALIGN).any() or (offsets < 0).any()):
        raise ValueError(f"blob offsets must be non-negative multiples of {ALIGN}")
    if n and (offsets + length > data.numel()).any():
        i = int(np.flatnonzero(offsets + length > data.numel())[0])
        raise ValueError(
            f"blob {i} ([{offsets[i]}, {offsets[i] + length[i]})) lies outside data "
            f"({data.numel()} bytes)"
        )
    sets = [] if tables is None else [tables] if isinstance(tables, TableSet) else list(tables)
    for ts in sets:
        if not isinstance(ts, TableSet):
            raise TypeError(f"tables must be TableSet(s), got {type(ts).__name__}")
    set_idx = _set_index(plans, sets)
    if out_offsets is None:
        out_offsets = np.concatenate([[0], np.cumsum(numel)[:-1]]).astype(np.int64)
    out_offsets = np.asarray(out_offsets, np.int64).reshape(-1)
    if out_offsets.shape != (n,):
        raise ValueError(f"{n} plans but {out_offsets.size} out_offsets")
    need = int((out_offsets + numel).max()) if n else 0
    if out is None:
        out = torch.empty(need, dtype=torch.bfloat16, device=data.device)
    if (
        not isinstance(out, torch.Tensor)
        or out.dtype != torch.bfloat16
        or not out.is_contiguous()
        or out.device != data.device
    ):
        raise ValueError(f"out must be a contiguous bfloat16 tensor on {data.device}")
    if (out_offsets < 0).any() or need > out.numel():
        raise ValueError(f"out holds {out.numel()} values; the blobs need {need} at out_offsets")
    if data.device.type == "cuda":
        from kvzip_lossless import gpu

        if gpu.available():
            from kvzip_lossless import gpu_batch

            return gpu_batch.prepare_decode(data, offsets, plans, sets, set_idx, out, out_offsets)
    return PreparedDecode(
        out, lambda: _decode_cpu(data, offsets, plans, sets, set_idx, out, out_offsets)[1]
    )


def check_batch(bad: torch.Tensor) -> None:
    """Raise :class:`~kvzip_lossless.CorruptBlobError` naming the damaged blobs if any flag
    of ``bad`` (from :func:`decode_batch`) is set (one device-to-host read)."""
    idx = torch.nonzero(bad.cpu()).view(-1).tolist()
    if idx:
        raise CorruptBlobError(f"batched decode: blob(s) {idx[:8]} damaged ({len(idx)} in all)")


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def check_plans(plans: np.ndarray) -> None:
    """ValueError unless every plan row is self-consistent (numpy over all rows)."""
    length, numel, C, rpt, nt, dir_off, ts, slot, tid = plans.T
    ndim = (dir_off - 40) // 8
    c1 = np.maximum(C, 1)
    rows = numel // c1
    ok = (
        (length % 4 == 0) & (numel >= 0) & (numel < 1 << 40) & (C >= 1) & (C <= MAX_COLUMNS)
        & (rpt >= 1) & (rpt < 1 << 31) & (numel % c1 == 0) & (nt == -(-rows // np.maximum(rpt, 1)))
        & ((dir_off - 40) % 8 == 0) & (ndim >= 0) & (ndim <= 8) & (ts == dir_off + 16 * nt + 4)
        & (length >= ts) & (slot >= -1) & ((slot >= 0) | (tid == 0))
    )  # fmt: skip
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        raise ValueError(
            f"plan {i} is malformed ({dict(zip(PLAN_FIELDS, plans[i].tolist(), strict=True))}); "
            "plans come from encode_batch or plan_blobs"
        )


def _set_index(plans: np.ndarray, sets: list[TableSet]) -> np.ndarray:
    """Index in ``sets`` of each blob's table set (-1: no table); ValueError when one is
    missing or lacks the slot / its columns."""
    slot, tid, cols = plans[:, 7], plans[:, 8], plans[:, 2]
    idx = np.full(len(plans), -1, np.int64)
    ids = {_signed(ts.table_id): k for k, ts in enumerate(sets)}
    for t in np.unique(tid[slot >= 0]).tolist():
        if t not in ids:
            raise ValueError(
                f"blobs name table set {t & ((1 << 64) - 1):016x}, which was not given "
                f"(given: {[f'{ts.table_id:016x}' for ts in sets]})"
            )
        m = (tid == t) & (slot >= 0)
        idx[m] = k = ids[t]
        ts = sets[k]
        have = np.array([tb.columns for tb in ts.tables] or [0], np.int64)  # per slot
        sm, cm = slot[m], cols[m]
        wrong = (sm >= len(ts)) | (have[np.minimum(sm, len(have) - 1)] != cm)
        if wrong.any():
            i = int(np.flatnonzero(wrong)[0])
            s_, c_ = int(sm[i]), int(cm[i])
            raise ValueError(
                f"table set {ts.table_id:016x} has no slot {s_} of {c_} columns ({len(ts)} slots)"
            )
    return idx


def _decode_cpu(data, offsets, plans, sets, set_idx, out, out_offsets):
    """The CPU path: each blob by the CPU coder, its header compared with its plan."""
    host = data.cpu().numpy() if data.device.type != "cpu" else data.numpy()
    bad = np.zeros(len(plans), np.int32)
    o16 = out.view(-1).view(torch.int16)
    for i, p in enumerate(plans):
        a, ln = int(offsets[i]), int(p[0])
        buf = memoryview(host[a : a + ln])
        try:
            if (plan_blobs([buf])[0] != p).any():
                raise CorruptBlobError("header does not match its plan")
            h = parse_header(buf)
            table = table_for(h, sets[set_idx[i]] if set_idx[i] >= 0 else None)
            vals = decode_u16(buf, h, table)
        except CorruptBlobError:
            bad[i] = 1
            continue
        o16[int(out_offsets[i]) : int(out_offsets[i]) + vals.size] = torch.from_numpy(
            vals.view(np.int16)
        ).to(out.device)
    return out, torch.from_numpy(bad).to(data.device)
