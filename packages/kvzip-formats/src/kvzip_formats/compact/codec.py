"""The reference codec shared by ``4bit``, ``3.5bit`` and ``3bit`` (spec/4bit.md, sections 3-5).

A format is a ``CompactSpec``: its row groups as shares of head_dim and bit widths, and its
number of bf16 sink tokens. ``CompactFormat`` follows the document step by step:

1. ``transform``: ``y = A (x - mu)`` with the calibrated transform of (layer, kind);
2. ``quantize``: token scale ``s0 = f16(rms(y))``; codes ``c_j`` = index of the nearest
   codebook level to ``y_j / s0`` (ties to the lower level); refit ``s = f16(<y, l> / <l, l>)``
   with ``l_j = level(c_j)`` (least squares: the norm correction that cut mean KL by 32% at
   4 bits on SmolLM2, 0.0493 -> 0.0335, results/quality/ablation.md); row = codes, then ``s``;
3. decode: ``y^_j = s * level(c_j)``, ``x^ = B y^ + mu``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvzip_formats.base import (
    FormatError,
    KVFormat,
    check_kind,
    check_kv,
    check_packed,
    on_device,
)
from kvzip_formats.calibration import Calibration, CalibrationError, as_calibration
from kvzip_formats.compact import codebook
from kvzip_formats.compact.layout import RowLayout
from kvzip_formats.compact.transform import Transform, apply, derive, unapply
from kvzip_formats.packing import bytes_to_f16, f16_to_bytes

F16_MAX = 65504.0


@dataclass(frozen=True)
class CompactSpec:
    """A compact format: row groups ``((share of head_dim, bits), ...)`` for K and for V, in
    transformed order, plus the number of bf16 sink tokens.

    K and V rows may differ in size (K's error dominates: spend the bits there); the format's
    ``token_head_bytes(head_dim)`` without ``kind`` is their mean, which is what the bit
    accounting counts, and MUST be a whole number of bytes.
    """

    name: str
    k_groups: tuple[tuple[float, int], ...]
    v_groups: tuple[tuple[float, int], ...]
    sink_tokens: int
    version: int

    def layout(self, head_dim: int, kind: str) -> RowLayout:
        if not isinstance(head_dim, int) or head_dim < 16 or head_dim & (head_dim - 1):
            raise FormatError(
                f"{self.name} needs head_dim a power of two >= 16 (Hadamard per group), "
                f"got {head_dim}"
            )
        check_kind(kind)
        return _layout(self.k_groups if kind == "k" else self.v_groups, head_dim)


@functools.cache
def _layout(groups, head_dim: int) -> RowLayout:
    return RowLayout(tuple((round(share * head_dim), bits) for share, bits in groups))


class CompactFormat(KVFormat):
    """Reference codec of one compact format, bound to a calibration (or none: accounting)."""

    needs_calibration = True

    def __init__(self, spec: CompactSpec, calibration: Calibration | str | None = None):
        self.spec = spec
        self.name = spec.name
        self.calibration = as_calibration(calibration)
        self._transforms: dict[tuple[str, int], Transform] = {}

    # -- accounting -------------------------------------------------------------------
    def code_bytes(self, head_dim: int, kind: str | None = None) -> int:
        """Code bytes of a K or V row; without ``kind``, the mean of the two."""
        if kind is None:
            return _mean_int(self.code_bytes(head_dim, "k"), self.code_bytes(head_dim, "v"))
        return self.spec.layout(head_dim, kind).code_bytes

    def meta_bytes(self, head_dim: int, kind: str | None = None) -> int:
        return self.token_head_bytes(head_dim, kind) - self.code_bytes(head_dim, kind)

    def token_head_bytes(self, head_dim: int, kind: str | None = None) -> int:
        """Row bytes of K or V per token and KV head; without ``kind``, the mean of the two."""
        if kind is None:
            return _mean_int(
                self.token_head_bytes(head_dim, "k"), self.token_head_bytes(head_dim, "v")
            )
        return self.spec.layout(head_dim, kind).row_bytes

    def sequence_extra_bytes(self, head_dim: int, num_layers: int, num_kv_heads: int) -> int:
        # bf16 copies of the sink tokens' K and V, beside their rows in the paged cache
        return self.spec.sink_tokens * num_layers * num_kv_heads * head_dim * 2 * 2

    # -- calibration ------------------------------------------------------------------
    def transform_of(self, kind: str, layer: int) -> Transform:
        """The calibrated transform of (kind, layer): what kernels fold into q and the output."""
        check_kind(kind)
        if self.calibration is None:
            raise CalibrationError(
                f"format {self.name!r} needs a calibration: pass calibration=DIR (made by "
                "`kvzip calibrate --model M --out DIR`) to get_format, or --calibration DIR"
            )
        key = (kind, layer)
        if key not in self._transforms:
            mean, var, weight = self.calibration.stats(kind, layer)
            groups = self.spec.layout(self.calibration.head_dim, kind).groups
            self._transforms[key] = derive(mean, var, weight, groups)
        return self._transforms[key]

    def _check_shape(self, heads: int, head_dim: int) -> None:
        cal = self.calibration
        if cal is not None and (heads, head_dim) != (cal.num_kv_heads, cal.head_dim):
            raise CalibrationError(
                f"{self.name}: input has {heads} KV heads of head_dim {head_dim}, but the "
                f"calibration (model {cal.model['name']!r}) has {cal.num_kv_heads} of "
                f"{cal.head_dim}; calibrate this model with `kvzip calibrate`"
            )

    # -- codec ------------------------------------------------------------------------
    def transform(self, x: torch.Tensor, *, kind: str, layer: int) -> torch.Tensor:
        """Step 1: ``[T, H, d]`` float -> ``y`` float32 ``[T, H, d]``."""
        check_kv(x)
        check_kind(kind)
        xf = x.float()
        if not torch.isfinite(xf).all() or xf.abs().amax() > F16_MAX:
            raise FormatError(
                f"{self.name} encodes finite values within the float16 range (|x| <= 65504); "
                "got NaN, inf or a larger value"
            )
        self._check_shape(x.shape[1], x.shape[2])
        return apply(xf, _on(self.transform_of(kind, layer), xf.device))

    def quantize(self, y: torch.Tensor, *, kind: str) -> torch.Tensor:
        """Step 2: transformed ``y`` float32 ``[T, H, d]`` -> packed rows uint8."""
        layout = self.spec.layout(y.shape[-1], kind)
        y = y.float()
        s0 = y.square().mean(-1, keepdim=True).sqrt().to(torch.float16).float()
        if torch.isinf(s0).any():
            raise FormatError(f"{self.name}: a transformed vector's RMS exceeds float16's range")
        u = torch.where(s0 > 0, y / torch.where(s0 > 0, s0, 1.0), 0.0)
        dev = y.device
        codes = torch.empty(y.shape, dtype=torch.int64, device=dev)
        lv = torch.empty(y.shape, dtype=torch.float32, device=dev)
        for start, n, bits in _spans(layout):
            seg = u[..., start : start + n].contiguous()
            c = torch.bucketize(seg, on_device(self.edges(bits), dev), right=False)
            codes[..., start : start + n] = c
            lv[..., start : start + n] = on_device(self.levels(bits), dev)[c]
        fit = (y * lv).sum(-1, keepdim=True) / (lv * lv).sum(-1, keepdim=True)
        s = fit.to(torch.float16).float()
        s = torch.where((s > 0) & torch.isfinite(s), s, s0)
        return torch.cat((layout.pack(codes), f16_to_bytes(s.squeeze(-1))), -1)

    def dequantize(self, packed: torch.Tensor, *, kind: str, head_dim: int) -> torch.Tensor:
        """Inverse of step 2: packed rows -> ``y^`` float32 ``[T, H, d]``."""
        layout = self.spec.layout(head_dim, kind)
        check_packed(packed, layout.row_bytes)
        codes = layout.unpack(packed[..., : layout.code_bytes])
        s = bytes_to_f16(packed[..., layout.code_bytes :]).float().unsqueeze(-1)
        lv = torch.empty(codes.shape, dtype=torch.float32, device=packed.device)
        for start, n, bits in _spans(layout):
            levels = on_device(self.levels(bits), packed.device)
            lv[..., start : start + n] = levels[codes[..., start : start + n]]
        return s * lv

    def levels(self, bits: int) -> torch.Tensor:
        """The ``2**bits`` levels of a ``bits``-wide channel (spec section 7)."""
        return codebook.levels(bits)

    def edges(self, bits: int) -> torch.Tensor:
        return codebook.edges(bits)

    def encode(self, x, *, kind, layer):
        return self.quantize(self.transform(x, kind=kind, layer=layer), kind=kind)

    def decode(self, packed, *, kind, layer, head_dim):
        check_kind(kind)
        self._check_shape(packed.shape[1] if packed.dim() == 3 else -1, head_dim)
        y = self.dequantize(packed, kind=kind, head_dim=head_dim)
        return unapply(y, _on(self.transform_of(kind, layer), y.device))

    @property
    def sink_tokens(self) -> int:  # read back from bf16 copies by KVFormat.roundtrip
        return self.spec.sink_tokens


def _on(t: Transform, device) -> Transform:
    if t.mean.device == device:
        return t
    return Transform(*(on_device(m, device) for m in (t.mean, t.encode, t.decode)))


def _spans(layout: RowLayout):
    start = 0
    for n, bits in layout.groups:
        yield start, n, bits
        start += n


def _mean_int(a: int, b: int) -> int:
    if (a + b) % 2:
        raise FormatError(f"K and V rows of {a} and {b} bytes have no whole-byte mean")
    return (a + b) // 2
