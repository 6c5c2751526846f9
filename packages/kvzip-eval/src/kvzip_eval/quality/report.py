"""The printed table, the markdown report and its plots (matplotlib, PNG).

Reads the results that ``suite`` measures (one direction: ``suite`` never imports this)."""

from __future__ import annotations

from pathlib import Path

from kvzip_eval.quality import window
from kvzip_eval.results import markdown_table, provenance_markdown


def _retrieval_mean(r: dict) -> float | None:
    vals = [a for per_len in r.values() for a in per_len.values()]
    return sum(vals) / len(vals) if vals else None


#: McNemar p-value under which a format's retrieval is said to leave bf16's.
LEAVES_P = 0.05


def retrieval_pooled(f: dict) -> tuple[float, list[float]] | None:
    """Accuracy over every retrieval sample of the run, with its Wilson 95% interval (None
    for results without per-cell sample counts)."""
    from kvzip_eval.quality.stats import wilson

    acc, n = f.get("retrieval") or {}, f.get("retrieval_n") or {}
    if not acc or not n:
        return None
    k = sum(round(a * n[t][L]) for t, per in acc.items() for L, a in per.items())
    total = sum(n[t][L] for t, per in acc.items() for L in per)
    return k / total, wilson(k, total)


def leaves_bf16(result: dict) -> list[str]:
    """One line per (format, task, length) whose pass/fail differs from bf16's on the same
    samples by McNemar's exact test (p < LEAVES_P)."""
    lines = []
    for name, f in result["formats"].items():
        for task, per in (f.get("retrieval_p_vs_bf16") or {}).items():
            for L, p in per.items():
                if p < LEAVES_P:
                    ref = result["reference"]["retrieval"][task][L]
                    acc = f["retrieval"][task][L]
                    lines.append(
                        f"{name} leaves bf16 on {task} at {L} tokens: {acc:.2f} vs {ref:.2f} "
                        f"(McNemar p = {p:.3g})"
                    )
    return lines


