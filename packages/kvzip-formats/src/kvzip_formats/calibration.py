"""The calibration artifact of the compact formats (``4bit``, ``3.5bit``, ``3bit``).

A calibration is a directory holding two files (``spec/calibration.md`` is the document):

* ``calibration.json``: ``{"kvzip_calibration_version": 1, "model": {...}, "fit": {...}}``,
  the model's identity and shape, and how the statistics were gathered;
* ``calibration.safetensors``: six float32 tensors ``[num_layers, num_kv_heads, head_dim]``,
  per-channel second-order statistics of K (after RoPE), V, the queries and ``o_proj``.

The artifact holds statistics only; every format derives its transforms from them
deterministically (``kvzip_formats.compact.transform``), so one calibration serves all three
formats, the reference codecs, the kernels and the vLLM backend alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvzip_formats.base import FormatError

#: Version of the artifact's schema; bumped on any change to the files' meaning.
CALIBRATION_VERSION = 1
JSON_NAME = "calibration.json"
TENSORS_NAME = "calibration.safetensors"
#: ``{kind}_{stat}`` for kind in k, v and stat in mean, var, weight (see spec/calibration.md).
TENSOR_NAMES = ("k_mean", "k_var", "k_weight", "v_mean", "v_var", "v_weight")
#: Positions before this one are excluded from the statistics: the formats keep them in
#: bf16 (sink tokens), so their K and V (attention sinks, unlike the others) need no fit.
STATS_START = 1
#: The model architectures kvzip supports (Llama-class decoders: full attention, RoPE'd keys),
#: the one list that ``kvzip calibrate``/``kvzip eval`` and the vLLM plugin check at start-up.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


class CalibrationError(FormatError):
    """A calibration is missing, damaged, or does not match the model or format using it."""


@dataclass
class Calibration:
    """Per-layer, per-KV-head channel statistics of one model (see module docstring)."""

    model: dict
    tensors: dict[str, torch.Tensor]
    fit: dict = field(default_factory=dict)

    def __post_init__(self):
        for key in ("name", "identity", "num_layers", "num_kv_heads", "num_q_heads", "head_dim"):
            if key not in self.model:
                raise CalibrationError(f"calibration model record lacks {key!r}")
        shape = (self.num_layers, self.num_kv_heads, self.head_dim)
        for name in TENSOR_NAMES:
            t = self.tensors.get(name)
            if t is None:
                raise CalibrationError(f"calibration lacks tensor {name!r}")
            if tuple(t.shape) != shape or t.dtype != torch.float32:
                raise CalibrationError(
                    f"calibration tensor {name!r} must be float32 {list(shape)}, "
                    f"got {t.dtype} {list(t.shape)}"
                )
            if not torch.isfinite(t).all():
                raise CalibrationError(f"calibration tensor {name!r} holds NaN or inf")
            if name.endswith(("_var", "_weight")) and (t < 0).any():
                raise CalibrationError(f"calibration tensor {name!r} holds negative values")

    @property
    def num_layers(self) -> int:
        return int(self.model["num_layers"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.model["num_kv_heads"])

    @property
    def head_dim(self) -> int:
        return int(self.model["head_dim"])

    @property
    def identity(self) -> str:
        return str(self.model["identity"])

    def stats(self, kind: str, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mean, var, weight) of ``kind`` in ``layer``, float32 ``[num_kv_heads, head_dim]``."""
        if not 0 <= layer < self.num_layers:
            raise CalibrationError(
                f"layer {layer} is out of range: this calibration covers {self.num_layers} layers "
                f"of model {self.model['name']!r}"
            )
        return tuple(self.tensors[f"{kind}_{s}"][layer] for s in ("mean", "var", "weight"))

    def for_heads(self, start: int, stop: int) -> Calibration:
        """This calibration restricted to KV heads ``[start, stop)`` (a tensor-parallel rank's
        heads): every statistic sliced along the head axis, so the formats derive, per head,
        the same transforms they derive from the whole. The model record then says which heads
        (``kv_heads = [start, stop]`` of ``total_kv_heads``) and counts only those (query heads
        in proportion). A range outside the calibration's heads is refused."""
        total = self.num_kv_heads
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start < stop <= total):
            raise CalibrationError(
                f"KV heads [{start}, {stop}) are not within this calibration's {total} KV heads "
                f"(model {self.model['name']!r}); supported: 0 <= start < stop <= {total}"
            )
        group = int(self.model["num_q_heads"]) // total
        first = int(self.model.get("kv_heads", [0, total])[0])  # already a slice: offset
        model = {
            **self.model,
            "num_kv_heads": stop - start,
            "num_q_heads": group * (stop - start),
            "kv_heads": [first + start, first + stop],
            "total_kv_heads": int(self.model.get("total_kv_heads", total)),
        }
        tensors = {k: t[:, start:stop].contiguous() for k, t in self.tensors.items()}
        return Calibration(model=model, tensors=tensors, fit=dict(self.fit))

    def check_model(self, info) -> None:
        """Raise ``CalibrationError`` unless ``info`` (a ModelInfo) is the calibrated model."""
        got = {k: getattr(info, k) for k in ("identity", "num_layers", "num_kv_heads", "head_dim")}
        want = {k: self.model[k] for k in got}
        if got != want:
            raise CalibrationError(
                f"calibration was made for model {self.model['name']!r} ({want}), but the model "
                f"in use is {getattr(info, 'name', '?')!r} ({got}); run "
                "`kvzip calibrate --model M --out DIR` for this model"
            )

    # -- files ------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        save_file({k: self.tensors[k].contiguous() for k in TENSOR_NAMES}, str(d / TENSORS_NAME))
        doc = {
            "kvzip_calibration_version": CALIBRATION_VERSION,
            "model": self.model,
            "fit": self.fit,
        }
        (d / JSON_NAME).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        return d

    @classmethod
    def load(cls, directory: str | Path) -> Calibration:
        d = Path(directory).expanduser()
        if not (d / JSON_NAME).is_file() or not (d / TENSORS_NAME).is_file():
            raise CalibrationError(
                f"no calibration at {str(directory)!r}: expected {JSON_NAME} and {TENSORS_NAME} "
                "there; make one with `kvzip calibrate --model M --out DIR`"
            )
        try:
            doc = json.loads((d / JSON_NAME).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CalibrationError(f"{d / JSON_NAME} is not valid JSON: {e}") from None
        version = doc.get("kvzip_calibration_version") if isinstance(doc, dict) else None
        if version != CALIBRATION_VERSION:
            raise CalibrationError(
                f"{d / JSON_NAME} has calibration version {version!r}; this kvzip-formats reads "
                f"version {CALIBRATION_VERSION}; re-run `kvzip calibrate`"
            )
        if not isinstance(doc.get("model"), dict):
            raise CalibrationError(f"{d / JSON_NAME} lacks the 'model' record")
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(d / TENSORS_NAME))
        except (SafetensorError, OSError, ValueError) as e:
            raise CalibrationError(f"{d / TENSORS_NAME} cannot be read: {e}") from None
        return cls(model=doc["model"], tensors=tensors, fit=doc.get("fit", {}))


