"""A Llama forward whose every result is the same on any CPU: the calibration's.

The calibration must come out byte for byte the same wherever it is made, but a model forward
in bf16 or float32 is not: its matrix products and reductions add in an order that depends on
the SIMD width, the thread count and the BLAS kernel, and its ``exp``/``sin``/``cos`` differ in
the last bit between vector widths. This forward runs in float64 and uses only operations whose
result does not depend on the order they run in:

* **matrix products are exact.** Before a product ``A @ B`` over ``k`` terms, each row of ``A``
  and each column of ``B`` is rounded to ``b = (53 - ceil(log2 k)) // 2`` significant bits
  relative to its largest entry (block floating point, :func:`quantize`). Every product of
  entries is then an integer multiple of the row's and column's quanta below ``2**(2b)`` of
  them, so every partial sum, in whatever order a BLAS kernel adds, is an integer below
  ``2**53`` of them: exact in float64. (For SmolLM2-135M: 21 bits for the 576- and 1,536-term
  products, 23 for ``q . k``; a rounded entry is off by at most ``2**-21`` of its row's largest,
  where bf16 rounds each entry by up to ``2**-9`` of itself.)
* **the other sums** are exact the same way (RMSNorm's sum of squares, the softmax's
  denominator); the statistics' sums run in a fixed pairwise order
  (``kvzip_formats.calibration.fixed_sum``).
* **elementwise operations** are only ``+ - * /``, ``sqrt``, ``round``, comparisons and table
  look-ups, which IEEE 754 rounds correctly whatever the vector width; ``exp``, ``sin`` and
  ``cos`` are polynomials built from them (:func:`exp`, :func:`sin_cos`); the softmax's ``exp``
  is a table look-up on a grid of the scores (:data:`SCORE_STEP`).

The rotary frequencies of the default RoPE come from the config through Python's ``decimal``
(correctly rounded); a RoPE with scaling uses the model's own ``inv_freq`` buffer as
transformers computed it.
"""

from __future__ import annotations

import decimal
import math

import torch

#: Softmax: scores are rounded to multiples of this before the table look-up of ``exp``
#: (relative error of a weight at most ``SCORE_STEP / 2``, 1.2e-4).
SCORE_STEP = 2.0**-12
#: Softmax weights are multiples of ``2**-WEIGHT_BITS`` (the row's largest is 1); smaller
#: weights are 0.
WEIGHT_BITS = 21
#: Queries per attention block (bounds the score matrix held at once).
QUERY_BLOCK = 128

_MANTISSA = 53


def product_bits(k: int) -> int:
    """Bits each operand of a ``k``-term product keeps so that the product is exact."""
    return (_MANTISSA - math.ceil(math.log2(max(k, 2)))) // 2


def pow2(e: torch.Tensor) -> torch.Tensor:
    """``2.0 ** e`` exactly (float64), for integer ``e`` in [-1022, 1023], from its bits."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def quantize(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """``x`` (float64) rounded to multiples of ``2**(e - bits)`` along ``dim``, where ``2**e`` is
    the smallest power of two above the largest ``|x|`` there: at most ``2**bits`` quanta."""
    _, e = torch.frexp(x.abs().amax(dim, keepdim=True))
    q = pow2((e.to(torch.int64) - bits).clamp(-1022, 1023))
    return torch.round(x / q) * q


def exact_matmul(a: torch.Tensor, b_quantized: torch.Tensor, bits: int) -> torch.Tensor:
    """``a @ b`` with ``a``'s rows quantized to ``bits``; ``b_quantized`` already is (columns)."""
    return quantize(a, bits, -1) @ b_quantized


# exp: x = k ln2 + r, |r| <= ln2 / 2, exp(r) by its Taylor series to degree 13 (error < 1e-17).
_LN2_HI = 6.93147180369123816490e-01  # ln 2's leading 32 bits: k * _LN2_HI is exact
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e00
_EXP_COEF = [1.0 / math.factorial(i) for i in range(13, -1, -1)]


