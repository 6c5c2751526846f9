"""The benchmarks' arithmetic, apart from vLLM and the GPU (tested on the CPU).

A serving figure is the median of its runs: :func:`aggregate` groups the per-run records of
``kvzip bench serving`` (one per format, context and run) into rows with ``runs`` and
``spread``; :func:`add_ratios` puts each format beside fp8 (median over median, and the spread
of the paired per-run ratios); :func:`merge_calls` joins calls made one after the other on one
machine, each with its own fp8 runs; :func:`summarize_steps` and :func:`summarize_gpu` reduce a
run's step times and GPU samples to what can explain a run unlike the others.
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


def percentile(xs: Sequence[float], q: float) -> float | None:
    """:func:`quantile` in percent; None for no values."""
    return quantile(xs, q / 100) if len(xs) else None


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


def _median(sp: dict | None):
    return sp["median"] if sp else None


def aggregate(runs: Sequence[dict]) -> list[dict]:
    """Per-run records -> one row per (format, context), in first-seen order: ``sessions`` (the
    same in every run, else ValueError: the runs measured different fills), the medians of
    ``decode_tok_s``, ``per_user_tok_s`` (``decode_tok_s`` over ``sessions``: one user's
    decode speed), ``prefill_tok_s``, ``ms_per_step`` and ``step_tok_s`` (sessions over the
    median engine step), ``runs`` (the records) and ``spread`` (per figure: see
    :func:`spread`). ``complete`` is False with fewer than :data:`MIN_RUNS` decode runs."""
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
        n = sessions.pop()
        sp = {k: spread([r.get(k) for r in rs]) for k in ("decode_tok_s", "prefill_tok_s")}
        sp["per_user_tok_s"] = spread([r["decode_tok_s"] / n if n else None for r in rs])
        sp["ms_per_step"] = spread([r.get("ms_per_step") for r in rs])
        sp["step_tok_s"] = spread([r.get("decode_tok_s_at_p50_step") for r in rs])
        row = {
            "format": fmt,
            "context": ctx,
            "sessions": n,
            "decode_tok_s": sp["decode_tok_s"]["median"],
            "per_user_tok_s": _median(sp["per_user_tok_s"]),
            "prefill_tok_s": _median(sp["prefill_tok_s"]),
            "ms_per_step": _median(sp["ms_per_step"]),
            "step_tok_s": _median(sp["step_tok_s"]),
            "n_runs": len(rs),
            "complete": len(rs) >= MIN_RUNS,
        }
        for k in ("kv_tokens", "block_size"):
            if k in rs[0]:
                row[k] = rs[0][k]
        row["runs"] = rs
        row["spread"] = sp
        rows.append(row)
    return rows


def add_ratios(rows: list[dict], baseline: str = "fp8") -> list[dict]:
    """Each row beside the baseline's row of its context (in place; rows without one are left
    as they are): ``sessions_vs_fp8``, ``kv_tokens_vs_fp8``, ``decode_vs_fp8``,
    ``per_user_decode_vs_fp8`` and ``prefill_vs_fp8`` (median over median), ``step_vs_fp8``
    (the same for ``step_tok_s``: sessions over the median engine step, which leaves out the
    fill that ``decode_tok_s`` subtracts), ``per_user_vs_fp8`` (``step_vs_fp8`` over
    ``sessions_vs_fp8``: one user's speed at the median step), and ``decode_vs_fp8_paired``:
    the spread of the per-run ratios (run i of the format over run i of the baseline)."""
    base = {r["context"]: r for r in rows if r["format"] == baseline}
    for r in rows:
        b = base.get(r["context"])
        if b is None:
            continue
        for k, name in (
            ("sessions", "sessions_vs_fp8"),
            ("kv_tokens", "kv_tokens_vs_fp8"),
            ("decode_tok_s", "decode_vs_fp8"),
            ("per_user_tok_s", "per_user_decode_vs_fp8"),
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


def continue_reps(earlier: list[dict], got: list[dict]) -> list[dict]:
    """A later engine of a format already run in this call (``fp8,4bit,fp8``) continues its
    run numbers, per context (in place)."""
    for r in got:
        r["rep"] += sum(
            1 for e in earlier if e["format"] == r["format"] and e["context"] == r["context"]
        )
    return got


def merge_calls(calls: list[dict]) -> list[dict]:
    """Rows of calls made one after the other on one machine (each ``{"runs": [...]}``, in
    order; a call is limited in time, so the formats of one figure are split over calls, each
    with its own fp8 engine). A format's row comes from the first call that measured it
    completely, else the first that measured it at all; its ratios use the fp8 runs of its own
    call, or the first call's where its call had none (``fp8_call`` says which). fp8's row
    pools the fp8 runs of every call (``fp8_by_call``: each call's median, the drift)."""
    if not calls:
        raise ValueError("no calls given")
    per_call = [aggregate(c["runs"]) for c in calls]
    fp8_calls = [i for i, rows in enumerate(per_call) if any(r["format"] == "fp8" for r in rows)]
    if not fp8_calls:
        raise ValueError("no fp8 runs: the ratios need the fp8 baseline")
    chosen: dict[tuple, dict] = {}
    for i, rows in enumerate(per_call):
        fp8_of = i if i in fp8_calls else fp8_calls[0]
        mine = [r for r in rows if r["format"] != "fp8"]
        add_ratios(mine + [r for r in per_call[fp8_of] if r["format"] == "fp8"])
        for r in mine:
            held = chosen.get((r["format"], r["context"]))
            if held is None or (not held["complete"] and r["complete"]):
                chosen[(r["format"], r["context"])] = dict(r, call=i, fp8_call=fp8_of)
    fp8 = [
        dict(x, rep=f"{i}.{x['rep']}") for i in fp8_calls for x in calls[i]["runs"]
        if x["format"] == "fp8"
    ]  # fmt: skip
    rows = add_ratios(aggregate(fp8))
    for r in rows:
        r["call"] = "all"
        r["fp8_by_call"] = {
            str(i): next(
                (x["decode_tok_s"] for x in per_call[i]
                 if x["format"] == "fp8" and x["context"] == r["context"]), None,
            )
            for i in fp8_calls
        }  # fmt: skip
    return rows + list(chosen.values())


def fmt_spread(sp: dict | None) -> str:
    """``min-max (range as a % of the median)`` for a table cell."""
    if not sp:
        return ""
    rel = "" if sp["rel_range"] is None else f" ({100 * sp['rel_range']:.1f}%)"
    return f"{sp['min']:g}-{sp['max']:g}{rel}"
