"""``kvzip lossless``: every K/V tensor of real windows restored bit for bit; the ratio counts
blobs and tables; errors are clear."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from kvzip_eval.cmd_lossless import command


@pytest.mark.slow  # end to end: runs the command on the model
def test_lossless_command_on_real_kv(loaded, tmp_path):
    out = tmp_path / "r.json"
    dump = tmp_path / "kv"
    res = CliRunner().invoke(
        command,
        [
            "--tokens",
            "64",
            "--length",
            "64",
            "--json",
            str(out),
            "--report",
            str(tmp_path / "rep"),
            "--dump-kv",
            str(dump),
            "--dump-layers",
            "2",
        ],
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    n = loaded.info.num_layers
    assert doc["bit_exact"] is True and doc["tensors_checked"] == 2 * n
    assert doc["raw_bytes"] == 2 * n * 64 * loaded.info.num_kv_heads * loaded.info.head_dim * 2
    # every byte counted: blobs plus the stored table set
    assert abs(doc["ratio"] - doc["raw_bytes"] / (doc["blob_bytes"] + doc["table_bytes"])) < 1e-9
    assert abs(doc["bits_per_value"] * doc["ratio"] - 16) < 1e-9
    assert doc["ratio_blobs_only"] > 1.2  # real KV compresses even on 64 tokens
    for key in (
        "ratio_k",
        "ratio_v",
        "cpu_encode_MBps",
        "cpu_decode_MBps",
        "cpu_decode_MBps_all_threads",
        "settings",
    ):
        assert key in doc
    assert doc["result"] == "lossless"
    assert {"date", "machine", "versions", "command"} <= set(doc["provenance"])
    assert doc["cpu_decode_MBps"] > 0 and "per core" in doc["settings"]["timing_note"]
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| K+V (tables counted) |" in md and "MB/s per core" in md
    k = np.load(dump / "K.npy")
    assert k.dtype == np.uint16 and k.shape == (
        2,
        64,
        loaded.info.num_kv_heads,
        loaded.info.head_dim,
    )
    assert (dump / "tables.kvzt").stat().st_size == doc["table_bytes"]


def test_lossless_command_text_too_short(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("only a few words here")
    res = CliRunner().invoke(
        command, ["--text-file", str(short), "--json", str(tmp_path / "x.json")]
    )
    assert res.exit_code == 2 and "text too short" in res.output
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow  # end to end: runs the command on the model
def test_lossless_runs_without_output_options_and_prints_a_table(loaded, tmp_path):
    # the README's form: no --json needed, a readable table on standard output
    res = CliRunner().invoke(command, ["--tokens", "32", "--length", "32", "--no-embedded"])
    assert res.exit_code == 0, res.output
    assert "| stream | ratio |" in res.output and "| K+V (tables counted) |" in res.output
    assert "bit-exact: 60 tensors" in res.output and "MB/s per core" in res.output


def test_per_core_decode_timing_counts_every_blob():
    import torch

    import kvzip_lossless as kl
    from kvzip_eval.cmd_lossless import decode_MBps_per_core

    xs = [
        torch.randn(64, 3, 64, generator=torch.Generator().manual_seed(i)).bfloat16()
        for i in (0, 1)
    ]
    threads = torch.get_num_threads()
    mbps, n, passes = decode_MBps_per_core([kl.compress(x) for x in xs], None, passes=2)
    assert n == sum(x.numel() * 2 for x in xs) and mbps > 0
    assert len(passes) == 2 and mbps == max(passes)  # the best of the timed passes
    with pytest.raises(ValueError, match="passes must be >= 1"):
        decode_MBps_per_core([kl.compress(xs[0])], None, passes=0)
    assert torch.get_num_threads() == threads  # restored
