"""The printed table, the markdown report and its plots (matplotlib, PNG).

Reads the results that ``suite`` measures (one direction: ``suite`` never imports this)."""

from __future__ import annotations

from pathlib import Path

from kvzip_eval.results import markdown_table, provenance_markdown


def _retrieval_mean(r: dict) -> float | None:
    vals = [a for per_len in r.values() for a in per_len.values()]
    return sum(vals) / len(vals) if vals else None


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
                "words_changed": f"{f['words_changed']:.3f}",
                "identical": f"{f['identical']:.2f}",
                "retrieval": f"{_retrieval_mean(f['retrieval']):.2f}",
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
    "identical",
    "retrieval",
]


def retrieval_rows(result: dict) -> list[dict]:
    rows = []
    sources = dict(result["formats"])
    if "bf16" not in sources and result.get("reference"):
        sources = {"bf16 (reference)": {"retrieval": result["reference"]["retrieval"]}, **sources}
    for name, f in sources.items():
        for task, per_len in f["retrieval"].items():
            row = {"format": name, "task": task}
            row.update({L: f"{a:.2f}" for L, a in per_len.items()})
            rows.append(row)
    return rows


def _noise_note(result: dict) -> list[str]:
    nf = result.get("reference", {}).get("noise_floor")
    if not nf:
        return []
    return [
        f"- noise floor (the bf16 reference run twice in this process): KL mean "
        f"{nf['kl_mean']:.4f}, top-1 agree {nf['top1_agree']:.3f}, words changed "
        f"{nf['words_changed']:.3f}, identical {nf['identical']:.2f}"
    ]


def _protocol_note(s: dict) -> list[str]:
    """Say so when a run used less than the quality protocol (docs/protocol.md) asks for."""
    from kvzip_eval.quality.suite import PROTOCOL

    short = []
    if s["kl_windows"] < PROTOCOL.kl_windows:
        short.append(f"KL windows {s['kl_windows']} (protocol {PROTOCOL.kl_windows})")
    if s["prompts"] < PROTOCOL.prompts or s["new_tokens"] < PROTOCOL.new_tokens:
        short.append(
            f"{s['prompts']} prompts x {s['new_tokens']} tokens (protocol "
            f"{PROTOCOL.prompts} x {PROTOCOL.new_tokens})"
        )
    if s["retrieval_samples"] < PROTOCOL.retrieval_samples:
        short.append(
            f"{s['retrieval_samples']} retrieval samples per task and length (protocol "
            f"{PROTOCOL.retrieval_samples}, lengths up to the model's context)"
        )
    if not short:
        return []
    return [
        "- **smaller than the quality protocol of docs/protocol.md**: "
        + "; ".join(short)
        + ". Small samples: retrieval accuracies and words-changed shares here are coarse."
    ]


def write_report(result: dict, out_dir: str | Path, formats: dict | None = None) -> Path:
    """``report.md`` plus ``kl.png``, ``capacity.png`` and ``retrieval.png`` in ``out_dir``."""
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

    # Capacity: sessions per GPU (docs/protocol.md's capacity method), bars to scale from zero.
    from kvzip_formats import get_format
    from kvzip_formats.capacity import DEPLOYMENTS, sessions

    fig, axes = plt.subplots(1, len(DEPLOYMENTS), figsize=(4 * len(DEPLOYMENTS), 3.5))
    cap = {}
    for ax, dep in zip(axes, DEPLOYMENTS, strict=True):
        m = dep.model
        counts = []
        for n in names:
            fmt = (formats or {}).get(n) or get_format(n)
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
    fig, axes = plt.subplots(1, max(1, len(tasks)), figsize=(4 * max(1, len(tasks)), 3.5))
    axes = axes if len(tasks) > 1 else [axes]
    for ax, task in zip(axes, tasks, strict=True):
        for n, f in sources.items():
            per = f["retrieval"].get(task, {})
            xs = [int(L) for L in per]
            ax.plot(xs, list(per.values()), marker="o", label=n)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(task, fontsize=9)
        ax.set_xlabel("context tokens")
        ax.set_ylabel("accuracy")
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
        f"- settings: KL on {s['kl_windows']} windows x {s['kl_length']} tokens (every "
        f"position); words changed on {s['prompts']} prompts x {s['new_tokens']} new tokens; "
        f"retrieval {', '.join(s['tasks'])} at {', '.join(map(str, s['retrieval_lengths']))} "
        f"tokens, {s['retrieval_samples']} samples each; seed {s['seed']}",
        f"- stage wall times on this machine (s): {result.get('timings_s')}",
        *_noise_note(result),
        *_protocol_note(s),
        "",
        "bits: effective bits per element by docs/protocol.md's accounting (Llama-3.1-8B shape). "
        "KL: KL(P_bf16 || P_format) over the full vocabulary at every position. "
        "words_changed: word-level edit distance to the bf16 output / its words (mean over "
        "prompts); identical: share of outputs token-identical to bf16. retrieval: mean "
        "accuracy over tasks and lengths.",
        "",
        markdown_table(summary_rows(result), SUMMARY_COLUMNS),
        "",
        "## Retrieval accuracy by task and length",
        "",
    ]
    rrows = retrieval_rows(result)
    lens = [str(L) for L in s["retrieval_lengths"]]
    md += [markdown_table(rrows, ["format", "task", *lens]), ""]
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
        "![retrieval](retrieval.png)",
        "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(md))
    return path
