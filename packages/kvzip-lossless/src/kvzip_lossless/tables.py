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


#: Values per stack of samples counted at once by :func:`fit_tables_torch`. On a device:
#: few kernel launches (an 8B model's 2,048-token set in 16 stacks, ~40 ms of launches) with
#: temporaries of 32 MB (a few int32 copies of a stack). On the CPU: counts that stay in
#: cache (that set in 1.1 s on 2 cores; 1.6 s in stacks 8x larger).
_STACK_VALUES = {"cpu": 1 << 20, "device": 1 << 23}


def fit_table_torch(samples, buckets=BUCKETS_NONE) -> Table:
    """:func:`fit_table` with the counting done by torch on the samples' device (the GPU for
    CUDA KV: milliseconds where numpy on the host takes seconds). ``samples``: int16 tensors
    ``[rows, columns]`` holding bf16 bit patterns. The same integer counts, so the same table."""
    return fit_tables_torch([samples], [buckets])[0]


def fit_tables_torch(slots, buckets) -> list[Table]:
    """:func:`fit_table_torch` for many tables at once: table ``i`` from the samples
    ``slots[i]`` (int16 tensors ``[rows, columns]``, all on one device), with bucket map
    ``buckets[i]``; the same tables as fitted one by one.

    Same-shaped samples are stacked and counted together in two passes (mode exponents, then
    symbols in their contexts); the tables are normalised on the device and come to the host
    in one copy. So the whole set costs one device synchronisation, where fitting table by
    table took ~35 per table (CUDA ``bincount`` reads its maximum on the host): 7 s of a vLLM
    store thread's time, under the process's GIL contention, for an 8B model's 64 tables.
    """
    import torch

    if not slots or len(slots) != len(buckets) or not all(len(s) for s in slots):
        raise ValueError("fit_tables_torch needs at least one sample per table, and its buckets")
    if any(len(b) != NSYM for b in buckets):
        raise ValueError(f"a bucket map has {NSYM} entries (one per symbol)")
    dev = slots[0][0].device
    cols = [int(s[0].shape[-1]) for s in slots]
    for s, c in zip(slots, cols, strict=True):
        for x in s:
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"samples must be torch tensors, got {type(x).__name__}")
            if x.dim() != 2 or x.shape[1] != c or x.dtype != torch.int16 or x.device != dev:
                raise ValueError(
                    f"samples must be int16 [rows, {c}] on {dev}, "
                    f"got {x.dtype} {tuple(x.shape)} on {x.device}"
                )
    nbs = [int(max(b)) + 1 for b in buckets]
    # Table i's exponent counts are rows col0[i]:col0[i+1] of [sum(cols), 256]; its symbol
    # counts rows ctx0[i]:ctx0[i+1] of [sum(cols * nb), 32] (column-major, then bucket).
    col0 = [0, *np.cumsum(cols).tolist()]
    ctx0 = [0, *np.cumsum(np.multiply(cols, nbs)).tolist()]
    # Stacks of same-shaped samples in table order (a stack's counts fall in a short run of
    # bins): (their tables, the samples).
    groups: dict[tuple, list] = {}
    for i, s in enumerate(slots):
        for x in s:
            groups.setdefault(tuple(x.shape), []).append((i, x))
    stacks = []
    limit = _STACK_VALUES["cpu" if dev.type == "cpu" else "device"]
    for (rows, c), members in groups.items():
        step = max(1, limit // max(1, rows * c))
        for j in range(0, len(members), step):
            stacks.append(tuple(zip(*members[j : j + step], strict=True)))
    # The bucket maps (x 32: a symbol count row's offset), then per stacked sample: its table's
    # exponent and symbol counts' offsets in its stack's bins, 32 x its buckets, its bucket
    # map's offset. One asynchronous copy to the device, from page-locked memory.
    meta = [32 * b for bm in buckets for b in bm]
    for ids, _ in stacks:
        for i in ids:
            meta += [col0[i] - col0[ids[0]], 32 * (ctx0[i] - ctx0[ids[0]]), 32 * nbs[i], NSYM * i]
    meta = torch.tensor(meta, dtype=torch.int32)
    if dev.type == "cuda":
        meta = meta.pin_memory()
    meta = meta.to(dev, non_blocking=True)
    bm32 = meta[: NSYM * len(slots)]
    colidx = torch.arange(max(cols), dtype=torch.int32, device=dev)

    def each_stack():
        """Per stack: its samples ``[n, rows, c]``, their metadata ``[n, 4]``, its columns,
        its first table and one past its last (its counts fall in those tables' bins)."""
        at = NSYM * len(slots)
        for ids, xs in stacks:
            m = meta[at : at + 4 * len(ids)].view(-1, 4)
            at += 4 * len(ids)
            yield torch.stack(xs), m, colidx[: xs[0].shape[1]], ids[0], ids[-1] + 1

    ecount = torch.zeros(col0[-1] * 256, dtype=torch.int32, device=dev)
    for x, m, col, first, end in each_stack():
        e = x.to(torch.int32).bitwise_right_shift_(7).bitwise_and_(255)
        e += ((m[:, :1] + col) * 256)[:, None]
        _count(ecount[col0[first] * 256 : col0[end] * 256], e)
    # the first maximum, as numpy's argmax
    base = torch.argmax(ecount.view(-1, 256), 1).to(torch.int32)
    counts = torch.zeros(ctx0[-1] * NSYM, dtype=torch.int32, device=dev)
    for x, m, col, first, end in each_stack():
        # symbolize(): sign x 16 + exponent slot (0: escape)
        v = x.to(torch.int32).bitwise_right_shift_(7)  # sign-extended: < 0 for a negative
        b = base[col0[first] : col0[end]][m[:, :1] + col] - MODE_SLOT
        es = v.bitwise_and(255).sub_(b[:, None])
        sym = es.masked_fill_((es < 1) | (es > 15), 0).add_(v.lt_(0), alpha=16)
        # row = table offset + column x nb + bucket of the previous row's symbol (of symbol 0
        # for a sample's first row); x 32, + this symbol
        idx = sym + (m[:, 1:2] + col * m[:, 2:3])[:, None]
        idx[:, 1:] += bm32[m[:, 3, None, None] + sym[:, :-1]]
        idx[:, :1] += bm32[m[:, 3]][:, None, None]
        _count(counts[NSYM * ctx0[first] : NSYM * ctx0[end]], idx)
    freq = _normalize_counts_torch(counts.view(-1, NSYM))
    host = torch.cat([freq.view(-1).to(torch.int16), base.to(torch.int16)]).cpu().numpy()
    freq_h, base_h = host[: freq.numel()].view(np.uint16), host[freq.numel() :].astype(np.uint8)
    return [
        Table(
            base_h[col0[i] : col0[i + 1]],
            tuple(int(b) for b in buckets[i]),
            freq_h[NSYM * ctx0[i] : NSYM * ctx0[i + 1]].reshape(cols[i], nbs[i], NSYM),
        )
        for i in range(len(slots))
    ]


def _count(acc, idx) -> None:
    """``acc += bincount(idx)`` (idx: int32, each in range): ``bincount`` on the CPU, atomic
    adds on a device, where ``bincount`` reads its input's minimum and maximum on the host
    (two synchronisations a call)."""
    import torch

    idx = idx.reshape(-1)
    if acc.device.type == "cpu":
        acc += torch.bincount(idx, minlength=acc.numel())
    else:
        acc.index_add_(0, idx, torch.ones(1, dtype=acc.dtype, device=acc.device).expand(len(idx)))


def _normalize_counts_torch(counts):
    """:func:`normalize_counts` in torch, on the counts' device: the same frequencies (int64)."""
    import torch

    c = counts.to(torch.int64)
    tot = c.sum(-1, keepdim=True)
    f = (c * (PROB_SCALE - NSYM)).floor_divide_(tot.clamp(min=1)).add_(1)
    f.masked_fill_(tot == 0, PROB_SCALE // NSYM)
    rest = PROB_SCALE - f.sum(-1, keepdim=True)
    return f.scatter_add_(-1, torch.argmax(c, -1, keepdim=True), rest)


def build_kv_tables(windows) -> TableSet:
    """Calibrate a :class:`TableSet` from captured KV.

    windows: iterable of per-sequence captures, each a list (one per layer) of ``(K, V)``
    bf16 tensors ``[tokens, kv_heads, head_dim]`` (what ``kvzip_eval.model.capture_kv``
    returns). Keys get :data:`BUCKETS_K` context, values :data:`BUCKETS_V`. Counted by torch
    on the tensors' device, every table at once (:func:`fit_tables_torch`: the same tables as
    numpy's :func:`fit_table`), so a tier fits a set from its first chunks of CUDA KV without
    a slow path.
    """
    import torch

    per_slot: dict[int, list] = {}
    for window in windows:
        for layer, (k, v) in enumerate(window):
            for kind, t in (("k", k), ("v", v)):
                if t.dtype != torch.bfloat16:
                    raise ValueError(f"layer {layer} {kind}: expected bf16, got {t.dtype}")
                a = t.detach().contiguous().view(torch.int16)
                per_slot.setdefault(kv_slot(layer, kind), []).append(a.reshape(a.shape[0], -1))
    if not per_slot or sorted(per_slot) != list(range(len(per_slot))):
        raise ValueError("build_kv_tables needs at least one window with every layer's K and V")
    slots = range(len(per_slot))
    return TableSet(
        fit_tables_torch(
            [per_slot[s] for s in slots], [BUCKETS_K if s % 2 == 0 else BUCKETS_V for s in slots]
        )
    )
