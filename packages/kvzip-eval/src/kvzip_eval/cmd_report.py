"""``kvzip report RESULT.json``: rebuild the markdown report (and plots) of a saved result."""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvzip_eval.options import report_option


@click.command("report")
@click.argument("result_json", type=click.Path(exists=True, dir_okay=False, allow_dash=True))
@report_option
def command(result_json: str, report_dir: str | None) -> None:
    """Write report.md (plots too, for `kvzip eval`) from the --json output of any command.

    The report goes to --report DIR, by default a folder next to RESULT_JSON named after it
    (results/x.json -> results/x/); '-' reads the JSON from standard input (then --report is
    needed).
    """
    from kvzip_eval.reports import result_kind, write_report

    if result_json == "-":
        if report_dir is None:
            raise click.UsageError("reading the result from standard input needs --report DIR")
        text = click.get_text_stream("stdin").read()
    else:
        text = Path(result_json).read_text()
        if report_dir is None:
            report_dir = str(Path(result_json).with_suffix(""))
    try:
        data = json.loads(text)
        result_kind(data)
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        raise click.UsageError(f"{result_json}: {e}") from e
    try:
        path = write_report(data, report_dir)
    except (KeyError, TypeError) as e:
        raise click.UsageError(
            f"{result_json}: a {result_kind(data)} result without the field {e}: was it written "
            "by an older or newer kvzip?"
        ) from e
    click.echo(f"wrote {path}")