def _num(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def summary_rows(result: dict) -> list[dict]:
    rows = []
    for name, f in result["formats"].items():
        rows.append(
            {
                "format": name,
                "bits": f"{f['bits']:.3f}",
                "kl_mean": f"{f['kl_mean']:.4f}",
                "kl_median": f"{f['kl_median']:.4f}",
                "kl_p99": f"{f['kl_p99']:.3f}",
                "top1_agree": f"{f['top1_agree']:.3f}",
                "words_changed": _num(f.get("words_changed"), ".3f"),
                "first_departure": _num(f.get("first_departure"), ".1f"),
                "identical": _num(f.get("identical"), ".2f"),
                "retrieval": _num(
                    (retrieval_pooled(f) or (_retrieval_mean(f.get("retrieval") or {}),))[0],
                    ".2f",
                ),
            }
        )
    ref = result.get("reference", {}).get("retrieval")
    if ref and "bf16" not in result["formats"]:
        rows.insert(0, {"format": "bf16 (reference)", "retrieval": f"{_retrieval_mean(ref):.2f}"})
    return rows


SUMMARY_COLUMNS = [
    "format",
    "bits",
    "kl_mean",
    "kl_median",
    "kl_p99",
    "top1_agree",
    "words_changed",
    "first_departure",
    "identical",
    "retrieval",
]


def measured(result: dict) -> dict[str, bool]:
    """Which of the optional measures the run made (``--prompts 0`` / ``--retrieval-samples 0``
    leave them out)."""
    fmts = result["formats"].values()
    return {
        "words": any(f.get("words_changed") is not None for f in fmts),
        "retrieval": any(f.get("retrieval") for f in fmts),
    }


def summary_columns(result: dict) -> list[str]:
    """SUMMARY_COLUMNS less those of measures the run did not make."""
    m = measured(result)
    drop = {"words_changed", "first_departure", "identical"} if not m["words"] else set()
    if not any(f.get("first_departure") is not None for f in result["formats"].values()):
        drop.add("first_departure")  # results written before it was measured
    drop |= {"retrieval"} if not m["retrieval"] else set()
    return [c for c in SUMMARY_COLUMNS if c not in drop]


#: What each column of the summary table means (printed under it and in the report).
_LEGEND = {
    "bits": "bits: stored bits per K/V element, scales and metadata included (Llama-3.1-8B "
    "shape); a GPU holds about 16/bits times as many sessions as with bf16",
    "kl_mean": "kl_mean, kl_median, kl_p99: KL divergence of the next-token distribution from "
    "bf16's, at every position of held-out text (0 = identical; lower is better)",
    "top1_agree": "top1_agree: share of positions where the most likely next token is bf16's",
    "words_changed": "words_changed: word edit distance of the short greedy continuation "
    "from bf16's, per bf16 word (generation is batch-invariant: bf16 against itself is "
    "exactly 0); identical: share of continuations equal to bf16's",
    "first_departure": "first_departure: mean position (generated tokens) of the first token "
    "that differs from bf16's (an identical continuation counts its length; higher is better)",
    "retrieval": "retrieval: share of needles (pass keys, colors) found in long prose, over "
    "every task and length of the run",
}


def legend(result: dict) -> list[str]:
    """One line per column group of the run's summary table (and the residual window's)."""
    cols = summary_columns(result)
    lines = [text for key, text in _LEGEND.items() if key in cols]
    if any(window.split_name(n)[1] for n in result.get("formats", {})):
        lines.append(
            "NAME+rN: the format with the last N tokens up to each query read in bf16 (a "
            "residual window, its bf16 copies counted in bits); kvzip's vLLM backend serves it "
            "for the compact formats (KVZIP_KV_FORMAT=4bit+r128; spec/residual_window.md). "
            "With one in the run, every run (bf16 included) used one float32 attention function"
        )
    return lines


#: Sizes within this share of each other are one size: a GPU holds as many sessions of
#: either to within 1% (4bit's 4.1251 bits and turbo4's 4.125; a 128-token residual window's
#: +0.016 bits at 131,072 tokens, 0.4% of 4bit's). int4's 4.25 against 4bit's 4.125 is 3%.
SAME_SIZE = 0.01


def frontier(result: dict) -> tuple[list[str], list[tuple[str, str]]]:
    """The formats no other format beats on both size and mean KL (fewest bits first), and
    for each other format the one that beats it: ``(frontier, [(beaten, by), ...])``. A format
    is beaten by one at most ``SAME_SIZE`` larger (by bits per element) and at least as close
    to bf16, and strictly smaller beyond ``SAME_SIZE`` or strictly closer."""
    fmts = result["formats"]
    names = sorted(fmts, key=lambda n: (fmts[n]["bits"], fmts[n]["kl_mean"]))
    on, beaten = [], []
    for n in names:
        b, k = fmts[n]["bits"], fmts[n]["kl_mean"]
        better = [
            m
            for m in names
            if m != n
            and fmts[m]["bits"] <= b * (1 + SAME_SIZE)
            and fmts[m]["kl_mean"] <= k
            and (fmts[m]["kl_mean"] < k or fmts[m]["bits"] * (1 + SAME_SIZE) < b)
        ]
        if better:
            beaten.append((n, min(better, key=lambda m: fmts[m]["kl_mean"])))
        else:
            on.append(n)
    return on, beaten


def frontier_lines(result: dict) -> list[str]:
    """Which format is best at which size, in words."""
    fmts = result["formats"]
    on, beaten = frontier(result)

    def desc(n):
        f = fmts[n]
        return (
            f"{n} ({f['bits']:.3f} bits, {16 / f['bits']:.1f}x bf16's sessions, "
            f"KL {f['kl_mean']:.4f})"
        )

    lines = [
        f"Best quality for the size (no other format is at most {SAME_SIZE:.0%} larger and "
        "closer to bf16):"
    ]
    lines += [f"  {desc(n)}" for n in on]
    for n, by in beaten:
        b, bb = fmts[n]["bits"], fmts[by]["bits"]
        size = "no larger" if bb <= b else f"{bb / b - 1:.1%} larger"
        lines.append(
            f"  not {n} ({b:.3f} bits, KL {fmts[n]['kl_mean']:.4f}): {by} is {size} and "
            f"{'as close to' if fmts[by]['kl_mean'] == fmts[n]['kl_mean'] else 'closer to'} bf16"
        )
    return lines


def words_ci_rows(result: dict) -> list[dict]:
    """Words-changed statistics with their 95% intervals, for results that have them."""

    def ci(f, key, spec):
        v, c = f.get(key), f.get(f"{key}_ci95")
        return "-" if v is None else f"{v:{spec}} [{c[0]:{spec}}, {c[1]:{spec}}]"

    return [
        {
            "format": n,
            "words_changed": ci(f, "words_changed", ".3f"),
            "first_departure": ci(f, "first_departure", ".1f"),
            "identical": ci(f, "identical", ".2f"),
        }
        for n, f in result["formats"].items()
        if f.get("words_changed_ci95") is not None
    ]


def retrieval_rows(result: dict) -> list[dict]:
    """Accuracy per format, task and length; with its Wilson 95% interval and a ``*`` where
    the format leaves bf16 (McNemar p < LEAVES_P) for results that carry them."""
    rows = []
    sources = dict(result["formats"])
    if "bf16" not in sources and result.get("reference"):
        ref = result["reference"]
        sources = {
            "bf16 (reference)": {
                "retrieval": ref["retrieval"],
                "retrieval_ci95": ref.get("retrieval_ci95") or {},
            },
            **sources,
        }
    for name, f in sources.items():
        for task, per_len in f["retrieval"].items():
            row = {"format": name, "task": task}
            for L, a in per_len.items():
                ci = (f.get("retrieval_ci95") or {}).get(task, {}).get(L)
                p = (f.get("retrieval_p_vs_bf16") or {}).get(task, {}).get(L)
                mark = "*" if p is not None and p < LEAVES_P else ""
                row[L] = f"{a:.2f}{mark}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
            rows.append(row)
    return rows


def _noise_note(result: dict) -> list[str]:
    nf = result.get("reference", {}).get("noise_floor")
    if not nf:
        return []
    words = (
        f", words changed {nf['words_changed']:.3f}, identical {nf['identical']:.2f}"
        if nf.get("words_changed") is not None
        else ""
    )
    return [
        f"- noise floor (the bf16 reference run twice in this process): KL mean "
        f"{nf['kl_mean']:.4f}, top-1 agree {nf['top1_agree']:.3f}{words}"
    ]


def _settings_text(s: dict) -> str:
    words = (
        f"words changed on {s['prompts']} prompts x {s['new_tokens']} new tokens"
        if s["prompts"]
        else "words changed not measured"
    )
    retrieval = (
        f"retrieval {', '.join(s['tasks'])} at {', '.join(map(str, s['retrieval_lengths']))} "
        f"tokens, {s['retrieval_samples']} samples each"
        if s["retrieval_samples"]
        else "retrieval not measured"
    )
    return (
        f"KL on {s['kl_windows']} windows x {s['kl_length']} tokens (every position); "
        f"{words}; {retrieval}; seed {s['seed']}"
    )


def _protocol_note(s: dict) -> list[str]:
    """Say so when a run used less than the quality protocol (docs/protocol.md) asks for."""
    from kvzip_eval.quality.suite import PROTOCOL

    short = []
    if s["kl_windows"] < PROTOCOL.kl_windows:
        short.append(f"KL windows {s['kl_windows']} (protocol {PROTOCOL.kl_windows})")
    if s["prompts"] == 0:
        short.append("words changed not measured")
    elif s["prompts"] < PROTOCOL.prompts or s["new_tokens"] < PROTOCOL.new_tokens:
        short.append(
            f"{s['prompts']} prompts x {s['new_tokens']} tokens (protocol "
            f"{PROTOCOL.prompts} x {PROTOCOL.new_tokens})"
        )
    if s["retrieval_samples"] == 0:
        short.append("retrieval not measured")
    elif s["retrieval_samples"] < PROTOCOL.retrieval_samples:
        short.append(
            f"{s['retrieval_samples']} retrieval samples per task and length (protocol "
            f"{PROTOCOL.retrieval_samples}, lengths up to the model's context)"
        )
    if not short:
        return []
    coarse = (
        ". Small samples: retrieval accuracies and words-changed shares here are coarse."
        if s["prompts"] or s["retrieval_samples"]
        else "."
    )
    return [
        "- **smaller than the quality protocol of docs/protocol.md**: " + "; ".join(short) + coarse
    ]


def _format_for_bits(name: str, get_format):
    """The format of a result's name for its bit accounting (a report rebuilt from JSON has
    no instances): ``NAME+rN`` as the format with its window."""
    base, recent = window.split_name(name)
    fmt = get_format(base)
    return window.Windowed(fmt, recent) if recent else fmt


#: Where a point's label may go on the frontier plot (offset points; negative x: to the
#: left), tried in order.
LABEL_SPOTS = ((6, 0), (6, 11), (6, -11), (-6, 0), (-6, 11), (-6, -11), (14, 22), (14, -22))


def _label_points(ax, pts: list[tuple[float, float, str]]) -> None:
    """Name each point at the first of ``LABEL_SPOTS`` whose text (its size estimated from
    the font) covers no point and no label placed before it; a label off its point's right
    side gets a thin line to it."""
    scale = ax.figure.dpi / 72  # display pixels per point (savefig's dpi scales them all)
    h, char_w = 8 * scale * 1.2, 8 * scale * 0.6  # fontsize 8
    marks = [ax.transData.transform((b, y)) for b, y, _ in pts]
    boxes: list[tuple[float, float, float, float]] = []

    def free(box) -> bool:
        x0, y0, x1, y1 = box
        if any(x0 - 4 < mx < x1 + 4 and y0 - 4 < my < y1 + 4 for mx, my in marks):
            return False
        return not any(x0 < c1 and c0 < x1 and y0 < d1 and d0 < y1 for c0, d0, c1, d1 in boxes)

    for (b, y, n), (px, py) in zip(pts, marks, strict=True):
        w = char_w * len(n)
        spots = []
        for dx, dy in LABEL_SPOTS:
            x0 = px + dx * scale if dx > 0 else px + dx * scale - w
            yc = py + dy * scale
            spots.append(((dx, dy), (x0, yc - h / 2, x0 + w, yc + h / 2)))
        (dx, dy), box = next((s for s in spots if free(s[1])), spots[0])
        boxes.append(box)
        ax.annotate(
            n,
            (b, y),
            fontsize=8,
            xytext=(dx, dy),
            textcoords="offset points",
            va="center",
            ha="left" if dx > 0 else "right",
            arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "gray"} if dy else None,
        )


