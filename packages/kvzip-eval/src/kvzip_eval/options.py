"""Click options shared by the `kvzip` subcommands that run a model on text."""

from __future__ import annotations

import click

model_option = click.option(
    "--model",
    "model_path",
    default=None,
    help="Llama HF folder or .gguf (default: embedded SmolLM2-135M-Instruct).",
)


def text_file_option(help: str):  # noqa: A002  (click's own keyword)
    """``--text-file PATH``: an existing text file; ``help`` says which split is used."""
    return click.option(
        "--text-file", type=click.Path(exists=True, dir_okay=False), default=None, help=help
    )
