"""``kvzip bench restore`` end to end: the tier's core (kvzip-vllm, no vLLM) stores a prompt and
restores it, timed beside a raw copy; on the CPU (tiny shape) and, marked gpu, on CUDA at the
8B shape. A row is reported only if every restored block equals its source bit for bit. Here,
not in kvzip-eval's tests: the command needs the tier's core, and kvzip-vllm's environment
holds every package (kvzip-eval does not require kvzip-vllm)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from kvzip_eval.bench import restore
from kvzip_eval.cli import main

FIELDS = ("tokens", "raw_bytes", "stored_bytes", "ratio", "store_s", "restore_s_p50",
          "restore_s_min", "restore_s_max", "raw_copy_s_p50", "raw_copy_s_min",
          "raw_copy_s_max", "restore_vs_raw", "restore_gbps", "bit_exact")  # fmt: skip


def invoke(args):
    return CliRunner().invoke(main, ["bench", "restore", *args], catch_exceptions=False)


def check_rows(doc, contexts, shape):
    layers, heads, head = restore.SHAPES[shape]
    assert doc["result"] == "bench-restore" and doc["command"]
    assert [r["tokens"] for r in doc["rows"]] == contexts
    for r in doc["rows"]:
        assert set(FIELDS) <= set(r)
        assert r["bit_exact"] is True
        assert r["raw_bytes"] == r["tokens"] * layers * 2 * heads * head * 2
        # KV-like values (per-channel scale and offset) compress
        assert 0 < r["stored_bytes"] < r["raw_bytes"] and r["ratio"] > 1.05
        assert r["ratio"] == pytest.approx(r["raw_bytes"] / r["stored_bytes"], rel=1e-3)
        assert r["restore_s_min"] <= r["restore_s_p50"] <= r["restore_s_max"]
        assert r["raw_copy_s_min"] <= r["raw_copy_s_p50"] <= r["raw_copy_s_max"]
        assert 0 < r["restore_s_min"] and 0 < r["raw_copy_s_min"] and r["store_s"] > 0
        # the ratios come from the unrounded times: within what the times' rounding to the
        # microsecond allows (a raw copy of the tiny shape takes tens of microseconds on a CPU)
        r50, c50, h = r["restore_s_p50"], r["raw_copy_s_p50"], 5e-7
        assert (r50 - h) / (c50 + h) - 5e-5 <= r["restore_vs_raw"] <= (r50 + h) / (c50 - h) + 5e-5
        gb = r["raw_bytes"] / 1e9
        assert gb / (r50 + h) - 5e-4 <= r["restore_gbps"] <= gb / (r50 - h) + 5e-4
    assert "synthetic" in doc["data"] and "depends on the data" in doc["data"]


def test_connector_defaults_kept_here():
    """The command makes the tier as the connector does: its table fit and switch interval
    (kept in restore.py for installs without pydantic), its chunk."""
    from kvzip_vllm.settings import ConnectorSettings

    s = ConnectorSettings()
    assert restore.FIT_TOKENS == s.fit_tokens
    assert restore.SWITCH_INTERVAL_S == s.switch_interval_s
    assert restore.default_chunk_tokens() == s.chunk_tokens


def test_bench_restore_on_the_cpu(tmp_path):
    """The whole command on the tiny shape: a row per context, bit-exact, compressed, with
    its timings; json, md and the plot written."""
    out = tmp_path / "r"
    res = invoke(["--shape", "tiny", "--contexts", "256,1024", "--repeats", "3",
                  "--device", "cpu", "--seed", "3", "--out", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "1024 tokens: ratio" in res.output and "bit-exact" in res.output
    doc = json.loads((out / "bench_restore.json").read_text())
    check_rows(doc, [256, 1024], "tiny")
    s = doc["settings"]
    assert (s["shape"], s["block_size"], s["chunk_tokens"], s["repeats"], s["device"]) == (
        "tiny", 16, 256, 3, "cpu")  # fmt: skip
    assert doc["rows"][1]["chunks"] == 4
    assert not any("profile" in r for r in doc["rows"]) and s["profile"] is False
    md = (out / "bench_restore.md").read_text()
    assert "| tokens | raw bytes | stored bytes | ratio |" in md
    assert "| 1024 | 2,097,152 |" in md and "synthetic" in md and "bit for bit" in md
    for key in ("device", "date", "versions", "command"):
        assert f"- {key}: " in md
    if doc.get("plot"):
        assert (out / "bench_restore.png").read_bytes()[:4] == b"\x89PNG"


def test_profile_adds_one_checked_restore_per_context_and_where_its_time_went(tmp_path):
    """``--profile``: one more restore per context under torch's profiler, checked bit for
    bit like the timed ones; its operators (CPU) listed longest first, at most PROFILE_TOP;
    the timed rows as without it."""
    out = tmp_path / "p"
    res = invoke(["--shape", "tiny", "--contexts", "512", "--repeats", "1", "--device", "cpu",
                  "--profile", "--out", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "bench_restore.json").read_text())
    check_rows(doc, [512], "tiny")
    assert doc["settings"]["profile"] is True
    p = doc["rows"][0]["profile"]
    assert p["clock"] == "cpu" and p["wall_s"] > 0 and p["copies_s"] == 0
    top = p["top"]
    assert 0 < len(top) <= restore.PROFILE_TOP
    assert [e["s"] for e in top] == sorted((e["s"] for e in top), reverse=True)
    assert all(e["count"] >= 1 and e["s"] > 0 for e in top)
    # the listed operators are some of all those timed (own times, every thread)
    assert sum(e["s"] for e in top) <= p["other_s"] + 1e-5
    assert any(e["name"].startswith("aten::") for e in top)
    md = (out / "bench_restore.md").read_text()
    assert "under torch's profiler (cpu time" in md and "- 512 tokens: wall " in md


@pytest.mark.parametrize(
    "args,words",
    [
        (["--contexts", "256,1000"], ["1000", "not a multiple of the block size 16",
                                      "multiples of the block size (16)"]),
        (["--contexts", "272"], ["272", "chunk (256 tokens"]),
        (["--shape", "70b"], ["'70b'", "8b, smollm2, tiny"]),
        (["--block-size", "24"], ["multiple of the block size 24"]),
    ],
)  # fmt: skip
def test_bad_options_are_refused_naming_what_is_supported(tmp_path, args, words):
    out = tmp_path / "r"
    res = invoke(["--shape", "tiny", "--device", "cpu", *args, "--out", str(out)])
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    for w in words:
        assert w in text, (w, text)
    assert not out.exists()


def test_a_cache_too_large_for_the_gpu_names_need_and_free(monkeypatch):
    """The memory check: what the context needs (and of what), and what is free."""
    free = [8 << 30]
    fake = type("T", (), {"cuda": type("C", (), {
        "mem_get_info": staticmethod(lambda device: (free[0], 80 << 30))})})  # fmt: skip
    need = restore.memory_needs("8b", 131072, 16, 256)
    assert need["cache"] == 2 * 131072 * 32 * 2 * 8 * 128 * 2
    monkeypatch.setattr(restore, "host_available", lambda: None)
    with pytest.raises(ValueError) as e:
        restore.check_memory(fake, torch.device("cuda"), "8b", 131072, 16, 256)
    msg = str(e.value)
    assert f"needs {need['gpu_total'] / 1e9:.2f} GB of GPU memory" in msg
    assert "34.36 GB" in msg and "8.59 GB of 85.90 GB is free" in msg
    restore.check_memory(fake, torch.device("cuda"), "tiny", 1024, 16, 256)  # fits
    free[0] = 200 << 30
    restore.check_memory(fake, torch.device("cuda"), "8b", 131072, 16, 256)  # fits
    monkeypatch.setattr(restore, "host_available", lambda: 1 << 30)
    with pytest.raises(ValueError, match="GB of host memory"):
        restore.check_memory(fake, torch.device("cuda"), "8b", 131072, 16, 256)


def test_the_bit_exact_check_catches_one_altered_value():
    phys, _ = restore.paged_cache(torch, "tiny", 8, 16, "cpu")
    restore.fill_kv(torch, phys, 4, seed=1)
    phys[:, 4:] = phys[:, :4]
    restore.check_bit_exact(torch, phys, slice(0, 4), slice(4, 8), "copy")
    assert restore.mismatches(torch, phys, slice(0, 4), slice(4, 8)) == []
    bits = phys.view(torch.int16)
    bits[2, 6, 3, 1, 5] ^= 1  # one bit of one value of layer 2's destination block 6
    assert restore.mismatches(torch, phys, slice(0, 4), slice(4, 8)) == [(2, 1)]
    with pytest.raises(restore.RestoreBenchError, match="layer 2: 1 of"):
        restore.check_bit_exact(torch, phys, slice(0, 4), slice(4, 8), "copy")
    bits[2, 6, 3, 1, 5] ^= 1
    # -0.0 and +0.0 compare equal as numbers, not as bits
    phys[0, 0, 0, 0, 0], phys[0, 4, 0, 0, 0] = 0.0, -0.0
    assert restore.mismatches(torch, phys, slice(0, 4), slice(4, 8)) == [(0, 1)]


def test_a_damaged_record_is_never_reported(tmp_path, monkeypatch):
    """A stored record damaged in the arena (one byte of a blob flipped): the restore fails
    that chunk's blocks and the command fails without writing a result."""
    stored = restore.store_prompt

    def store_then_damage(pipe, store, keys, src_chunks, step_chunks):
        stored(pipe, store, keys, src_chunks, step_chunks)
        blobs, _, _ = store.get_entry(keys[-1])
        bad = np.frombuffer(blobs[3], np.uint8)  # layer 1's V, in the arena
        bad[len(bad) - 6] ^= 0x5A

    monkeypatch.setattr(restore, "store_prompt", store_then_damage)
    out = tmp_path / "r"
    res = invoke(["--shape", "tiny", "--contexts", "512", "--repeats", "1", "--device", "cpu",
                  "--out", str(out)])  # fmt: skip
    assert res.exit_code == 1, res.output
    assert "the restore failed 16 blocks" in res.output and "not reported" in res.output
    assert not (out / "bench_restore.json").exists()


