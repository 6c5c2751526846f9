"""What every `kvzip` command does with its results: print the table, write ``--json PATH|-``
and ``--report DIR``; and ``write_report``, which `kvzip report` runs on a saved JSON.

A result JSON names its command under ``"result"`` (``eval``, ``capacity``, ``lossless``,
``calibrate``); files written before that field existed are recognised by their keys.
"""

from __future__ import annotations

from pathlib import Path

import click

from kvzip_eval.results import json_text, markdown_table, provenance_markdown, write_json

KINDS = ("eval", "capacity", "lossless", "calibrate")


def result_kind(data: object) -> str:
    """Which command wrote ``data`` (a parsed result JSON); ``ValueError`` if none did."""
    if not isinstance(data, dict):
        raise ValueError(f"a kvzip result is a JSON object, got {type(data).__name__}")
    kind = data.get("result")
    if kind is not None:
        if kind not in KINDS:
            raise ValueError(f"unknown result kind {kind!r}; kvzip writes {', '.join(KINDS)}")
        return kind
    if "formats" in data and "settings" in data and "model" in data:
        return "eval"
    rows = data.get("rows")
    if isinstance(rows, list) and rows and isinstance(rows[0], dict) and "sessions" in rows[0]:
        return "capacity"
    if "ratio" in data and "bit_exact" in data:
        return "lossless"
    raise ValueError(
        "not a kvzip result: expected the JSON of `kvzip eval`, `capacity`, `lossless` or "
        '`calibrate` (a "result" field, or their keys)'
    )


def emit(
    result: dict,
    *,
    kind: str,
    table: str,
    json_path: str | None,
    report_dir: str | None,
    formats: dict | None = None,
    notes: list[str] | None = None,
) -> None:
    """Print ``table`` (and ``notes``), then write the JSON and the report when asked.

    With ``--json -`` the JSON is the only thing on standard output: the table, notes and
    "wrote" lines go to standard error.
    """
    result = {"result": kind, **result}
    to_err = json_path == "-"
    click.echo(table, err=to_err)
    for line in notes or []:
        click.echo(line, err=to_err)
    if json_path == "-":
        click.echo(json_text(result), nl=False)
    elif json_path:
        click.echo(f"wrote {write_json(json_path, result)}", err=to_err)
    if report_dir:
        path = write_report(result, report_dir, formats=formats)
        plots = sorted(p.name for p in path.parent.glob("*.png"))
        with_plots = f" (plots beside it: {', '.join(plots)})" if plots else ""
        click.echo(f"wrote {path}{with_plots}", err=to_err)


def write_report(result: dict, out_dir: str | Path, *, formats: dict | None = None) -> Path:
    """``out_dir/report.md`` (plus plots for `eval`) from a result; returns the report path."""
    kind = result_kind(result)
    if kind == "eval":
        from kvzip_eval.quality.report import write_report as write_quality

        return write_quality(result, out_dir, formats)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = {"capacity": _capacity_md, "lossless": _lossless_md, "calibrate": _calibrate_md}[kind]
    path = out / "report.md"
    path.write_text(text(result))
    return path


# -- capacity -------------------------------------------------------------------------------
CAPACITY_COLUMNS = ["model", "gpu", "format", "bits", "sessions", "vs_fp8"]


def _capacity_md(r: dict) -> str:
    return (
        "# Capacity: concurrent 131,072-token sessions\n\n"
        + provenance_markdown(r["provenance"])
        + "\n"
        + markdown_table(r["rows"], CAPACITY_COLUMNS)
        + "\n"
    )


# -- lossless -------------------------------------------------------------------------------
def lossless_rows(r: dict) -> list[dict]:
    rows = [
        {"stream": "K", "ratio": f"{r['ratio_k']:.3f}"},
        {"stream": "V", "ratio": f"{r['ratio_v']:.3f}"},
        {"stream": "K+V (tables counted)", "ratio": f"{r['ratio']:.3f}"},
        {"stream": "K+V blobs only", "ratio": f"{r['ratio_blobs_only']:.3f}"},
    ]
    if r.get("ratio_embedded_tables") is not None:
        rows.append(
            {
                "stream": "K+V, embedded tables (no calibration)",
                "ratio": f"{r['ratio_embedded_tables']:.3f}",
            }
        )
    return rows


def lossless_table(r: dict) -> str:
    return markdown_table(lossless_rows(r), ["stream", "ratio"])


def _speed(r: dict) -> str:
    """CPU speeds; files from before the per-core decode timing have only the wall figure."""
    if "cpu_decode_MBps_all_threads" in r:
        return (
            f"CPU encode {r['cpu_encode_MBps']:.1f} MB/s, decode {r['cpu_decode_MBps']:.1f} "
            f"MB/s per core ({r['cpu_decode_MBps_all_threads']:.1f} MB/s wall, all threads)"
        )
    return f"CPU encode {r['cpu_encode_MBps']:.1f} MB/s, decode {r['cpu_decode_MBps']:.1f} MB/s"


def lossless_summary(r: dict) -> str:
    return (
        f"bits/value {r['bits_per_value']:.3f}; bit-exact: {r['tensors_checked']} tensors; "
        + _speed(r)
    )


def _lossless_md(r: dict) -> str:
    s = r.get("settings", {})
    prov = r.get("provenance") or {k: r[k] for k in ("date", "machine", "versions", "command")}
    lines = [
        f"# kvzip-lossless on {s.get('model', 'the model')}'s KV cache",
        "",
        provenance_markdown(prov),
        lossless_table(r),
        "",
        f"- bits per value: {r['bits_per_value']:.3f}; table set {r['table_bytes']} bytes "
        "(counted)",
        f"- bit-exact: every one of {r['tensors_checked']} tensors restored and compared",
        f"- {_speed(r)}; MB/s of bf16 values, indicative on a shared machine",
        f"- settings: {s}",
        "",
    ]
    return "\n".join(lines)


# -- calibrate ------------------------------------------------------------------------------
def _calibrate_md(r: dict) -> str:
    m = r["model"]
    return (
        f"# Calibration of {m['name']}\n\n"
        + provenance_markdown(r["provenance"])
        + f"\n- written to: `{r['calibration_dir']}`\n"
        f"- model identity: {m['identity']}\n"
        f"- text: {r['fit'].get('text')} ({r['fit'].get('split')} split), {r['windows']} "
        f"windows x {r['length']} tokens, seed {r['fit'].get('seed')}\n"
        f"- wall time: {r['seconds']:.0f} s\n"
    )