def as_calibration(calibration: Calibration | str | Path | None) -> Calibration | None:
    """Accept a Calibration, a directory path, or None (returned as is)."""
    if calibration is None or isinstance(calibration, Calibration):
        return calibration
    if isinstance(calibration, (str, Path)):
        return Calibration.load(calibration)
    raise CalibrationError(
        "calibration must be a Calibration, a directory path or None, "
        f"got {type(calibration).__name__}"
    )


def fixed_sum(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """The sum of ``x`` over ``dim`` in an order fixed by the length alone: pairwise, halves
    added elementwise (an odd last entry carried to the next round).

    ``torch.sum``'s order depends on the SIMD width and the thread count (and so may its last
    bit); elementwise additions are rounded by IEEE 754 the same way on every CPU.
    """
    x = x.movedim(dim, 0)
    if x.shape[0] == 0:
        return torch.zeros(x.shape[1:], dtype=x.dtype, device=x.device)
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        s = x[:half] + x[half : 2 * half]
        x = torch.cat((s, x[2 * half :])) if x.shape[0] % 2 else s
    return x[0]


class StatsAccumulator:
    """Streams queries, K and V of one model into the statistics of a Calibration.

    ``update(layer, q, k, v)`` takes one sequence's post-RoPE tensors ``q [T, num_q_heads, d]``,
    ``k`` and ``v [T, num_kv_heads, d]``; positions ``< STATS_START`` are skipped. Sums are kept
    in float64 and added in a fixed order (:func:`fixed_sum` over a sequence's positions, then
    sequence after sequence), so the same inputs give the same bytes on any CPU and thread
    count.
    """

    def __init__(self, num_layers: int, num_q_heads: int, num_kv_heads: int, head_dim: int):
        if num_q_heads % num_kv_heads:
            raise CalibrationError(
                f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.shape = (num_layers, num_kv_heads, head_dim)
        self.group = num_q_heads // num_kv_heads
        z = lambda: torch.zeros(self.shape, dtype=torch.float64)  # noqa: E731
        self.count = torch.zeros(num_layers, dtype=torch.float64)
        self.k_sum, self.k_sq, self.v_sum, self.v_sq, self.q_sq = z(), z(), z(), z(), z()

    @torch.no_grad()
    def update(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        L, H, d = self.shape
        q, k, v = (t[STATS_START:].double() for t in (q, k, v))
        if k.shape[1:] != (H, d) or v.shape != k.shape or q.shape[1:] != (H * self.group, d):
            raise CalibrationError(
                f"update expects q [T, {H * self.group}, {d}], k and v [T, {H}, {d}]; got "
                f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}"
            )
        t = k.shape[0]
        self.count[layer] += t
        self.k_sum[layer] += fixed_sum(k)
        self.k_sq[layer] += fixed_sum(k * k)
        self.v_sum[layer] += fixed_sum(v)
        self.v_sq[layer] += fixed_sum(v * v)
        self.q_sq[layer] += fixed_sum(fixed_sum(q * q).reshape(H, self.group, d), 1)

    def finalize(self, o_proj_weights: list[torch.Tensor], model: dict, fit: dict) -> Calibration:
        """Turn the sums into a Calibration.

        ``o_proj_weights[l]`` is layer l's ``o_proj.weight`` ``[hidden, num_q_heads * d]``: the
        weight of V channel j of KV head h is the summed squared norm of the o_proj columns that
        channel feeds (one per query head of the group), since an error there reaches the
        residual stream through those columns.
        """
        L, H, d = self.shape
        if (self.count == 0).any():
            raise CalibrationError("no tokens were accumulated for some layers")
        n = self.count.view(L, 1, 1)
        k_mean, v_mean = self.k_sum / n, self.v_sum / n
        k_var = (self.k_sq / n - k_mean * k_mean).clamp_min(0)
        v_var = (self.v_sq / n - v_mean * v_mean).clamp_min(0)
        v_w = torch.stack(
            [
                fixed_sum(fixed_sum(w.double() * w.double()).reshape(H, self.group, d), 1)
                for w in o_proj_weights
            ]
        )
        tensors = {
            "k_mean": k_mean,
            "k_var": k_var,
            "k_weight": self.q_sq / n,
            "v_mean": v_mean,
            "v_var": v_var,
            "v_weight": v_w,
        }
        fit = dict(fit, tokens_per_layer=int(self.count[0]))
        return Calibration(
            model=model, tensors={k: t.float().contiguous() for k, t in tensors.items()}, fit=fit
        )


def rotary_adjust(
    cal: Calibration, inv_freq: torch.Tensor, max_context: int, max_angle: float = 0.25
) -> Calibration:
    """Make K's statistics hold at every position up to ``max_context``, not only where fitted.

    K is stored after RoPE, which turns rotary pair ``(j, j + d/2)`` by ``inv_freq[j] * pos``
    (``inv_freq``: the model's ``[d/2]`` rotary frequencies, scaling included): its mean is
    constant only where ``inv_freq[j] * max_context <= max_angle`` radians. For the other pairs
    the mean is dropped (folded into the second moment: subtracting a mean fitted on short
    windows added error further out, where the pair has turned: 4bit's KL rose from 0.025 at
    positions < 1k to 0.14 at 7-8k, results/quality/compact/report.md at commit e6cd4bd) and
    the pair's two channels get their average variance and weight (RoPE mixes them).
    """
    d = cal.head_dim
    half = d // 2
    inv = torch.as_tensor(inv_freq, dtype=torch.float64).flatten()
    if inv.numel() != half:
        raise CalibrationError(f"inv_freq must have head_dim/2 = {half} entries, got {inv.numel()}")
    turns = torch.cat((inv, inv)) * max_context > max_angle  # [d] channels of turning pairs
    t = {k: v.clone() for k, v in cal.tensors.items()}
    mean, var, w = (t[f"k_{s}"].double() for s in ("mean", "var", "weight"))
    var = torch.where(turns, var + mean * mean, var)
    mean = torch.where(turns, torch.zeros_like(mean), mean)

    def pair_avg(x):
        avg = (x[..., :half] + x[..., half:]) / 2
        return torch.where(turns, torch.cat((avg, avg), -1), x)

    t["k_mean"], t["k_var"], t["k_weight"] = (
        a.float().contiguous() for a in (mean, pair_avg(var), pair_avg(w))
    )
    fit = dict(
        cal.fit,
        rotary_adjust={
            "max_context": max_context,
            "max_angle": max_angle,
            "turning_channels": int(turns.sum()),
        },
    )
    return Calibration(model=cal.model, tensors=t, fit=fit)