def test_a_restore_that_differs_is_never_reported(tmp_path, monkeypatch):
    """Restored blocks that pass the tier's checksums but differ from the source (one value
    altered after the restore): the bit-exact check stops the command."""
    real = restore.restore_prompt

    def restore_then_alter(torch_, pipe, loads):
        got = real(torch_, pipe, loads)
        pipe.caches[1][loads[0][2][0], 0, 0, 0] += 1  # layer 1, the first restored block
        return got

    monkeypatch.setattr(restore, "restore_prompt", restore_then_alter)
    out = tmp_path / "r"
    res = invoke(["--shape", "tiny", "--contexts", "256", "--repeats", "1", "--device", "cpu",
                  "--out", str(out)])  # fmt: skip
    assert res.exit_code == 1, res.output
    assert "restore 0" in res.output and "layer 1: 1 of" in res.output
    assert not (out / "bench_restore.json").exists()


@pytest.mark.gpu
def test_bench_restore_on_cuda_8b(tmp_path):
    """The 8B shape at 8,192 tokens on the GPU: bit-exact, compressed, timed; profiled, its
    device time split into the copies of the records and the rest (the decode, the scatter)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = tmp_path / "r"
    res = invoke(["--shape", "8b", "--contexts", "8192", "--repeats", "3", "--device", "cuda",
                  "--profile", "--out", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "bench_restore.json").read_text())
    check_rows(doc, [8192], "8b")
    assert doc["settings"]["device"].startswith("cuda") and "CPU" not in doc["device"]
    r = doc["rows"][0]
    assert r["chunks"] == 32 and r["raw_bytes"] == 8192 * 131072
    p = r["profile"]
    # the records' bytes cross the link: at most ~64 GB/s, so the copies take real time
    assert p["clock"] == "device" and p["copies_s"] > r["stored_bytes"] / 100e9
    assert p["other_s"] > 0 and any(e["name"].startswith("Memcpy") for e in p["top"])