def exp(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` in float64 from ``+ - *`` only (relative error ~1e-16), for ``x`` clamped to
    [-700, 700]."""
    x = x.clamp(-700.0, 700.0)
    k = torch.round(x * _INV_LN2)
    r = x.sub_(k * _LN2_HI).sub_(k * _LN2_LO)  # x is a fresh tensor (clamp's result)
    p = torch.full_like(r, _EXP_COEF[0])
    for c in _EXP_COEF[1:]:
        p.mul_(r).add_(c)
    return p.mul_(pow2(k))


# sin/cos: a = k pi/2 + r, |r| <= pi/4 (pi/2 in three 33-bit parts: k * part exact for
# |k| < 2**20, angles below 1.6e6), Taylor series to degree 19/18 (error < 1e-18).
_PIO2 = (1.57079632673412561417e00, 6.07710050630396597660e-11, 2.02226624871116645580e-21)
_INV_PIO2 = 6.36619772367581382433e-01
_SIN_COEF = [(-1) ** (i // 2) / math.factorial(i) for i in range(19, 0, -2)]  # r^19 .. r
_COS_COEF = [(-1) ** (i // 2) / math.factorial(i) for i in range(18, -1, -2)]  # r^18 .. 1


def sin_cos(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sin a, cos a)`` in float64 from ``+ - *`` only, for ``|a| < 1.6e6``."""
    if a.numel() and float(a.abs().max()) >= 1.6e6:
        raise ValueError("sin_cos: angles must be below 1.6e6 radians")
    k = torch.round(a * _INV_PIO2)
    r = ((a - k * _PIO2[0]) - k * _PIO2[1]) - k * _PIO2[2]
    r2 = r * r
    s = torch.full_like(r, _SIN_COEF[0])
    for c in _SIN_COEF[1:]:
        s = s * r2 + c
    s = s * r
    c_ = torch.full_like(r, _COS_COEF[0])
    for c in _COS_COEF[1:]:
        c_ = c_ * r2 + c
    quadrant = k.to(torch.int64) & 3
    sin = torch.where(
        quadrant == 0, s, torch.where(quadrant == 1, c_, torch.where(quadrant == 2, -s, -c_))
    )
    cos = torch.where(
        quadrant == 0, c_, torch.where(quadrant == 1, -s, torch.where(quadrant == 2, -c_, s))
    )
    return sin, cos


def default_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """The default RoPE's ``theta ** (-2j / head_dim)``, correctly rounded to float64."""
    ctx = decimal.Context(prec=40)
    base = decimal.Decimal(repr(float(theta)))
    out = [
        float(ctx.power(base, ctx.divide(decimal.Decimal(-2 * j), decimal.Decimal(head_dim))))
        for j in range(head_dim // 2)
    ]
    return torch.tensor(out, dtype=torch.float64)


def _weight_table(n: int) -> torch.Tensor:
    """``exp(-i * SCORE_STEP)`` for i < n, rounded to multiples of ``2**-WEIGHT_BITS``."""
    i = torch.arange(n, dtype=torch.float64)
    scale = 2.0**WEIGHT_BITS
    return torch.round(exp(-(i * SCORE_STEP)) * scale) / scale


#: Table length: exp(-x) rounds to 0 on the weight grid once x > WEIGHT_BITS+1 ln 2.
_TABLE_LEN = math.ceil((WEIGHT_BITS + 1) * math.log(2) / SCORE_STEP) + 2


class ExactLlama:
    """The deterministic forward of a transformers Llama model's attention inputs.

    ``qkv(windows)`` yields ``(layer, window, q, k, v)`` with ``q [T, Hq, d]``, ``k``/``v``
    ``[T, Hkv, d]`` float64 on the model's device, q and k after RoPE, layer by layer over all
    windows (each weight is prepared once).
    """

    def __init__(self, model):
        cfg = model.config
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"the calibration forward supports hidden_act 'silu', got {act!r}")
        self.model = model
        self.cfg = cfg
        self.device = model.device
        self.hq = cfg.num_attention_heads
        self.hkv = getattr(cfg, "num_key_value_heads", None) or self.hq
        self.d = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.hq
        self.eps = float(cfg.rms_norm_eps)
        self.inv_freq, self.rope_scale = self._rope()
        table = _weight_table(_TABLE_LEN)
        table[-1] = 0.0
        self.table = table.to(self.device)

    def _rope(self) -> tuple[torch.Tensor, float]:
        rope = getattr(self.cfg, "rope_parameters", None) or {}
        scaling = getattr(self.cfg, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
        theta = rope.get("rope_theta", getattr(self.cfg, "rope_theta", None))
        if rope_type == "default" and theta is not None:
            return default_inv_freq(theta, self.d), 1.0
        emb = self.model.model.rotary_emb
        return emb.inv_freq.detach().double().cpu(), float(getattr(emb, "attention_scaling", 1.0))

    def _weights(self, *linears) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """The linears' ``weight.T`` side by side (float64), quantized along the input dim
        (column by column: the same as each alone), their bits, and their biases or None."""
        w = torch.cat([p.weight.detach().to(torch.float64).t() for p in linears], 1)
        bits = product_bits(w.shape[0])
        biases = [getattr(p, "bias", None) for p in linears]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat(
                [
                    b.detach().to(torch.float64)
                    if b is not None
                    else torch.zeros(p.out_features, dtype=torch.float64, device=self.device)
                    for b, p in zip(biases, linears, strict=True)
                ]
            )
        return quantize(w, bits, 0), bits, bias

    @staticmethod
    def _linear(x, prepared):
        w, bits, bias = prepared
        y = exact_matmul(x, w, bits)
        return y if bias is None else y + bias

    def _rmsnorm(self, x, norm):
        n = x.shape[-1]
        xq = quantize(x, product_bits(n), -1)
        var = (xq * xq).sum(-1, keepdim=True) / n  # exact sum: any order
        return x / torch.sqrt(var + self.eps) * norm.weight.detach().to(torch.float64)

    def _rope_tables(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(t, dtype=torch.float64)
        sin, cos = sin_cos(pos[:, None] * self.inv_freq[None, :])
        sin, cos = (torch.cat((x, x), -1) * self.rope_scale for x in (sin, cos))
        return sin.to(self.device)[:, None, :], cos.to(self.device)[:, None, :]

    @staticmethod
    def _rotate(x, sin, cos):
        h = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin

    def _attention(self, q, k, v):
        """Causal softmax attention, ``q [T, Hq, d]``, ``k``/``v [T, Hkv, d]`` -> ``[T, Hq*d]``."""
        t, g = q.shape[0], self.hq // self.hkv
        bd = product_bits(self.d)
        # q . k is exact; the scale is applied to q first (exact for a power-of-two head_dim)
        qq = quantize(q * self.d**-0.5, bd, -1).transpose(0, 1)  # [Hq, T, d]
        kq = quantize(k, bd, -1).transpose(0, 1).repeat_interleave(g, 0)
        # e @ v: e has WEIGHT_BITS bits, at most t terms
        bv = _MANTISSA - WEIGHT_BITS - math.ceil(math.log2(max(t, 2)))
        vq = quantize(v, bv, 0).transpose(0, 1).repeat_interleave(g, 0)
        out = torch.empty_like(qq)
        above = torch.ones(QUERY_BLOCK, QUERY_BLOCK, dtype=torch.bool, device=q.device).triu(1)
        for i0 in range(0, t, QUERY_BLOCK):
            i1 = min(t, i0 + QUERY_BLOCK)
            s = qq[:, i0:i1] @ kq[:, :i1].transpose(1, 2)  # [Hq, c, i1]
            s[:, :, i0:i1].masked_fill_(above[: i1 - i0, : i1 - i0], float("-inf"))
            # (max - s) / SCORE_STEP, rounded: the index of exp(-(max - s)) in the table
            m = s.amax(-1, keepdim=True)
            n = s.neg_().add_(m)  # max - s, in place
            n = n.mul_(1.0 / SCORE_STEP).round_().clamp_(max=_TABLE_LEN - 1)
            e = self.table.index_select(0, n.view(-1).long()).view(n.shape)
            den = e.sum(-1, keepdim=True)  # exact: multiples of 2**-WEIGHT_BITS below 2**53
            out[:, i0:i1] = (e @ vq[:, :i1]).div_(den)
        return out.transpose(0, 1).reshape(t, self.hq * self.d)

    @staticmethod
    def _silu(x):
        return x / exp(-x).add_(1.0)

    @torch.no_grad()
    def qkv(self, windows: torch.Tensor):
        n, t = windows.shape
        sin, cos = self._rope_tables(t)
        emb = self.model.model.embed_tokens.weight.detach()
        h = [emb[ids.to(emb.device)].to(torch.float64) for ids in windows]
        layers = self.model.model.layers
        for li, layer in enumerate(layers):
            att, mlp = layer.self_attn, layer.mlp
            wqkv = self._weights(att.q_proj, att.k_proj, att.v_proj)
            last = li == len(layers) - 1
            if not last:
                wo = self._weights(att.o_proj)
                wgu, wd = self._weights(mlp.gate_proj, mlp.up_proj), self._weights(mlp.down_proj)
            sizes = [self.hq * self.d, self.hkv * self.d, self.hkv * self.d]
            for w in range(n):
                x = self._rmsnorm(h[w], layer.input_layernorm)
                q, k, v = self._linear(x, wqkv).split(sizes, -1)
                q = self._rotate(q.reshape(t, self.hq, self.d), sin, cos)
                k = self._rotate(k.reshape(t, self.hkv, self.d), sin, cos)
                v = v.reshape(t, self.hkv, self.d)
                yield li, w, q, k, v
                if last:
                    continue
                x = h[w] + self._linear(self._attention(q, k, v), wo)
                gate, up = self._linear(
                    self._rmsnorm(x, layer.post_attention_layernorm), wgu
                ).chunk(2, -1)
                h[w] = x + self._linear(self._silu(gate) * up, wd)


__all__ = ["ExactLlama", "exact_matmul", "exp", "quantize", "sin_cos"]
