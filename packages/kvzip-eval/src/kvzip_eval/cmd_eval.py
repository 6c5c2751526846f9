"""``kvzip eval``: quality of KV-cache formats (KL, words changed, retrieval)."""

from __future__ import annotations

import os

# Small ops (a format's per-token round trip during decode) wait ~20 ms on each OpenMP
# barrier when the 2 cores are shared with other work and threads spin (measured: a
# [3,64]@[64,64] matmul 23 ms vs 32 us with PASSIVE; large matmuls unchanged). Must be set
# before torch starts its thread pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Deterministic cuBLAS (generation asks torch for deterministic algorithms on CUDA); read
# when cuBLAS starts, so set before torch touches the GPU.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import click  # noqa: E402


def keep_freed_memory() -> None:
    """Serve large allocations from the heap and keep freed memory for reuse (glibc).

    With a residual window in the run (the default), every forward goes through the band
    attention, whose float32 score blocks (9 heads x 1,024 x 1,024 = 38 MB on SmolLM2) are
    above glibc's largest mmap threshold (32 MB): each was mapped, zero-filled by the kernel
    and unmapped again. Measured on one forward of 1,024 tokens, one thread: 4bit+r128 4.6 s
    user and 4.7 s system CPU, the system share gone (0.06 s) with this. A process keeps its
    peak memory instead of returning it, which a command that exits does anyway. No-op
    outside glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    mallopt(m_mmap_threshold, 1 << 30)
    mallopt(m_trim_threshold, 1 << 31)


from kvzip_eval.options import (  # noqa: E402
    device_option,
    model_option,
    output_options,
    resolve_device,
    text_file_option,
)
from kvzip_eval.quality.suite import PRESETS  # noqa: E402


def _preset_help(v) -> str:
    words = f"{v.prompts} prompts x {v.new_tokens} tokens" if v.prompts else "no words changed"
    retrieval = (
        f"retrieval {v.retrieval_samples} per task at "
        f"{','.join(str(L or 'context') for L in v.retrieval_lengths)}"
        if v.retrieval_samples
        else "no retrieval"
    )
    return f"KL {v.kl_windows}x{v.kl_length or 'context'} tokens, {words}, {retrieval}"


_PRESET_HELP = "; ".join(f"{k}: {_preset_help(v)}" for k, v in PRESETS.items())


#: Where `kvzip eval` writes its report when --report is not given.
DEFAULT_REPORT_DIR = "kvzip-eval-report"
#: The residual window of the default run's ``NAME+rN`` formats: what the README recommends
#: and kvzip-vllm serves (``KVZIP_KV_FORMAT=4bit+r128``).
DEFAULT_WINDOW = 128
#: The formats the default run also measures with that window: the compact ones, and
#: int4-rot with the same window, so that the calibration's own share is visible beside it.
DEFAULT_WINDOWED = ("int4-rot", "4bit", "3.5bit", "3bit")


def default_formats() -> list[str]:
    """What `kvzip eval` measures without --formats: every registered format, then
    ``DEFAULT_WINDOWED`` (those registered) with the ``DEFAULT_WINDOW``-token window."""
    from kvzip_formats import list_formats

    names = list_formats()
    return names + [f"{n}+r{DEFAULT_WINDOW}" for n in DEFAULT_WINDOWED if n in names]


def _int_list(ctx, param, value):
    if value is None:
        return None
    try:
        return tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None


def resolve_formats(
    names: list[str], calibration, info, *, explicit: bool = True, auto_calibrate=None
) -> dict:
    """Instantiate the formats; calibrated ones take ``calibration`` (a directory), or the
    default ``<cache>/calibration/<model identity>`` that `kvzip calibrate` writes, or the one
    shipped for the model (``kvzip_eval.calibrate.shipped``: the embedded model's).

    With none there, ``auto_calibrate()`` (if given) runs the one-time calibration into that
    default directory and returns it. Otherwise a format that needs a calibration is an error
    when named (``explicit``); when every format was asked for by default, it is skipped.
    """
    from kvzip_eval.calibrate.shipped import shipped_calibration
    from kvzip_eval.model import cache_dir
    from kvzip_eval.quality import window
    from kvzip_formats import FormatError, get_format, list_formats

    known = list_formats()
    default = cache_dir() / "calibration" / info.identity
    calib = calibration
    if calib is None and default.is_dir():
        calib = default
    shipped = shipped_calibration(info.identity) if calib is None else None
    calib = calib if shipped is None else shipped
    out, skipped = {}, []
    for name in names:
        try:
            base, recent = window.split_name(name)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--formats") from e
        if base not in known:
            raise click.BadParameter(
                f"unknown format {base!r}; registered: {', '.join(known)} (each may take a "
                "residual window of N bf16 tokens as NAME+rN, e.g. 4bit+r128)",
                param_hint="--formats",
            )
        try:
            fmt = get_format(base, calibration=calib)
        except (FormatError, OSError) as e:
            raise click.UsageError(f"format {base!r} could not be set up: {e}") from e
        if getattr(fmt, "needs_calibration", False):
            if calib is None and auto_calibrate is not None:
                calib = auto_calibrate()
                fmt = get_format(base, calibration=calib)
            if calib is None:
                if explicit:
                    raise click.UsageError(
                        f"format {name!r} needs a calibration for model {info.name} and none "
                        f"was found (looked in {default}): run `kvzip calibrate` or pass "
                        "--calibration DIR"
                    )
                skipped.append(name)
                continue
            made_for = getattr(getattr(fmt, "calibration", None), "model", {}) or {}
            if made_for.get("identity") not in (None, info.identity):
                raise click.UsageError(
                    f"the calibration in {calib} was made for model "
                    f"{made_for.get('name')!r} (identity {made_for.get('identity')}), not for "
                    f"{info.name} (identity {info.identity}); run `kvzip calibrate` for it"
                )
        out[name] = window.Windowed(fmt, recent) if recent else fmt
    if shipped is not None and any(getattr(f, "needs_calibration", False) for f in out.values()):
        click.echo(
            f"note: using the calibration shipped for {info.name} ({shipped}); "
            "`kvzip calibrate` makes your own",
            err=True,
        )
    if skipped:
        click.echo(
            f"note: skipping {', '.join(skipped)}: no calibration for {info.name} "
            f"(run `kvzip calibrate`, or pass --calibration DIR)",
            err=True,
        )
    if not out:
        raise click.UsageError("no format left to evaluate")
    return out


@click.command("eval")
@model_option
@device_option
@click.option(
    "--formats",
    default=None,
    help="Comma-separated formats (default: every registered one, and "
    f"{', '.join(f'{n}+r{DEFAULT_WINDOW}' for n in DEFAULT_WINDOWED)}); NAME+rN reads the last N "
    "tokens up to each query in bf16 (a residual window; kvzip-vllm: KVZIP_KV_FORMAT=NAME+rN).",
)
@click.option("--quick", "preset", flag_value="quick", help="About a minute: for tests and checks.")
@click.option("--full", "preset", flag_value="full", help="The settings of the published numbers.")
@text_file_option("Held-out text (default: Python's pydoc_data.topics).")
@click.option(
    "--prompts-file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help='JSON lines {"prompt": ...} for words changed.',
)
@click.option(
    "--calibration",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="Calibration directory for the formats that need one.",
)
@output_options
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--kl-windows", type=int, default=None, help="Override: KL windows.")
@click.option(
    "--kl-length", type=int, default=None, help="Override: KL window tokens (0 = model context)."
)
@click.option(
    "--prompts", "n_prompts", type=int, default=None, help="Override: prompts for words changed."
)
@click.option("--new-tokens", type=int, default=None, help="Override: greedy tokens per prompt.")
@click.option(
    "--retrieval-lengths",
    callback=_int_list,
    default=None,
    help="Override: e.g. 1024,2048,0 (0 = model context).",
)
@click.option(
    "--retrieval-samples", type=int, default=None, help="Override: samples per task and length."
)
@click.option("--tasks", default=None, help="Override: retrieval tasks, comma-separated.")
@click.option(
    "--batch-size", type=int, default=None, help="Override: prompts per generation batch."
)
@click.option(
    "--noise-floor/--no-noise-floor",
    default=None,
    help="Run the bf16 reference twice and report their difference (default: on for CUDA, "
    "whose kernels are not bit-reproducible; off for the CPU).",
)
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@click.option(
    "--no-auto-calibrate",
    is_flag=True,
    help="Do not run the one-time calibration when a format needs one and none is cached.",
)
def command(
    model_path,
    device,
    formats,
    preset,
    text_file,
    prompts_file,
    calibration,
    json_path,
    report_dir,
    seed,
    kl_windows,
    kl_length,
    n_prompts,
    new_tokens,
    retrieval_lengths,
    retrieval_samples,
    tasks,
    batch_size,
    noise_floor,
    no_progress,
    no_auto_calibrate,
):
    """Quality of KV-cache formats: KL at every position, words changed, multi-key retrieval.

    Every attention layer reads K and V through each format's encode + decode, next to a
    bf16 reference on the same windows, prompts and seeds. Without --report (and --json -)
    the report goes to ./kvzip-eval-report. Presets:"""
    from dataclasses import replace

    keep_freed_memory()
    from kvzip_eval.model import ModelError, load_model
    from kvzip_eval.quality.report import frontier_lines, legend, summary_columns, summary_rows
    from kvzip_eval.quality.suite import run_suite, settings_dict
    from kvzip_eval.reports import emit
    from kvzip_eval.results import markdown_table, provenance
    from kvzip_formats import FormatError

    s = PRESETS[preset or "default"]
    over = {
        "kl_windows": kl_windows,
        "kl_length": kl_length,
        "prompts": n_prompts,
        "new_tokens": new_tokens,
        "retrieval_lengths": retrieval_lengths,
        "retrieval_samples": retrieval_samples,
        "gen_batch": batch_size,
        "tasks": tuple(t.strip() for t in tasks.split(",") if t.strip()) if tasks else None,
    }
    s = replace(s, seed=seed, **{k: v for k, v in over.items() if v is not None})
    for k in ("kl_windows", "new_tokens", "gen_batch"):
        if getattr(s, k) < 1:
            raise click.BadParameter(f"{k.replace('_', '-')} must be >= 1, got {getattr(s, k)}")
    for k in ("prompts", "retrieval_samples"):  # 0: that measure is left out
        if getattr(s, k) < 0:
            raise click.BadParameter(f"{k.replace('_', '-')} must be >= 0, got {getattr(s, k)}")

    from kvzip_eval.quality.retrieval import TASKS

    bad = [t for t in s.tasks if t not in TASKS]
    if bad or not s.tasks:
        raise click.BadParameter(
            f"unknown tasks {bad}; tasks: {', '.join(TASKS)}", param_hint="--tasks"
        )
    device = resolve_device(device)
    s = replace(s, noise_floor=device == "cuda" if noise_floor is None else noise_floor)
    if device == "cpu" and batch_size is None:
        # batches are filled to gen_batch rows (batch invariance): wide ones cost on 2 cores
        s = replace(s, gen_batch=min(s.gen_batch, 8))
    if device == "cpu" and preset == "full":
        click.echo(
            f"note: --full is the protocol of docs/protocol.md ({_preset_help(PRESETS['full'])}"
            "): hours on a few CPU cores, minutes with --device cuda",
            err=True,
        )
    try:
        loaded = load_model(model_path, device=device)
    except ModelError as e:
        raise click.UsageError(str(e)) from e
    names = [f.strip() for f in formats.split(",") if f.strip()] if formats else default_formats()

    def auto_calibrate():
        from kvzip_eval.cmd_calibrate import calibrate_model

        click.echo(
            f"no calibration cached for {loaded.info.name}: running the one-time "
            "`kvzip calibrate` (a few minutes on 2 cores) ...",
            err=True,
        )
        try:
            out = calibrate_model(loaded, text_file=text_file, seed=seed)
        except ValueError as e:
            raise click.UsageError(f"calibration failed: {e}") from e
        click.echo(f"calibration written to {out}", err=True)
        return out

    fmts = resolve_formats(
        names,
        calibration,
        loaded.info,
        explicit=bool(formats),
        auto_calibrate=None if no_auto_calibrate else auto_calibrate,
    )
    try:
        body, used = run_suite(
            loaded,
            fmts,
            s,
            text_file=text_file,
            prompts_file=prompts_file,
            progress=not no_progress,
        )
    except FormatError as e:
        raise click.UsageError(str(e)) from e
    except ValueError as e:  # text too short, bad prompts file: the user's input
        raise click.UsageError(str(e)) from e

    info = loaded.info
    result = {
        "model": {
            "name": info.name,
            "source": info.source,
            "identity": info.identity,
            "num_layers": info.num_layers,
            "num_q_heads": info.num_q_heads,
            "num_kv_heads": info.num_kv_heads,
            "head_dim": info.head_dim,
            "max_context": info.max_context,
        },
        "device": device,
        "text": text_file or "pydoc_data.topics",
        "preset": preset or "default",
        "settings": settings_dict(used),
        **body,
        "provenance": provenance(),
    }
    if report_dir is None and json_path != "-":
        report_dir = DEFAULT_REPORT_DIR
    emit(
        result,
        kind="eval",
        table=markdown_table(summary_rows(result), summary_columns(result)),
        notes=[
            "",
            *legend(result),
            *not_measured(used),
            "",
            *frontier_lines(result),
            *next_steps(preset, device, model_path),
        ],
        json_path=json_path,
        report_dir=report_dir,
        formats=fmts,
    )


def not_measured(s) -> list[str]:
    """Say which measures the run left out, and how to get them."""
    left = [
        n for n, k in (("words changed", s.prompts), ("retrieval", s.retrieval_samples)) if not k
    ]
    if not left:
        return []
    return [
        f"{' and '.join(left)}: not measured in this run (a few samples on a CPU cannot tell "
        "the formats apart); --full --device cuda measures them, --prompts N / "
        "--retrieval-samples N here"
    ]


def next_steps(preset: str | None, device: str, model_path) -> list[str]:
    """What to run after this run, printed under its table."""
    lines = ["", "Next:"]
    if preset != "full":
        lines.append(
            "  kvzip eval --full --device cuda   the whole quality protocol ("
            + _preset_help(PRESETS["full"])
            + "): minutes on a GPU"
            + (", hours here" if device == "cpu" else "")
        )
    if model_path is None:
        lines.append(
            "  kvzip eval --model PATH           your own Llama model (a Hugging Face folder "
            "or .gguf); it is calibrated once"
        )
    lines.append(
        "  kvzip eval --formats 4bit,int4    only some formats; kvzip eval --help for every option"
    )
    lines.append(
        "  kvzip eval --formats 4bit+r32,4bit+r256  other residual windows: NAME+rN reads the "
        "last N tokens in bf16 (KVZIP_KV_FORMAT=4bit+r128 in vLLM)"
    )
    return lines


command.help = command.help.rstrip() + " " + _PRESET_HELP + "."
