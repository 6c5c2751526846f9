"""Concurrent long-context sessions per GPU (docs/protocol.md, "Capacity method").

sessions = floor(KV budget / bytes of one 131,072-token session), where the KV budget is 92%
of GPU memory less the bf16 weights and 4 GB of activations per GPU. The two reference budgets
of docs/protocol.md are used as given (58.6 GB for Llama-3.1-8B on one 80 GB H100; 416 GB for
Llama-3.1-70B on 8x H100); the H200 budget follows the same rule in decimal GB:
0.92 x 141 GB - 16.06 GB of weights - 4 GB = 109.66 GB.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvzip_formats.base import REFERENCE_SEQ_LEN, get_format, list_formats


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def elements_per_token(self) -> int:
        return self.num_layers * self.num_kv_heads * self.head_dim * 2


@dataclass(frozen=True)
class Deployment:
    model: ModelShape
    gpu: str
    kv_budget_bytes: float


LLAMA_8B = ModelShape("llama-3.1-8b", 32, 8, 128)
LLAMA_70B = ModelShape("llama-3.1-70b", 80, 8, 128)
H200_BUDGET = 0.92 * 141e9 - 8.03e9 * 2 - 4e9

DEPLOYMENTS = (
    Deployment(LLAMA_8B, "h100-80g", 58.6e9),
    Deployment(LLAMA_70B, "8xh100-80g", 416e9),
    Deployment(LLAMA_8B, "h200", H200_BUDGET),
)


def session_bytes(bits: float, model: ModelShape, seq_len: int = REFERENCE_SEQ_LEN) -> float:
    return seq_len * model.elements_per_token * bits / 8


def sessions(bits: float, dep: Deployment, seq_len: int = REFERENCE_SEQ_LEN) -> int:
    return math.floor(dep.kv_budget_bytes / session_bytes(bits, dep.model, seq_len))


def capacity_rows(formats: list[str] | None = None, calibration=None) -> list[dict]:
    """One row per (deployment, format): model, gpu, format, bits, sessions, vs_fp8.

    Formats that need a calibration but have none are accounted with their layout alone
    (bits do not depend on calibrated values).
    """
    names = formats or list_formats()
    rows = []
    for dep in DEPLOYMENTS:
        m = dep.model
        fp8_bits = get_format("fp8").bits_per_element(
            m.head_dim, m.num_layers, num_kv_heads=m.num_kv_heads
        )
        fp8_sessions = sessions(fp8_bits, dep)
        for name in names:
            fmt = get_format(name, calibration=calibration)
            bits = fmt.bits_per_element(m.head_dim, m.num_layers, num_kv_heads=m.num_kv_heads)
            n = sessions(bits, dep)
            rows.append(
                {
                    "model": m.name,
                    "gpu": dep.gpu,
                    "format": name,
                    "bits": round(bits, 4),
                    "sessions": n,
                    "vs_fp8": round(n / fp8_sessions, 3),
                }
            )
    return rows
