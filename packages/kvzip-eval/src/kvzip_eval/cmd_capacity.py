"""``kvzip capacity``: concurrent 131,072-token sessions per GPU for every registered format."""

from __future__ import annotations

import click

from kvzip_eval.options import output_options
from kvzip_eval.reports import CAPACITY_COLUMNS, emit
from kvzip_eval.results import markdown_table, provenance


@click.command("capacity")
@click.option("--formats", default=None, help="Comma-separated format names (default: all).")
@output_options
def command(formats: str | None, json_path: str | None, report_dir: str | None) -> None:
    """Sessions per GPU, floor(KV budget / bytes of one session): docs/protocol.md, section 3."""
    from kvzip_formats import FormatError, list_formats
    from kvzip_formats.capacity import capacity_rows

    names = [f.strip() for f in formats.split(",")] if formats else list_formats()
    try:
        rows = capacity_rows(names)
    except FormatError as e:
        raise click.UsageError(str(e)) from e
    emit(
        {"rows": rows, "provenance": provenance()},
        kind="capacity",
        table=markdown_table(rows, CAPACITY_COLUMNS),
        json_path=json_path,
        report_dir=report_dir,
    )
