"""compress / decompress: validation and dispatch to the CPU or GPU coder; the CPU encode and
decode of a blob's tiles (tables, tiling and blob assembly: ``tiles.py``)."""

from __future__ import annotations

import math

import numpy as np
import torch

from kvzip_lossless import _cpu, _cpu_fast, settings
from kvzip_lossless._torch import as_u16
from kvzip_lossless.blob import (
    MODE_RANS,
    MODE_RAW,
    CorruptBlobError,
    Header,
    pad4,
    parse_header,
    tile_layout,
)
from kvzip_lossless.checksum import tile_checksums
from kvzip_lossless.tables import Table, TableSet

# Re-exported: kvzip-vllm reads a blob's table with ``codec.table_for``.
from kvzip_lossless.tiles import (  # noqa: F401
    ROWS_PER_TILE,
    assemble,
    plan_tiles,
    prepare_table,
    resolve_table,
    table_for,
)


def coder(device="cpu") -> str:
    """Which coder :func:`compress` / :func:`decompress` run for tensors on ``device``:
    ``"cuda"`` (the CUDA C coder, built for that GPU), ``"triton"``, or on the CPU ``"numba"``
    (the compiled coder) or ``"numpy"`` (the reference; where numba does not import, or with
    ``KVZIP_LOSSLESS_CPU_CODER=numpy``).
    On CUDA the choice is logged (logger ``kvzip_lossless``) with its reason."""
    dev = torch.device(device)
    if dev.type == "cuda":
        from kvzip_lossless import gpu

        if gpu.available():
            return gpu.default_backend(dev)
    return _cpu_coder(None)


