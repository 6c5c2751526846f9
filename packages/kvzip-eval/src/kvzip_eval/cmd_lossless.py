"""``kvzip lossless``: ratio of the bit-exact codec on a model's real bf16 KV cache.

Calibrates the per-model tables on the corpus's ``calib`` split, then compresses K and V of
every layer of ``eval``-split windows, restores every tensor and compares it bit for bit.
The ratio counts every blob byte plus the stored table set (LZMA file) once.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import click

from kvzip_eval.options import model_option, output_options, text_file_option
from kvzip_eval.reports import emit, lossless_summary, lossless_table
from kvzip_eval.results import provenance


def _bits(t):
    import torch

    return t.contiguous().view(torch.int16)


def _tables_bytes(ts, kind: str) -> int:
    """File bytes of the K-only or V-only part of a table set (to split the table cost)."""
    import kvzip_lossless as kl

    return kl.TableSet([t for i, t in enumerate(ts.tables) if i % 2 == (kind == "v")]).nbytes


#: timed passes of the per-core decode (the best is reported; all are listed)
DECODE_PASSES = 3


def decode_MBps_per_core(
    blobs: list[bytes], tables, passes: int = DECODE_PASSES
) -> tuple[float, int, list[float]]:
    """MB/s of bf16 output that ``kvzip_lossless.decompress`` restores per CPU core.

    With torch on one thread, decodes every blob once untimed (compiles the coder and touches
    its tables and buffers), then times ``passes`` passes, each decoding every blob, by the
    process's CPU time (all its threads, so a coder that starts threads of its own is still
    counted per core). Returns (the best pass's MB/s, bytes decoded a pass, every pass's MB/s):
    the best, as the machine may be shared.
    """
    import torch

    import kvzip_lossless as kl

    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = sum(kl.decompress(b, tables=tables).numel() * 2 for b in blobs)
        rates = []
        for _ in range(passes):
            t0 = time.process_time()
            for b in blobs:
                kl.decompress(b, tables=tables)
            rates.append(n / max(time.process_time() - t0, 1e-9) / 1e6)
    finally:
        torch.set_num_threads(threads)
    return max(rates), n, rates


@click.command("lossless")
@model_option
@text_file_option("Text to run (default: pydoc_data.topics).")
@click.option(
    "--tokens", default=8192, show_default=True, help="Evaluation tokens (whole windows)."
)
@click.option("--length", default=2048, show_default=True, help="Tokens per window.")
@click.option(
    "--calib-tokens",
    default=None,
    type=int,
    help="Calibration tokens from the calib split (default: --tokens).",
)
@click.option(
    "--tables",
    "tables_in",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Use this saved table set instead of calibrating.",
)
@click.option(
    "--save-tables",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the calibrated table set here.",
)
@click.option(
    "--dump-kv",
    type=click.Path(file_okay=False),
    default=None,
    help="Also write the first eval window's KV (uint16 .npy) and the tables here.",
)
@click.option("--dump-layers", default=8, show_default=True, help="Layers to dump.")
@click.option(
    "--embedded/--no-embedded",
    default=True,
    show_default=True,
    help="Also measure blobs with embedded tables (no calibration).",
)
@output_options
def command(
    model_path,
    text_file,
    tokens,
    length,
    calib_tokens,
    tables_in,
    save_tables,
    dump_kv,
    dump_layers,
    embedded,
    json_path,
    report_dir,
) -> None:
    """Compress and restore every K and V tensor; print ratio, bit-exactness and CPU speed.

    The decode speed is also measured per core (``cpu_decode_MBps``): the first window's blobs
    decoded again on one thread, after one untimed warm-up pass, best of 3 timed passes (MB/s
    of bf16 output per process CPU second; every pass in ``cpu_decode_MBps_passes``)."""
    import numpy as np
    import torch

    import kvzip_lossless as kl
    from kvzip_eval.corpus import token_windows
    from kvzip_eval.model import ModelError, capture_kv, load_model

    if tokens < 1 or length < 2:
        raise click.UsageError(f"--tokens must be >= 1 and --length >= 2, got {tokens}, {length}")
    n_eval = max(1, tokens // length)
    n_cal = max(1, (calib_tokens if calib_tokens is not None else tokens) // length)
    try:
        loaded = load_model(model_path)
        eval_ids = token_windows(
            loaded.tokenizer, n_eval, length, text_file=text_file, split="eval"
        )
        cal_ids = (
            None
            if tables_in
            else token_windows(loaded.tokenizer, n_cal, length, text_file=text_file, split="calib")
        )
    except (ModelError, ValueError, FileNotFoundError) as e:
        raise click.UsageError(str(e)) from e

    t0 = time.perf_counter()
    if tables_in:
        ts = kl.TableSet.load(tables_in)
        if len(ts) != 2 * loaded.info.num_layers:
            raise click.UsageError(
                f"--tables holds {len(ts)} slots; this model needs {2 * loaded.info.num_layers}"
            )
        cal_desc = f"loaded from {tables_in}"
    else:
        ts = kl.build_kv_tables(capture_kv(loaded, cal_ids[i : i + 1]) for i in range(n_cal))
        cal_desc = f"calib split, {n_cal} x {length} tokens"
        if save_tables:
            ts.save(save_tables)
    t_cal = time.perf_counter() - t0

    acc = {k: {"raw": 0, "blob": 0, "emb": 0} for k in "kv"}
    t_enc = t_dec = 0.0
    checked = 0
    sampled: list[bytes] = []  # the first window's blobs, for the per-core decode timing
    for w in range(n_eval):
        kv = capture_kv(loaded, eval_ids[w : w + 1])
        if dump_kv and w == 0:
            d = Path(dump_kv)
            d.mkdir(parents=True, exist_ok=True)
            for i, name in enumerate("KV"):
                arr = np.stack([_bits(layer[i]).numpy() for layer in kv[:dump_layers]])
                np.save(d / f"{name}.npy", arr.view(np.uint16))
            ts.save(d / "tables.kvzt")
        for layer, (k, v) in enumerate(kv):
            for kind, x in (("k", k), ("v", v)):
                a = time.perf_counter()
                blob = kl.compress(x, tables=ts, slot=kl.kv_slot(layer, kind))
                b = time.perf_counter()
                y = kl.decompress(blob, tables=ts)
                t_enc += b - a
                t_dec += time.perf_counter() - b
                if not torch.equal(_bits(y), _bits(x)):
                    raise click.ClickException(f"window {w} layer {layer} {kind}: restore differs")
                if embedded:
                    eb = kl.compress(x)
                    if not torch.equal(_bits(kl.decompress(eb)), _bits(x)):
                        raise click.ClickException(
                            f"window {w} layer {layer} {kind}: embedded restore differs"
                        )
                    acc[kind]["emb"] += len(eb)
                if w == 0:
                    sampled.append(blob)
                acc[kind]["raw"] += x.numel() * 2
                acc[kind]["blob"] += len(blob)
                checked += 1

    per_core, per_core_bytes, per_core_passes = decode_MBps_per_core(sampled, ts)
    load_avg = [round(v, 2) for v in os.getloadavg()]  # the machine's load as it was timed
    raw = acc["k"]["raw"] + acc["v"]["raw"]
    blobs = acc["k"]["blob"] + acc["v"]["blob"]
    tb = {kind: _tables_bytes(ts, kind) for kind in "kv"}
    ratio = raw / (blobs + ts.nbytes)
    coder = getattr(kl, "coder", None)
    out = {
        "ratio": ratio,
        "ratio_k": acc["k"]["raw"] / (acc["k"]["blob"] + tb["k"]),
        "ratio_v": acc["v"]["raw"] / (acc["v"]["blob"] + tb["v"]),
        "bits_per_value": 16 / ratio,
        "bit_exact": True,
        "tensors_checked": checked,
        "ratio_blobs_only": raw / blobs,
        "ratio_embedded_tables": raw / (acc["k"]["emb"] + acc["v"]["emb"]) if embedded else None,
        "table_bytes": ts.nbytes,
        "raw_bytes": raw,
        "blob_bytes": blobs,
        "cpu_encode_MBps": raw / t_enc / 1e6,
        "cpu_decode_MBps": per_core,
        "cpu_decode_MBps_passes": per_core_passes,
        "cpu_decode_load_average": load_avg,
        "cpu_decode_MBps_all_threads": raw / t_dec / 1e6,
        "calibration_s": t_cal,
        "settings": {
            "model": loaded.info.name,
            "model_identity": loaded.info.identity,
            "layers": loaded.info.num_layers,
            "kv_heads": loaded.info.num_kv_heads,
            "head_dim": loaded.info.head_dim,
            "text": str(text_file) if text_file else "pydoc_data.topics",
            "eval": f"eval split, {n_eval} x {length} tokens",
            "calibration": cal_desc,
            "tables": "per model: per (layer, K/V, channel) sign+exponent tables; K with the "
            "previous token's sign/exponent bucket as context; counted once (LZMA file)",
            "format_version": kl.FORMAT_VERSION,
            "cpu_coder": coder("cpu") if coder else None,
            "timing_note": "MB/s of bf16 values on the CPU. cpu_decode_MBps: per core (the "
            f"first window's {len(sampled)} blobs, {per_core_bytes} bytes, decoded on one "
            "torch thread after one untimed warm-up pass; bytes / process CPU seconds, best of "
            f"{DECODE_PASSES} passes, each decoding every blob; the 1, 5 and 15 minute load "
            "averages right after: cpu_decode_load_average); cpu_encode_MBps and "
            f"cpu_decode_MBps_all_threads: wall time with {torch.get_num_threads()} torch "
            "threads. On a shared machine: indicative only",
        },
        "provenance": provenance(),
    }
    emit(
        out,
        kind="lossless",
        table=lossless_table(out),
        notes=[lossless_summary(out)],
        json_path=json_path,
        report_dir=report_dir,
    )
