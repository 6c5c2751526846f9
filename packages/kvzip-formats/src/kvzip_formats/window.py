"""Names and bytes of a residual window (spec/residual_window.md): a compact format with the
last ``R`` tokens of every sequence also kept in bf16, spelled ``NAME+rR`` (``4bit+r128``)."""

from __future__ import annotations

import re

_SUFFIX = re.compile(r"^(?P<base>.+)\+r(?P<recent>\d+)$")


def split_name(name: str) -> tuple[str, int]:
    """``"4bit+r128"`` -> ``("4bit", 128)``; a name without the suffix -> ``(name, 0)``."""
    m = _SUFFIX.match(name)
    if m is None:
        return name, 0
    recent = int(m["recent"])
    if recent < 1:
        raise ValueError(f"{name!r}: the residual window (+rN) needs N >= 1")
    return m["base"], recent


def window_bytes(recent: int, head_dim: int, num_layers: int, num_kv_heads: int) -> int:
    """Bytes of one sequence's window: ``recent`` tokens x bf16 K and V, every layer and head."""
    return recent * 2 * num_layers * num_kv_heads * head_dim * 2