def _check_input(x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor of dtype bfloat16, got {type(x).__name__}")
    if x.dtype != torch.bfloat16:
        raise ValueError(
            f"x must be bfloat16, got {x.dtype} with shape {tuple(x.shape)}; "
            "kvzip-lossless codes the bf16 KV cache only"
        )
    if x.dim() > 8:
        raise ValueError(
            f"x has {x.dim()} dimensions (shape {tuple(x.shape)}); at most 8 supported"
        )


def compress(
    x: torch.Tensor,
    *,
    tables: TableSet | None = None,
    slot: int | None = None,
    rows_per_tile: int = ROWS_PER_TILE,
) -> bytes:
    """Compress a bf16 tensor of any shape (CPU or CUDA) into a self-describing blob.

    With ``tables`` (a per-model :class:`TableSet`) and ``slot`` (``kv_slot(layer, kind)``) the
    blob references the set by id; without, it fits and embeds its own table (one context per
    column, no previous-row context). CUDA tensors are coded on the GPU (same bytes).
    """
    _check_input(x)
    shape = tuple(int(s) for s in x.shape)
    numel = math.prod(shape)
    table = resolve_table(tables, slot, shape, numel)
    if x.is_cuda and numel:
        from kvzip_lossless import gpu

        if gpu.available():
            return gpu.compress(x, tables=tables, slot=slot, rows_per_tile=rows_per_tile)
    vals = as_u16(x)
    return compress_u16(vals, shape, table, tables, slot, rows_per_tile)


CPU_CODERS = settings.CPU_CODER.choices  # ("numba", "numpy")


def _cpu_coder(name: str | None) -> str:
    """The CPU coder to run: ``name``, else ``KVZIP_LOSSLESS_CPU_CODER``, else numba when it
    imports (the numpy coder is the reference, and the fallback)."""
    name = settings.CPU_CODER.value(name)
    if name is None:
        return "numba" if _cpu_fast.available() else "numpy"
    if name not in CPU_CODERS:
        raise ValueError(f"CPU coder {name!r}: supported are {', '.join(CPU_CODERS)}")
    if name == "numba" and not _cpu_fast.available():
        raise RuntimeError("the numba CPU coder was asked for, but numba does not import")
    return name


def compress_u16(
    vals, shape, table, tables, slot, rows_per_tile=ROWS_PER_TILE, cpu: str | None = None
) -> bytes:
    """A blob from the bit patterns ``vals`` (flat uint16) on the CPU coder ``cpu`` (None:
    the default, :func:`coder`)."""
    if not 1 <= rows_per_tile < 1 << 31:
        raise ValueError(f"rows_per_tile must be a positive int32, got {rows_per_tile}")
    table, cols, table_id, slot_, embedded = prepare_table(vals, shape, table, tables, slot)
    if _cpu_coder(cpu) == "numba":
        parts = _cpu_fast.encode_parts(vals, table, cols, rows_per_tile)
    else:
        parts = _encode_parts_numpy(vals, table, cols, rows_per_tile)
    return assemble(shape, cols, rows_per_tile, table_id, slot_, embedded, parts)


def _encode_parts_numpy(vals, table, cols, rows_per_tile) -> list[dict]:
    rows = vals.size // cols
    parts = []
    for t0, nt, nr in plan_tiles(rows, rows_per_tile):
        tv = vals[t0 * rows_per_tile * cols :][: nt * nr * cols].reshape(nt, nr, cols)
        enc = _cpu.encode_tiles(tv, table)
        offs = np.concatenate([[0], np.cumsum(enc["counts"].sum(1, dtype=np.int64))])
        for i in range(nt):
            parts.append(
                dict(
                    vals=tv[i].ravel(),
                    counts=enc["counts"][i],
                    states=enc["states"][i],
                    words=enc["words"][offs[i] : offs[i + 1]],
                    escapes=np.flatnonzero(enc["escapes"][i]),
                    mant=enc["mant"][i],
                    checksum=int(enc["checksum"][i]),
                )
            )
    return parts


def decode_u16(buf: memoryview, h: Header, table: Table, cpu: str | None = None) -> np.ndarray:
    """Decode every tile on the CPU coder ``cpu`` (None: the default) and verify each
    checksum; returns the values (uint16)."""
    if _cpu_coder(cpu) == "numba":
        out = _cpu_fast.decode_u16(buf, h, table)
        if out is not None:
            return out
        # else a table too large for the compiled decoder's packed entries: numpy below
    cols = h.columns
    out = np.empty(h.numel, np.uint16)
    offs = h.offsets()
    arr = np.frombuffer(buf, np.uint8)
    for t0, nt, nr in plan_tiles(h.rows, h.rows_per_tile):
        nv = nr * cols
        rans = [t0 + i for i in range(nt) if h.modes[t0 + i] == MODE_RANS]
        for ti in range(t0, t0 + nt):
            if h.modes[ti] == MODE_RAW:
                if h.lengths[ti] != pad4(2 * nv):
                    raise CorruptBlobError(
                        f"raw tile {ti}: length {h.lengths[ti]} != {pad4(2 * nv)}"
                    )
                out[ti * h.rows_per_tile * cols :][:nv] = arr[offs[ti] : offs[ti] + 2 * nv].view(
                    "<u2"
                )
        if rans:
            _decode_rans_tiles(arr, h, table, rans, offs, nr, out)
    for t0, nt, nr in plan_tiles(h.rows, h.rows_per_tile):
        seg = out[t0 * h.rows_per_tile * cols : (t0 + nt) * h.rows_per_tile * cols]
        got = tile_checksums(seg[: nt * nr * cols].reshape(nt, nr * cols))
        bad = np.flatnonzero(got != h.checksums[t0 : t0 + nt])
        if bad.size:
            raise CorruptBlobError(f"tile {t0 + int(bad[0])} checksum mismatch: damaged blob")
    return out


def _decode_rans_tiles(arr, h: Header, table: Table, tiles, offs, nr, out) -> None:
    cols = h.columns
    nch = -(-cols // 32)
    nv = nr * cols
    states, counts, mants, exc, words, starts = [], [], [], [], [], []
    wpos = 0
    for ti in tiles:
        o, ne = int(offs[ti]), int(h.n_exc[ti])
        lay = tile_layout(nv, cols, ne)
        c = arr[o : o + 4 * nch].view("<u4").astype(np.int64)
        nw = int(c.sum())
        if pad4(lay["words"] + 2 * nw) != h.lengths[ti]:
            raise CorruptBlobError(f"tile {ti}: word counts do not match its length")
        counts.append(c)
        states.append(arr[o + lay["states"] : o + lay["exc_idx"]].view("<u4"))
        idx = arr[o + lay["exc_idx"] : o + lay["exc_val"]].view("<u4").astype(np.int64)
        if ne and (idx.max() >= nv or (np.diff(idx) <= 0).any()):
            raise CorruptBlobError(f"tile {ti}: escape positions out of range or unsorted")
        exc.append((idx, arr[o + lay["exc_val"] : o + lay["mant"]].view("<u2")))
        mants.append(arr[o + lay["mant"] : o + lay["mant"] + (7 * nv + 7) // 8])
        words.append(arr[o + lay["words"] : o + lay["words"] + 2 * nw].view("<u2"))
        starts.append(wpos + np.concatenate([[0], np.cumsum(c)[:-1]]))
        wpos += nw
    try:
        vals = _cpu.decode_tiles(
            np.stack(states),
            np.stack(counts),
            np.concatenate(words),
            np.stack(starts),
            np.stack(mants),
            exc,
            nr,
            table,
        )
    except _cpu.DecodeError as e:
        raise CorruptBlobError(f"tiles {tiles[0]}..{tiles[-1]}: {e}") from None
    for i, ti in enumerate(tiles):
        out[ti * h.rows_per_tile * cols :][:nv] = vals[i].ravel()


def _as_buffer(blob) -> memoryview:
    if isinstance(blob, (bytes, bytearray, memoryview)):
        return memoryview(blob).cast("B")
    if isinstance(blob, np.ndarray) and blob.dtype == np.uint8:
        return memoryview(blob.ravel())
    raise TypeError(
        f"blob must be bytes, bytearray, memoryview or uint8 ndarray, got {type(blob).__name__}"
    )


def decompress(
    blob, *, tables: TableSet | None = None, device=None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Restore the exact tensor from a blob (bit for bit).

    Raises :class:`CorruptBlobError` for a truncated, damaged or mismatched blob (or one coded
    with another table set). On the CPU every tile is decoded to scratch and checksummed before
    anything is written to ``out``. ``device='cuda'`` (or a CUDA ``out``) decodes on the GPU,
    straight into ``out`` when given: there the checksums are verified after the write, and on
    error ``out``'s contents are unspecified (an error is always raised).
    """
    buf = _as_buffer(blob)
    h = parse_header(buf)
    table = table_for(h, tables)
    if out is not None:
        if (
            not isinstance(out, torch.Tensor)
            or out.dtype != torch.bfloat16
            or out.numel() != h.numel
            or not out.is_contiguous()
        ):
            desc = (
                f"{out.dtype} {tuple(out.shape)}"
                if isinstance(out, torch.Tensor)
                else type(out).__name__
            )
            raise ValueError(
                f"out must be a contiguous bfloat16 tensor of {h.numel} values "
                f"(blob shape {h.shape}), got {desc}"
            )
        device = out.device
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and h.numel:
        from kvzip_lossless import gpu

        if gpu.available():
            return gpu.decompress(buf, h, table, device=dev, out=out)
    vals = decode_u16(buf, h, table)
    res = torch.from_numpy(vals.view(np.int16)).view(torch.bfloat16).reshape(h.shape)
    if out is not None:
        out.view(-1).copy_(res.view(-1))
        return out
    return res.to(dev) if dev.type != "cpu" else res
