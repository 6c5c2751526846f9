"""``kvzip calibrate``: the one-time offline calibration of the compact formats for a model."""

from __future__ import annotations

import os

# Small per-layer ops stall on OpenMP barriers when the 2 cores are shared (see cmd_eval).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import click  # noqa: E402

from kvzip_eval.options import (  # noqa: E402
    device_option,
    model_option,
    output_options,
    resolve_device,
    text_file_option,
)

#: 8 windows of 2,048 tokens: 16k tokens per layer. The statistics are per-channel means and
#: second moments (3 numbers per channel), which need far fewer tokens than that.
DEFAULT_WINDOWS = 8
DEFAULT_LENGTH = 2048


@click.command("calibrate")
@model_option
@device_option
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Output directory (default: ~/.cache/kvzip/calibration/<model identity>, "
    "where `kvzip eval` looks).",
)
@text_file_option("Calibration text (default: the calibration split of pydoc_data.topics).")
@click.option(
    "--windows",
    type=click.IntRange(min=1),
    default=DEFAULT_WINDOWS,
    show_default=True,
    help="Token windows to stream.",
)
@click.option(
    "--length",
    type=click.IntRange(min=16),
    default=DEFAULT_LENGTH,
    show_default=True,
    help="Tokens per window (capped at the model's context).",
)
@click.option("--seed", type=int, default=0, show_default=True)
@output_options
def command(
    model_path, device, out_dir, text_file, windows, length, seed, json_path, report_dir
) -> None:
    """Stream calibration text through the model; write calibration.json + .safetensors.

    Calibration uses the "calib" split of the text, disjoint from what `kvzip eval` scores.
    """
    import time

    from kvzip_eval.model import ModelError, load_model
    from kvzip_eval.reports import emit
    from kvzip_eval.results import markdown_table, provenance
    from kvzip_formats.calibration import CALIBRATION_VERSION, Calibration

    t0 = time.perf_counter()
    try:
        loaded = load_model(model_path, device=resolve_device(device))
    except ModelError as e:
        raise click.UsageError(str(e)) from e
    info = loaded.info
    length = min(length, info.max_context)
    try:
        out = calibrate_model(
            loaded, out_dir=out_dir, text_file=text_file, windows=windows, length=length, seed=seed
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    seconds = time.perf_counter() - t0
    cal = Calibration.load(out)
    result = {
        "calibration_dir": str(out),
        "calibration_version": CALIBRATION_VERSION,
        "model": cal.model,
        "windows": windows,
        "length": length,
        "fit": cal.fit,
        "seconds": round(seconds, 1),
        "provenance": provenance(),
    }
    row = {
        "model": info.name,
        "identity": info.identity,
        "tokens": f"{windows} x {length}",
        "seconds": f"{seconds:.0f}",
        "written to": str(out),
    }
    emit(
        result,
        kind="calibrate",
        table=markdown_table([row], list(row)),
        json_path=json_path,
        report_dir=report_dir,
    )


def calibrate_model(
    loaded,
    *,
    out_dir=None,
    text_file=None,
    windows: int = DEFAULT_WINDOWS,
    length: int = DEFAULT_LENGTH,
    seed: int = 0,
):
    """Fit the compact formats' calibration for an already loaded model and save it.

    Streams ``windows`` x ``length`` tokens of the text's "calib" split (disjoint from what
    `kvzip eval` scores) and writes to ``out_dir`` (default: the cache directory that
    `kvzip eval` looks in). Returns the directory. Raises ``ValueError`` for too little text.
    """
    import datetime as dt

    from kvzip_eval.calibrate import fit
    from kvzip_eval.corpus import token_windows
    from kvzip_eval.model import cache_dir
    from kvzip_eval.results import provenance, versions

    info = loaded.info
    length = min(length, info.max_context)
    wins = token_windows(
        loaded.tokenizer, windows, length, text_file=text_file, split="calib", seed=seed
    )
    record = {
        "text": str(text_file) if text_file else "pydoc_data.topics",
        "split": "calib",
        "seed": seed,
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "versions": versions(),
        "command": provenance()["command"],
    }
    cal = fit(loaded, wins, fit_record=record)
    return cal.save(out_dir or cache_dir() / "calibration" / info.identity)
