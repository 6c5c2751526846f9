"""Click options shared by the `kvzip` subcommands: model, device, text, and the output
options that every command takes (`--json PATH|-`, `--report DIR`)."""

from __future__ import annotations

import click

model_option = click.option(
    "--model",
    "model_path",
    default=None,
    help="Llama HF folder or .gguf (default: embedded SmolLM2-135M-Instruct).",
)


device_option = click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default="auto",
    show_default=True,
    help="Where the model and the formats run (auto: CUDA when a GPU is visible).",
)


def resolve_device(name: str) -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``; ``cuda`` without one is an
    error that says so."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise click.UsageError("--device cuda: torch sees no CUDA GPU here; use --device cpu")
    return name


def text_file_option(help: str):  # noqa: A002  (click's own keyword)
    """``--text-file PATH``: an existing text file; ``help`` says which split is used."""
    return click.option(
        "--text-file", type=click.Path(exists=True, dir_okay=False), default=None, help=help
    )


#: The output options every `kvzip` command takes (`kvzip report` takes ``--report``).
json_option = click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, allow_dash=True),
    default=None,
    help="Write the results as JSON to PATH ('-': standard output; the table then goes to "
    "standard error).",
)
report_option = click.option(
    "--report",
    "report_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Write report.md (and its plots) into DIR.",
)


def output_options(f):
    """``--json PATH|-`` and ``--report DIR``, in that order, on a command."""
    return json_option(report_option(f))
