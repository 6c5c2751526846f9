"""The arithmetic of ``bench_serving.py`` and ``merge_serving.py``, apart from vLLM and the GPU
(tested on the CPU: ``tests/test_serving_stats.py``).

A serving figure is the median of its runs: ``aggregate`` groups the per-run records that
``bench_serving.py`` prints (one per format, context and repeat) into rows with ``runs`` and
``spread``; ``add_ratios`` puts each format beside fp8 (median over median, and the spread of
the paired per-repeat ratios); ``summarize_steps`` and ``summarize_gpu`` reduce a run's step
times and GPU samples to what can explain a run that differs from the others.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

#: NVML's clock-event (throttle) reason bits (``nvmlClocksEventReason*``).
THROTTLE_BITS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}

#: Fewer runs than this and a row is marked incomplete (``complete: false``).
MIN_RUNS = 3


def quantile(xs: Iterable[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs``, interpolated linearly between order statistics
    (numpy's default method)."""
    v = sorted(float(x) for x in xs)
    if not v:
        raise ValueError("quantile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def spread(values: Sequence[float | None]) -> dict | None:
    """Median, range and interquartile range of the runs' values (None values left out);
    ``rel_range`` = (max - min) / median, ``rel_iqr`` = IQR / median. None if no value."""
    v = [float(x) for x in values if x is not None]
    if not v:
        return None
    med = quantile(v, 0.5)
    q1, q3 = quantile(v, 0.25), quantile(v, 0.75)
    rel = (lambda x: round(x / med, 4)) if med else (lambda x: None)
    return {
        "n": len(v),
        "median": round(med, 4),
        "min": min(v),
        "max": max(v),
        "q1": round(q1, 4),
        "q3": round(q3, 4),
        "rel_range": rel(max(v) - min(v)),
        "rel_iqr": rel(q3 - q1),
    }


def summarize_steps(step_s: Sequence[float], skip: int = 2) -> dict | None:
    """A generate's engine-step wall times (seconds, in order) as ms percentiles. The first
    ``skip`` steps are left out: the fill and first token, and the step that waits for it
    under asynchronous scheduling."""
    v = [1000.0 * s for s in step_s[skip:]]
    if not v:
        return None
    return {
        "n": len(v),
        "skipped": min(skip, len(step_s)),
        "p10": round(quantile(v, 0.1), 3),
        "p50": round(quantile(v, 0.5), 3),
        "p90": round(quantile(v, 0.9), 3),
        "max": round(max(v), 3),
    }


def throttle_names(mask: int | None) -> list[str]:
    """NVML's clock-event reason bits by name (unknown bits as hex)."""
    if not mask:
        return []
    names = [n for b, n in THROTTLE_BITS.items() if mask & b]
    rest = mask & ~sum(THROTTLE_BITS)
    return names + ([hex(rest)] if rest else [])


def summarize_gpu(samples: Sequence[dict]) -> dict | None:
    """GPU samples taken while a run decoded (``sm_mhz``, ``mem_mhz``, ``temp_c``, ``power_w``,
    ``throttle`` each possibly None) -> min/max clocks, max temperature, mean power and the
    throttle reasons seen in any sample."""
    if not samples:
        return None

    def col(k):
        return [s[k] for s in samples if s.get(k) is not None]

    out: dict = {"samples": len(samples)}
    for k in ("sm_mhz", "mem_mhz"):
        c = col(k)
        out[f"{k}_min"], out[f"{k}_max"] = (min(c), max(c)) if c else (None, None)
    t, p = col("temp_c"), col("power_w")
    out["temp_c_max"] = max(t) if t else None
    out["power_w_mean"] = round(sum(p) / len(p), 1) if p else None
    mask = 0
    for m in col("throttle"):
        mask |= int(m)
    out["throttle"] = throttle_names(mask)
    return out


def padded_batch(batch: int, capture_sizes: Sequence[int] | None) -> int | None:
    """The CUDA-graph batch vLLM pads a decode batch to: the smallest captured size >= batch,
    None where the batch is larger than every captured size (it then runs without graphs)."""
    fits = [s for s in capture_sizes or () if s >= batch]
    return min(fits) if fits else None


def aggregate(runs: Sequence[dict]) -> list[dict]:
    """Per-run records -> one row per (format, context), in first-seen order: ``sessions`` (the
    same in every run, else ValueError: the runs measured different fills), the medians of
    ``decode_tok_s``, ``prefill_tok_s`` and ``ms_per_step``, ``runs`` (the records) and
    ``spread`` (per figure: see :func:`spread`). ``complete`` is False with fewer than
    :data:`MIN_RUNS` decode runs."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        for k in ("format", "context", "sessions", "decode_tok_s"):
            if k not in r:
                raise ValueError(f"run record without {k!r}: {sorted(r)}")
        groups.setdefault((r["format"], r["context"]), []).append(r)
    rows = []
    for (fmt, ctx), rs in groups.items():
        sessions = {r["sessions"] for r in rs}
        if len(sessions) != 1:
            raise ValueError(
                f"{fmt} at {ctx}: runs with different sessions {sorted(sessions)}; a figure "
                "is a median of runs of the same fill"
            )
        sp = {k: spread([r.get(k) for r in rs]) for k in ("decode_tok_s", "prefill_tok_s")}
        sp["ms_per_step"] = spread([r.get("ms_per_step") for r in rs])
        sp["step_tok_s"] = spread([r.get("decode_tok_s_at_p50_step") for r in rs])
        row = {
            "format": fmt,
            "context": ctx,
            "sessions": sessions.pop(),
            "decode_tok_s": sp["decode_tok_s"]["median"],
            "prefill_tok_s": sp["prefill_tok_s"]["median"] if sp["prefill_tok_s"] else None,
            "ms_per_step": sp["ms_per_step"]["median"] if sp["ms_per_step"] else None,
            "step_tok_s": sp["step_tok_s"]["median"] if sp["step_tok_s"] else None,
            "n_runs": len(rs),
            "complete": len(rs) >= MIN_RUNS,
        }
        for k in ("kv_tokens", "gpu", "vllm", "torch", "block_size", "tensor_parallel_size"):
            if k in rs[0]:
                row[k] = rs[0][k]
        row["runs"] = rs
        row["spread"] = sp
        rows.append(row)
    return rows


def add_ratios(rows: list[dict], baseline: str = "fp8") -> list[dict]:
    """Each row beside the baseline's row of its context (in place; rows without one are left
    as they are): ``sessions_vs_fp8``, ``kv_tokens_vs_fp8``, ``decode_vs_fp8`` and
    ``prefill_vs_fp8`` (median over median), ``step_vs_fp8`` (the same for ``step_tok_s``:
    sessions over the median engine step, which leaves out the fill that ``decode_tok_s``
    subtracts), ``per_user_vs_fp8`` (``step_vs_fp8`` over ``sessions_vs_fp8``: one user's
    speed), and ``decode_vs_fp8_paired``: the spread of the per-repeat ratios (repeat i of the
    format over repeat i of the baseline)."""
    base = {r["context"]: r for r in rows if r["format"] == baseline}
    for r in rows:
        b = base.get(r["context"])
        if b is None:
            continue
        for k, name in (
            ("sessions", "sessions_vs_fp8"),
            ("kv_tokens", "kv_tokens_vs_fp8"),
            ("decode_tok_s", "decode_vs_fp8"),
            ("prefill_tok_s", "prefill_vs_fp8"),
            ("step_tok_s", "step_vs_fp8"),
        ):
            if r.get(k) and b.get(k):
                r[name] = round(r[k] / b[k], 3)
        if r.get("step_vs_fp8") and r.get("sessions_vs_fp8"):
            r["per_user_vs_fp8"] = round(r["step_vs_fp8"] / r["sessions_vs_fp8"], 3)
        mine = {x.get("rep"): x["decode_tok_s"] for x in r.get("runs", ())}
        theirs = {x.get("rep"): x["decode_tok_s"] for x in b.get("runs", ())}
        pairs = [mine[i] / theirs[i] for i in sorted(set(mine) & set(theirs), key=str)]
        if pairs and r is not b:
            r["decode_vs_fp8_paired"] = spread(pairs)
    return rows


def fmt_spread(sp: dict | None) -> str:
    """``min-max (range as a % of the median)`` for a table cell."""
    if not sp:
        return ""
    rel = "" if sp["rel_range"] is None else f" ({100 * sp['rel_range']:.1f}%)"
    return f"{sp['min']:g}-{sp['max']:g}{rel}"
