"""Probability tables for the bf16 KV codec: symbolisation, calibration, serialisation.

A value's top 9 bits (sign, exponent) become one of 32 symbols, coded with a table chosen by
its column (channel) and by a bucket of the previous row's symbol in the same column; the 7
mantissa bits are stored raw. Measured on SmolLM2-135M's KV (tables fitted on one 2,048-token
window, scored on another; /tmp scratch study, see README): sign+exponent with one table for
everything 3.77 bits (K) / 3.91 (V); one table per channel 3.22 / 3.54; per channel plus the
previous token's sign and exponent bucket 2.88 / 3.52. The mantissa's top bits, modelled,
would save only 0.04-0.09 bits and cost a larger alphabet, so they are stored raw.
"""

from __future__ import annotations

import hashlib
import lzma
import struct
from dataclasses import dataclass, field

import numpy as np

PROB_BITS = 12
PROB_SCALE = 1 << PROB_BITS
NSYM = 32
#: The per-column mode exponent lands on this exponent slot; slots 1..15 cover exponents
#: mode-11 .. mode+3 (measured escape rate 0.05% of K, 0.03% of V values); slot 0 = escape.
MODE_SLOT = 12

#: Bucket maps (previous symbol -> context bucket), chosen by held-out cross-entropy:
#: keys: sign x 4 exponent levels (2.88 bits vs 3.13 for exponent-only buckets);
BUCKETS_K = tuple(int(min(max(s % 16 - 9, 0), 3) + 4 * (s // 16)) for s in range(NSYM))
BUCKETS_NONE = (0,) * NSYM
#: For values the sign x 2-level context gains only 0.016 bits for 4x the table bytes: none.
BUCKETS_V = BUCKETS_NONE

_TABLE_MAGIC = b"KVZT"
_TABLESET_MAGIC = b"KVZS"
_TABLE_VERSION = 1
#: A table's fixed header: magic, version, n_buckets, columns (spec/blob.md section 4).
TABLE_HEAD = struct.Struct("<4sHHI")


def symbolize(vals: np.ndarray, base: np.ndarray) -> np.ndarray:
    """Symbols (uint8, 0..31) of bf16 bit patterns ``vals[..., C]`` for per-column ``base``."""
    v = vals.astype(np.int32)
    es = ((v >> 7) & 255) - base.astype(np.int32) + MODE_SLOT
    es = np.where((es >= 1) & (es <= 15), es, 0)
    return ((v >> 15) * 16 + es).astype(np.uint8)


def normalize_counts(counts: np.ndarray) -> np.ndarray:
    """Integer counts ``[..., 32]`` -> frequencies summing to 4096, each >= 1 (deterministic)."""
    c = counts.astype(np.int64)
    tot = c.sum(-1, keepdims=True)
    f = 1 + (c * (PROB_SCALE - NSYM)) // np.maximum(tot, 1)
    f = np.where(tot == 0, PROB_SCALE // NSYM, f)
    rest = PROB_SCALE - f.sum(-1)
    idx = np.argmax(c, axis=-1)
    np.put_along_axis(
        f, idx[..., None], np.take_along_axis(f, idx[..., None], -1) + rest[..., None], -1
    )
    return f.astype(np.uint16)


@dataclass(frozen=True, eq=False)
class Table:
    """Tables for one stream of ``[rows, columns]`` values (e.g. one layer's K).

    base: uint8 ``[columns]`` (mode exponent per column); buckets: 32 ints (previous symbol ->
    bucket); freq: uint16 ``[columns, n_buckets, 32]``, each row summing to 4096.
    """

    base: np.ndarray
    buckets: tuple[int, ...]
    freq: np.ndarray
    _derived: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def columns(self) -> int:
        return int(self.base.shape[0])

    @property
    def n_buckets(self) -> int:
        return int(self.freq.shape[1])

    def to_bytes(self) -> bytes:
        head = TABLE_HEAD.pack(_TABLE_MAGIC, _TABLE_VERSION, self.n_buckets, self.columns)
        return (
            head
            + bytes(self.buckets)
            + self.base.astype(np.uint8).tobytes()
            + self.freq.astype("<u2").tobytes()
        )

    @classmethod
    def from_bytes(cls, buf: bytes, pos: int = 0) -> tuple[Table, int]:
        if len(buf) - pos < TABLE_HEAD.size:
            raise ValueError("kvzip table truncated")
        magic, ver, nb, cols = TABLE_HEAD.unpack_from(buf, pos)
        if magic != _TABLE_MAGIC or ver != _TABLE_VERSION:
            raise ValueError(f"not a kvzip table (magic {magic!r}, version {ver})")
        pos += 12
        need = NSYM + cols + 2 * cols * nb * NSYM
        if nb < 1 or nb > NSYM or cols < 1 or len(buf) - pos < need:
            raise ValueError("kvzip table truncated or malformed")
        buckets = tuple(buf[pos : pos + NSYM])
        pos += NSYM
        base = np.frombuffer(buf, np.uint8, cols, pos).copy()
        pos += cols
        freq = (
            np.frombuffer(buf, "<u2", cols * nb * NSYM, pos)
            .reshape(cols, nb, NSYM)
            .astype(np.uint16)
        )
        pos += 2 * freq.size
        if (
            max(buckets) >= nb
            or (freq == 0).any()
            or (freq.astype(np.int64).sum(-1) != PROB_SCALE).any()
        ):
            raise ValueError("kvzip table malformed (bucket or frequency out of range)")
        return cls(base, buckets, freq), pos

    # Derived arrays used by the coders, computed once per table.
    def cum(self) -> np.ndarray:
        if "cum" not in self._derived:
            c = np.zeros(self.freq.shape, np.uint32)
            np.cumsum(self.freq[..., :-1], axis=-1, out=c[..., 1:])
            self._derived["cum"] = c.reshape(-1, NSYM)
        return self._derived["cum"]

    def lut(self) -> np.ndarray:
        """``[columns * n_buckets, 4096]`` slot -> symbol (uint8) for the CPU decoder."""
        if "lut" not in self._derived:
            f = self.freq.reshape(-1, NSYM)
            syms = np.tile(np.arange(NSYM, dtype=np.uint8), f.shape[0])
            self._derived["lut"] = np.repeat(syms, f.ravel().astype(np.int64)).reshape(
                -1, PROB_SCALE
            )
        return self._derived["lut"]

    def packed(self) -> np.ndarray:
        """``[columns * n_buckets, 32]`` uint32 ``cum << 16 | freq`` for the GPU coders."""
        if "packed" not in self._derived:
            f = self.freq.reshape(-1, NSYM).astype(np.uint32)
            self._derived["packed"] = (self.cum() << 16) | f
        return self._derived["packed"]

    def table_id(self) -> int:
        return int.from_bytes(hashlib.sha256(self.to_bytes()).digest()[:8], "little")


def fit_table(samples: list[np.ndarray], buckets=BUCKETS_NONE) -> Table:
    """Fit one table from bf16 bit patterns ``[rows, columns]`` (uint16), one or more samples."""
    if not samples:
        raise ValueError("fit_table needs at least one sample")
    cols = samples[0].shape[-1]
    for s in samples:
        if s.ndim != 2 or s.shape[1] != cols or s.dtype != np.uint16:
            raise ValueError(f"samples must be uint16 [rows, {cols}], got {s.dtype} {s.shape}")
    ecount = np.zeros((cols, 256), np.int64)
    for s in samples:
        e = ((s >> 7) & 255).astype(np.int64)
        ecount += np.bincount((np.arange(cols) * 256 + e).ravel(), minlength=cols * 256).reshape(
            cols, 256
        )
    base = np.argmax(ecount, axis=1).astype(np.uint8)
    bmap = np.asarray(buckets, np.int64)
    nb = int(bmap.max()) + 1
    counts = np.zeros((cols * nb, NSYM), np.int64)
    for s in samples:
        sym = symbolize(s, base).astype(np.int64)
        prev = np.concatenate([np.zeros_like(sym[:1]), sym[:-1]], axis=0)
        ctx = np.arange(cols)[None, :] * nb + bmap[prev]
        counts += np.bincount((ctx * NSYM + sym).ravel(), minlength=cols * nb * NSYM).reshape(
            -1, NSYM
        )
    return Table(
        base, tuple(int(b) for b in bmap), normalize_counts(counts).reshape(cols, nb, NSYM)
    )


class TableSet:
    """Per-model calibration: one :class:`Table` per slot (``slot = 2 * layer + (kind == "v")``).

    Its ``table_id`` (hash of its bytes) goes into every blob coded with it; decoding with
    another set raises :class:`~kvzip_lossless.CorruptBlobError`.
    """

    def __init__(self, tables: list[Table]):
        self.tables = list(tables)
        self._bytes = (
            _TABLESET_MAGIC
            + struct.pack("<I", len(self.tables))
            + b"".join(t.to_bytes() for t in self.tables)
        )
        self.table_id = int.from_bytes(hashlib.sha256(self._bytes).digest()[:8], "little")

    def __len__(self) -> int:
        return len(self.tables)

    def to_bytes(self) -> bytes:
        return self._bytes

    def to_file_bytes(self) -> bytes:
        """What :meth:`save` writes: the set's bytes, LZMA-compressed (3.3 MB -> 1.0 MB for
        SmolLM2-135M; zlib level 9 gives 1.29 MB)."""
        if "_file" not in self.__dict__:
            self._file = lzma.compress(self._bytes, preset=9)
        return self._file

    @property
    def nbytes(self) -> int:
        """Bytes a stored table set takes (counted in the ratio): its file size."""
        return len(self.to_file_bytes())

    @classmethod
    def from_bytes(cls, buf: bytes) -> TableSet:
        if buf[:6] == b"\xfd7zXZ\x00":
            buf = lzma.decompress(buf)
        if buf[:4] != _TABLESET_MAGIC or len(buf) < 8:
            raise ValueError("not a kvzip table set")
        (n,) = struct.unpack_from("<I", buf, 4)
        pos, tables = 8, []
        for _ in range(n):
            t, pos = Table.from_bytes(buf, pos)
            tables.append(t)
        return cls(tables)

    def save(self, path) -> None:
        with open(path, "wb") as f:
            f.write(self.to_file_bytes())

    @classmethod
    def load(cls, path) -> TableSet:
        with open(path, "rb") as f:
            return cls.from_bytes(f.read())


def kv_slot(layer: int, kind: str) -> int:
    if kind not in ("k", "v"):
        raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")
    return 2 * int(layer) + (kind == "v")


def fit_table_torch(samples, buckets=BUCKETS_NONE) -> Table:
    """:func:`fit_table` with the counting done by torch on the samples' device (the GPU for
    CUDA KV: milliseconds where numpy on the host takes seconds). ``samples``: int16 tensors
    ``[rows, columns]`` holding bf16 bit patterns. The same integer counts, so the same table."""
    import torch

    cols = int(samples[0].shape[-1])
    dev = samples[0].device
    ecount = torch.zeros(cols * 256, dtype=torch.int64, device=dev)
    colidx = torch.arange(cols, device=dev)
    for s in samples:
        if s.dim() != 2 or s.shape[1] != cols or s.dtype != torch.int16:
            raise ValueError(
                f"samples must be int16 [rows, {cols}], got {s.dtype} {tuple(s.shape)}"
            )
        e = (s.to(torch.int32) >> 7) & 255
        ecount += torch.bincount((colidx * 256 + e).view(-1), minlength=cols * 256)
    base = torch.argmax(ecount.view(cols, 256), 1)  # the first maximum, as numpy's argmax
    bmap = torch.tensor(buckets, dtype=torch.int64, device=dev)
    nb = int(max(buckets)) + 1
    counts = torch.zeros(cols * nb * NSYM, dtype=torch.int64, device=dev)
    for s in samples:
        v = s.to(torch.int64) & 0xFFFF
        es = ((v >> 7) & 255) - base + MODE_SLOT
        sym = (v >> 15) * 16 + torch.where((es >= 1) & (es <= 15), es, 0)
        prev = torch.cat([torch.zeros_like(sym[:1]), sym[:-1]], 0)
        ctx = colidx * nb + bmap[prev]
        counts += torch.bincount((ctx * NSYM + sym).view(-1), minlength=cols * nb * NSYM)
    freq = normalize_counts(counts.view(-1, NSYM).cpu().numpy()).reshape(cols, nb, NSYM)
    return Table(base.to(torch.uint8).cpu().numpy(), tuple(int(b) for b in buckets), freq)


def build_kv_tables(windows) -> TableSet:
    """Calibrate a :class:`TableSet` from captured KV.

    windows: iterable of per-sequence captures, each a list (one per layer) of ``(K, V)``
    bf16 tensors ``[tokens, kv_heads, head_dim]`` (what ``kvzip_eval.model.capture_kv``
    returns). Keys get :data:`BUCKETS_K` context, values :data:`BUCKETS_V`. CUDA tensors are
    counted on their GPU (:func:`fit_table_torch`; the same table as on the CPU), so a tier can
    fit a set from its first chunk of KV without a slow path.
    """
    import torch

    per_slot: dict[int, list] = {}
    for window in windows:
        for layer, (k, v) in enumerate(window):
            for kind, t in (("k", k), ("v", v)):
                if t.dtype != torch.bfloat16:
                    raise ValueError(f"layer {layer} {kind}: expected bf16, got {t.dtype}")
                a = t.detach().contiguous().view(torch.int16)
                a = a.reshape(a.shape[0], -1)
                if not a.is_cuda:
                    a = a.numpy().view(np.uint16)
                per_slot.setdefault(kv_slot(layer, kind), []).append(a)
    if not per_slot or sorted(per_slot) != list(range(len(per_slot))):
        raise ValueError("build_kv_tables needs at least one window with every layer's K and V")

    def fit(samples, buckets):
        if isinstance(samples[0], np.ndarray):
            return fit_table(samples, buckets)
        return fit_table_torch(samples, buckets)

    return TableSet(
        [fit(per_slot[s], BUCKETS_K if s % 2 == 0 else BUCKETS_V) for s in range(len(per_slot))]
    )
