"""``kvzip capacity``: concurrent 131,072-token sessions per GPU for every registered format."""

from __future__ import annotations

import click

from kvzip_eval.results import markdown_table, provenance, provenance_markdown, write_json


@click.command("capacity")
@click.option("--formats", default=None, help="Comma-separated format names (default: all).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write rows as JSON.")
@click.option("--markdown", "md_path", type=click.Path(dir_okay=False), help="Write a table.")
def command(formats: str | None, json_path: str | None, md_path: str | None) -> None:
    """Sessions per GPU, floor(KV budget / bytes of one session): docs/protocol.md, section 3."""
    from kvzip_formats import FormatError, list_formats
    from kvzip_formats.capacity import capacity_rows

    names = [f.strip() for f in formats.split(",")] if formats else list_formats()
    try:
        rows = capacity_rows(names)
    except FormatError as e:
        raise click.UsageError(str(e)) from e
    cols = ["model", "gpu", "format", "bits", "sessions", "vs_fp8"]
    table = markdown_table(rows, cols)
    click.echo(table)
    prov = provenance()
    if json_path:
        write_json(json_path, {"rows": rows, "provenance": prov})
    if md_path:
        with open(md_path, "w") as f:
            f.write("# Capacity: concurrent 131,072-token sessions\n\n")
            f.write(provenance_markdown(prov) + "\n" + table + "\n")