def write_report(result: dict, out_dir: str | Path, formats: dict | None = None) -> Path:
    """``report.md`` plus ``frontier.png``, ``kl.png``, ``capacity.png`` and
    ``retrieval.png`` in ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fmts = result["formats"]
    names = list(fmts)

    # KL by format (log scale: formats differ by orders of magnitude; bf16's 0 is drawn as 0).
    fig, ax = plt.subplots(figsize=(7, 3.5))
    vals = [fmts[n]["kl_mean"] for n in names]
    ax.bar(names, vals, color="tab:blue")
    positive = [v for v in vals if v > 0]
    if positive:
        ax.set_yscale("log")
        ax.set_ylim(min(positive) / 3, max(positive) * 3)
    for i, v in enumerate(vals):
        ax.annotate(
            f"{v:.3g}",
            (i, v if v > 0 else (min(positive) / 3 if positive else 0)),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel("mean KL(P_bf16 || P_format)")
    ax.set_title(f"KL at every position, {result['model']['name']}")
    fig.tight_layout()
    fig.savefig(out / "kl.png", dpi=120)
    plt.close(fig)

    # The frontier a user chooses on: mean KL (and retrieval) against bits, every format and
    # baseline of the run in one figure.
    pooled = {n: retrieval_pooled(fmts[n]) for n in names}
    with_retrieval = any(v is not None for v in pooled.values())
    fig, axes = plt.subplots(
        1, 2 if with_retrieval else 1, figsize=(11 if with_retrieval else 6.5, 4), squeeze=False
    )
    ax = axes[0][0]
    on = set(frontier(result)[0])
    pts = [(fmts[n]["bits"], fmts[n]["kl_mean"], n) for n in names]
    floor = min((k for _, k, _ in pts if k > 0), default=1.0) / 3
    line = sorted((b, max(k, floor)) for b, k, n in pts if n in on)
    if line:
        ax.plot(*zip(*line, strict=True), color="tab:gray", lw=1, zorder=1)
    lo, hi = min(b for b, _, _ in pts), max(b for b, _, _ in pts)
    ticks = [t for t in (2, 3, 3.5, 4, 4.5, 5, 6, 8, 12, 16, 32) if lo * 0.9 <= t <= hi * 1.1]
    for b, k, n in pts:
        ax.scatter(b, max(k, floor), color="tab:blue" if n in on else "tab:red", zorder=2)
    if any(k > 0 for _, k, _ in pts):
        ax.set_yscale("log")
    ax.set_ylabel("mean KL vs bf16 (bf16's 0 at the bottom)")
    ax.set_title(
        "KL against size; blue: best for the size,\nred: another format at most "
        f"{SAME_SIZE:.0%} larger is closer to bf16",
        fontsize=9,
    )
    if with_retrieval:
        ax2 = axes[0][1]
        for i, n in enumerate(sorted(names, key=lambda m: fmts[m]["bits"])):
            if pooled[n] is None:
                continue
            acc, (clo, chi) = pooled[n]
            b = fmts[n]["bits"]
            ax2.errorbar(
                b,
                acc,
                yerr=[[acc - clo], [chi - acc]],
                fmt="o",
                capsize=3,
                color="tab:blue" if n in on else "tab:red",
            )
            ax2.annotate(
                n, (b, acc), fontsize=8, xytext=(5, 8 * (i % 3) - 8), textcoords="offset points"
            )
        ax2.set_ylabel("retrieval accuracy, all tasks and lengths (95% Wilson)")
        ax2.set_title("Retrieval against size", fontsize=9)
    for a_ in axes[0]:
        a_.set_xscale("log", base=2)
        a_.set_xticks(ticks, [f"{t:g}" for t in ticks], fontsize=8)
        a_.minorticks_off()
        a_.set_xlabel("bits per element, log scale (fewer: more sessions per GPU)")
    fig.suptitle(
        f"Size against quality, {result['model']['name']}: every format of the run", fontsize=10
    )
    fig.tight_layout()
    _label_points(ax, [(b, max(k, floor), n) for b, k, n in sorted(pts)])
    fig.savefig(out / "frontier.png", dpi=120)
    plt.close(fig)

    # Capacity: sessions per GPU (docs/protocol.md's capacity method), bars to scale from zero.
    from kvzip_formats import get_format
    from kvzip_formats.capacity import DEPLOYMENTS, sessions

    fig, axes = plt.subplots(1, len(DEPLOYMENTS), figsize=(4 * len(DEPLOYMENTS), 3.5))
    cap = {}
    for ax, dep in zip(axes, DEPLOYMENTS, strict=True):
        m = dep.model
        counts = []
        for n in names:
            fmt = (formats or {}).get(n) or _format_for_bits(n, get_format)
            bits = fmt.bits_per_element(m.head_dim, m.num_layers, num_kv_heads=m.num_kv_heads)
            counts.append(sessions(bits, dep))
        cap[f"{m.name} on {dep.gpu}"] = dict(zip(names, counts, strict=True))
        ax.barh(names, counts, color="tab:green")
        for i, c in enumerate(counts):
            ax.annotate(
                str(c), (c, i), va="center", fontsize=8, xytext=(2, 0), textcoords="offset points"
            )
        ax.set_xlim(0, max(counts) * 1.15 if counts else 1)
        ax.set_title(f"{m.name}, {dep.gpu}", fontsize=9)
        ax.set_xlabel("131k-token sessions")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(out / "capacity.png", dpi=120)
    plt.close(fig)

    # Retrieval accuracy by length, one panel per task.
    sources = dict(fmts)
    if "bf16" not in sources and result.get("reference"):
        sources = {"bf16 (reference)": {"retrieval": result["reference"]["retrieval"]}, **sources}
    tasks = sorted({t for f in sources.values() for t in f["retrieval"]})
    (out / "retrieval.png").unlink(missing_ok=True)  # a rebuilt report keeps no stale plot
    fig, axes = plt.subplots(1, max(1, len(tasks)), figsize=(4 * max(1, len(tasks)), 3.5))
    axes = axes if len(tasks) > 1 else [axes]
    for ax, task in zip(axes if tasks else [], tasks, strict=True):
        for n, f in sources.items():
            per = f["retrieval"].get(task, {})
            xs = [int(L) for L in per]
            ax.plot(xs, list(per.values()), marker="o", label=n)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(task, fontsize=9)
        ax.set_xlabel("context tokens")
        ax.set_ylabel("accuracy")
    if tasks:
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "retrieval.png", dpi=120)
    plt.close(fig)

    prov = result["provenance"]
    s = result["settings"]
    md = [
        f"# Quality: {', '.join(names)} on {result['model']['name']}",
        "",
        provenance_markdown(prov),
        f"- model: {result['model']['name']} ({result['model']['source']}), "
        f"identity {result['model']['identity']}",
        f"- text: {result['text']}",
        f"- settings: {_settings_text(s)}",
        f"- stage wall times on this machine (s): {result.get('timings_s')}",
        *_noise_note(result),
        *_protocol_note(s),
        "",
        markdown_table(summary_rows(result), summary_columns(result)),
        "",
        *[f"- {line}" for line in legend(result)],
        "- bits follow the accounting of docs/protocol.md; KL is KL(P_bf16 || P_format) over "
        "the full vocabulary",
        "",
        "![KL against bits](frontier.png)",
        "",
        *[
            line.strip() if i == 0 else f"- {line.strip()}"
            for i, line in enumerate(frontier_lines(result))
        ],
        "",
    ]
    wrows = words_ci_rows(result)
    if wrows:
        md += [
            "## Words changed, first departure, identical outputs (95% intervals)",
            "",
            f"Over {s['prompts']} prompts x {s['new_tokens']} greedy tokens, each prompt "
            "generated in fixed-shape batches (batch-invariant; bf16 against itself is exactly "
            "0); intervals: percentile bootstrap of the mean over prompts (words changed, "
            "first departure), Wilson (identical).",
            "",
            markdown_table(wrows, ["format", "words_changed", "first_departure", "identical"]),
            "",
        ]
    if tasks:
        lens = [str(L) for L in s["retrieval_lengths"]]
        md += ["## Retrieval accuracy by task and length", ""]
        n = s["retrieval_samples"]
        md += [
            f"{n} samples per task and length; [95% Wilson interval]; `*`: the format's "
            f"pass/fail differs from bf16's on the same samples (exact McNemar p < {LEAVES_P}).",
            "",
        ]
        md += [markdown_table(retrieval_rows(result), ["format", "task", *lens]), ""]
        gone = leaves_bf16(result)
        md += ["Where a format leaves bf16:", ""]
        md += (
            [f"- {x}" for x in gone] if gone else ["- nowhere: every cell within McNemar p >= 0.05"]
        )
        md += [""]
    md += ["## KL by position (mean over 8 equal spans of the window)", ""]
    md += [
        markdown_table(
            [
                {
                    "format": n,
                    **{str(i): f"{v:.4f}" for i, v in enumerate(fmts[n]["kl_by_position"])},
                }
                for n in names
            ],
            ["format", *[str(i) for i in range(len(next(iter(fmts.values()))["kl_by_position"]))]],
        ),
        "",
        "## Capacity (sessions per GPU, docs/protocol.md's capacity method)",
        "",
        markdown_table([{"deployment": d, **v} for d, v in cap.items()], ["deployment", *names]),
        "",
        "![KL by format](kl.png)",
        "",
        "![capacity](capacity.png)",
        "",
        *(["![retrieval](retrieval.png)", ""] if tasks else []),
    ]
    path = out / "report.md"
    path.write_text("\n".join(md))
    return path
