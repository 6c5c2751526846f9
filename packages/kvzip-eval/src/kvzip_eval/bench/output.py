"""What every ``kvzip bench`` subcommand writes into ``--out DIR``: ``NAME.json`` (the result
with its provenance: device, date, package versions, the command, and vLLM's settings as each
engine used them), ``NAME.md`` (the same for reading) and ``NAME.png`` (the plot)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvzip_eval.results import provenance


def header(kind: str, what: str, device: str | None) -> dict:
    """The fields every bench result starts with."""
    prov = provenance()
    return {
        "result": f"bench-{kind}",
        "what": what,
        "device": device,
        "date": prov["date"],
        "versions": prov["versions"],
        "machine": prov["machine"],
        "command": prov["command"],
    }


def fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4g}"
    if isinstance(x, int) and not isinstance(x, bool) and abs(x) >= 10000:
        return f"{x:,}"
    return str(x)


def table(rows: list[dict], cols: list[tuple[str, str]]) -> list[str]:
    """A markdown table of ``rows``: ``cols`` = (key, heading) pairs."""
    out = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(fmt(r.get(k)) for k, _ in cols) + " |" for r in rows]
    return out


def engines_md(engines: list[dict]) -> list[str]:
    """vLLM's settings per engine, as the engines used them."""
    keys = ("async_scheduling", "model_runner", "compilation_mode", "cudagraph_mode",
            "enforce_eager", "attention_backend", "block_size", "kv_cache_dtype",
            "num_gpu_blocks", "enable_prefix_caching", "kv_connector")  # fmt: skip
    lines = ["", "vLLM's settings, as each engine used them (the JSON has vLLM's config line):", ""]
    for e in engines:
        s = e.get("settings") or {}
        said = [f"vLLM {s['vllm']}"] if s else ["did not start"]
        said += [f"{k} {s.get(k)}" for k in keys if k in s]
        err = e.get("error") or (e.get("log_tail") if e.get("rc") not in (0, None) else None)
        lines.append(f"- {e.get('name')}: " + ", ".join(said)
                     + (f"; error: {err[-300:]!r}" if err else ""))  # fmt: skip
    return lines


def write(out: Path, name: str, doc: dict, body: list[str], plot=None) -> dict[str, Path]:
    """``out/name.json``, ``out/name.md`` (provenance, then ``body``) and, with ``plot`` (a
    function of a matplotlib Axes), ``out/name.png``. Returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{name}.json", "md": out / f"{name}.md"}
    if plot is not None:
        try:
            import matplotlib
        except ImportError:  # a bench's numbers outlive a missing plotting library
            doc["plot"] = None
            print(f"kvzip bench: matplotlib is not installed: {name}.png not drawn "
                  "(pip install matplotlib)", file=sys.stderr)  # fmt: skip
        else:
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(7, 4.5))
            plot(ax)
            fig.tight_layout()
            paths["png"] = out / f"{name}.png"
            fig.savefig(paths["png"], dpi=120)
            plt.close(fig)
            doc["plot"] = paths["png"].name
    v = ", ".join(f"{k} {val}" for k, val in doc["versions"].items())
    md = [
        f"# {doc['what']}",
        "",
        f"- device: {doc['device']}",
        f"- date: {doc['date']}",
        f"- versions: {v}",
        f"- command: `{doc['command']}`",
        *(["", f"![{name}]({paths['png'].name})"] if "png" in paths else []),
        "",
        *body,
    ]
    paths["md"].write_text("\n".join(md) + "\n")
    paths["json"].write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return paths
