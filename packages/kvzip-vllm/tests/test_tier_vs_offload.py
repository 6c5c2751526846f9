"""benchmarks/tier_vs_offload.py's parts without vLLM: the workload (its prompts, shared
prefixes, distinct pages and the CPU bytes that make the working set 1.3x a raw tier), the
rows and the goals built from engines' results, and the markdown beside them; and its block
checker (``tier_vs_offload_verify``) around the tier's CPU worker."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import tier_vs_offload as tvo  # noqa: E402

SMOL = {  # SmolLM2-135M's attention geometry
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "hidden_size": 576,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
}


def test_kv_bytes_per_token_of_the_two_models():
    assert tvo.kv_bytes_per_token(tvo.LLAMA31_8B) == 32 * 8 * 128 * 2 * 2 == 131072
    assert tvo.kv_bytes_per_token(SMOL) == 30 * 3 * 64 * 2 * 2 == 23040


def test_prompts_are_whole_chunks_plus_one_token_and_bad_contexts_are_refused():
    assert tvo.prompt_tokens(8192) == 8192 - 256 + 1
    assert (tvo.prompt_tokens(8192) - 1) % tvo.CHUNK == 0
    for bad in (100, 256, 8200):
        with pytest.raises(tvo.WorkloadError, match="multiples of 256"):
            tvo.prompt_tokens(bad)


def test_workload_pairs_share_half_their_prompt_and_nothing_else():
    ps = tvo.build_workload({1024: (2, 1), 2048: (0, 2)}, vocab=1000, seed=3)
    assert [p.name for p in ps] == [
        "1024-pair0a", "1024-pair0b", "1024-pair1a", "1024-pair1b", "1024-own0",
        "2048-own0", "2048-own1",
    ]  # fmt: skip
    a, b = ps[0].tokens, ps[1].tokens
    assert a[:512] == b[:512] and a[512:] != b[512:]
    assert a[:512] != ps[2].tokens[:512]  # the pairs' prefixes differ
    assert all(len(p.tokens) == tvo.prompt_tokens(p.context) for p in ps)
    assert all(10 <= t < 990 for p in ps for t in p.tokens)
    # deterministic in the seed, and another seed draws other tokens
    assert tvo.build_workload({1024: (2, 1)}, 1000, 3) == ps[:5]
    assert tvo.build_workload({1024: (2, 1)}, 1000, 4)[0].tokens != a


def test_distinct_tokens_counts_a_shared_prefix_once():
    ps = tvo.build_workload({1024: (1, 1)}, vocab=1000, seed=0)
    n = tvo.prompt_tokens(1024)  # 769: 48 whole blocks of 16
    whole = n // 16 * 16
    # the pair: 512 shared tokens once, each prompt's other whole blocks; the own prompt
    assert tvo.distinct_tokens(ps) == 512 + 2 * (whole - 512) + whole
    # a prompt given twice adds nothing; a block equal in content at another depth counts
    assert tvo.distinct_tokens([ps[2], ps[2]]) == whole
    same = tvo.Prompt("x", 1024, "unshared", tuple([7] * 64))
    assert tvo.distinct_tokens([same]) == 64


def test_cpu_bytes_make_the_working_set_the_given_ratio_of_a_raw_tier():
    plan = tvo.PLANS["8b"]
    ms = tvo.model_setup("8b", tvo.LLAMA31_8B, plan, 1.3, seed=0)
    bpt = 131072
    assert ms["working_set_bytes"] == ms["distinct_tokens"] * bpt
    # raw pages of the working set = 1.3x the CPU bytes (to the byte's rounding)
    assert ms["working_set_bytes"] / ms["cpu_bytes"] == pytest.approx(1.3, rel=1e-9)
    assert ms["working_set_ratio"] == 1.3
    # a raw tier of these bytes holds fewer tokens than the working set; one 1.5x denser holds all
    raw_capacity = ms["cpu_bytes"] // bpt
    assert raw_capacity < ms["distinct_tokens"] <= 1.5 * raw_capacity
    # the 8B plan: 8k, 32k and 128k, shared and unshared prompts
    assert set(ms["plan"]) == {"8192", "32768", "131072"}
    with pytest.raises(tvo.WorkloadError, match="must be > 0"):
        tvo.cpu_bytes_for(100, 0)


def test_a_model_skips_contexts_beyond_its_positions():
    ms = tvo.model_setup("smollm2", SMOL, {8192: (1, 1), 32768: (1, 1)}, 1.3, seed=0)
    assert ms["plan"] == {"8192": [1, 1]}
    assert ms["skipped"] == ["32768 (beyond 8192 positions)"]
    with pytest.raises(tvo.WorkloadError, match="no context fits"):
        tvo.model_setup("smollm2", SMOL, {32768: (1, 1)}, 1.3, seed=0)


def test_returning_passes_are_shuffled_permutations_the_same_for_every_engine():
    a = tvo.passes(10, 3, seed=5)
    assert a == tvo.passes(10, 3, seed=5)
    assert all(sorted(p) == list(range(10)) for p in a)
    assert a[0] != a[1]
    assert tvo.batches(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]
    with pytest.raises(tvo.WorkloadError, match="concurrency 0"):
        tvo.batches([1], 0)


def test_percentile_interpolates_as_numpy():
    np = pytest.importorskip("numpy")
    xs = [0.3, 0.1, 0.7, 0.2, 0.9]
    for q in (50, 90, 10):
        assert tvo.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert tvo.percentile([], 50) is None


def _engine(conn, ttfts, *, held, used, dropped=0, exact=None, first=1, cached=None):
    returns = []
    for i, (ctx, t) in enumerate(ttfts):
        n = tvo.prompt_tokens(ctx)
        returns.append(
            {
                "prompt": f"p{i}",
                "pass": 0,
                "context": ctx,
                "tokens": n,
                "ttft_s": t,
                "cached_tokens": (n - 1) if cached is None else cached,
                "first_token": first,
                "logprob": -1.0,
            }
        )
    tier = {"tokens_held": held, "bytes_used": used, "stores_dropped": dropped, "bit_exact": exact}
    if held and used:
        tier["tokens_per_byte_used"] = held / used
    return {
        "model": "8b",
        "connector": conn,
        "cpu_bytes": 0 if conn == "none" else 10_000,
        "working_set_over_cpu_bytes": None if conn == "none" else 1.3,
        "tier": tier,
        "returns": returns,
    }


def _engines(kvzip_ttft=0.08, kvzip_density=(150, 10_000), dropped=0):
    traffic = [(32768, 0.10), (32768, 0.12), (131072, 0.30), (131072, 0.40)]
    return [
        _engine("offload", traffic, held=100, used=10_000),
        _engine(
            "kvzip",
            [(c, t * kvzip_ttft / 0.1) for c, t in traffic],
            held=kvzip_density[0],
            used=kvzip_density[1],
            dropped=dropped,
            exact=True,
        ),
        _engine("none", [(c, 5 * t) for c, t in traffic], held=0, used=0, cached=0, first=2),
    ]


def test_rows_per_context_and_connector_and_one_for_the_whole_workload():
    rows = tvo.build_rows(_engines())
    assert {(r["context"], r["connector"]) for r in rows} == {
        (c, k) for c in (32768, 131072, "all") for k in ("offload", "kvzip", "none")
    }
    off = tvo._find(rows, "8b", 32768, "offload")
    assert off["n"] == 2 and off["ttft_p50_s"] == pytest.approx(0.11)
    assert off["ttft_p90_s"] == pytest.approx(0.118)
    assert off["hit_rate"] == 1.0 and off["first_token_equal_none"] == 0.0
    every = tvo._find(rows, "8b", "all", "offload")
    assert every["n"] == 4 and every["ttft_mean_s"] == pytest.approx(0.23)
    none = tvo._find(rows, "8b", "all", "none")
    assert none["hit_rate"] == 0.0 and none["first_token_equal_none"] is None
    for r in rows:
        for key in ("context", "connector", "ttft_p50_s", "ttft_p90_s", "tokens_held",
                    "cpu_bytes", "stores_dropped", "bit_exact", "model", "hit_rate",
                    "ttft_mean_s", "n"):  # fmt: skip
            assert key in r


def _met(goals):
    return {(g["goal"], g["context"]): g["met"] for g in goals}


def test_goals_met_and_missed():
    met = _met(tvo.evaluate_goals(tvo.build_rows(_engines())))
    assert met == {
        ("ttft_p50_kvzip_over_offload", 32768): True,  # 0.8x
        ("ttft_p50_kvzip_over_offload", 131072): True,
        ("tokens_per_cpu_byte_kvzip_over_offload", "all"): True,  # 1.5x
        ("kvzip_stores_dropped", "all"): True,
        ("ttft_mean_kvzip_over_offload", "all"): False,  # 0.8x > 0.7x
        ("kvzip_bit_exact", "all"): True,
    }
    missed = _met(
        tvo.evaluate_goals(
            tvo.build_rows(_engines(kvzip_ttft=0.095, kvzip_density=(140, 10_000), dropped=3))
        )
    )
    assert missed[("ttft_p50_kvzip_over_offload", 32768)] is False  # 0.95x
    assert missed[("tokens_per_cpu_byte_kvzip_over_offload", "all")] is False  # 1.4x
    assert missed[("kvzip_stores_dropped", "all")] is False
    fast = _met(tvo.evaluate_goals(tvo.build_rows(_engines(kvzip_ttft=0.05))))
    assert fast[("ttft_mean_kvzip_over_offload", "all")] is True  # 0.5x


def test_a_missing_engine_leaves_its_goals_undecided():
    engines = [e for e in _engines() if e["connector"] != "offload"]
    engines.append({"model": "8b", "connector": "offload", "cpu_bytes": 1, "error": "rc 1"})
    goals = tvo.evaluate_goals(tvo.build_rows(engines))
    by = _met(goals)
    assert by[("ttft_p50_kvzip_over_offload", 32768)] is None
    assert by[("ttft_mean_kvzip_over_offload", "all")] is None
    assert by[("kvzip_stores_dropped", "all")] is True  # kvzip's own


def test_markdown_names_settings_rows_goals_and_failures(tmp_path):
    engines = _engines()
    engines.append({"model": "smollm2", "connector": "kvzip", "cpu_bytes": 1, "error": "boom"})
    rows = tvo.build_rows(engines)
    doc = {
        "device": "NVIDIA H200",
        "date": "2026-12-02T00:00:00Z",
        "vllm": "0.26.0",
        "torch": "2.11",
        "python": "3.12",
        "command": "python tier_vs_offload.py",
        "settings": {"eager": True, "gpu_slack_tokens": 4096, "repeats": 2, "concurrency": 4},
        "models": [tvo.model_setup("8b", tvo.LLAMA31_8B, {8192: (1, 1)}, 1.3, 0)],
        "rows": rows,
        "goals": tvo.evaluate_goals(rows),
        "engines": engines,
    }
    p = tmp_path / "t.md"
    tvo.write_md(p, doc)
    text = p.read_text()
    assert "async_scheduling=False, VLLM_USE_V2_MODEL_RUNNER=0, eager" in text
    table = [line for line in text.splitlines() if line.startswith("| 8b |")]
    assert len(table) == 9  # 3 contexts (32k, 128k, all) x 3 connectors
    assert "| ttft_mean_kvzip_over_offload | 8b | all | 0.8 | <= 0.7 | False |" in text
    assert "smollm2 kvzip: 'boom'" in text
    json.dumps(doc)  # the JSON side serialises
    # a kvzip engine with hook times: its hooks, slowest first, and its loads' parts
    kv = next(e for e in engines if e["connector"] == "kvzip" and "error" not in e)
    kv["tier"] = dict(
        kv.get("tier") or {},
        check={"hook_seconds": {"start_load_kv": 2.5, "checker": 0.25},
               "hook_calls": {"start_load_kv": 51}},
        stats_end={"restore_seconds": 1.3, "load_submit_seconds": 0.2,
                   "load_host_seconds": 0.1, "load_wait_seconds": 0.9},
    )  # fmt: skip
    tvo.write_md(p, doc)
    text = p.read_text()
    assert "- 8b: start_load_kv 2.500 s (51), checker 0.250 s (-)" in text
    assert (
        "restore 1.300 s (start of the step's loads to the end of their wait), of which "
        "submit 0.200 s, host start 0.100 s, wait 0.900 s" in text
    )


def test_the_checker_counts_every_restored_block_and_catches_a_changed_byte():
    """``tier_vs_offload_verify.CheckingKvzipConnector`` around the CPU worker (chunks of 2
    blocks): a chunk stored, restored into other blocks (equal, the block vLLM already holds
    not checked), then restored again with one byte of one layer changed after the tier wrote
    it: that block, and only it, differs."""
    pytest.importorskip("vllm", reason="the connector needs vLLM")
    import torch
    from test_connector_units import BS, _caches, _worker
    from tier_vs_offload_verify import CheckingKvzipConnector

    from kvzip_vllm.tier.metadata import KvzipConnectorMetadata, Load, Store

    conn = object.__new__(CheckingKvzipConnector)  # the worker half alone, no vLLM config
    conn.worker = _worker(chunk_tokens=2 * BS)
    conn._connector_metadata = None
    conn._c_init()
    conn.SEGMENT_ROWS = 3  # the second chunk stored spans two segments of the reference bank
    caches = _caches(5)
    conn.register_kv_caches(caches)
    key = bytes([7]) * 32

    def step(damage=None, **kw):
        conn.bind_connector_metadata(KvzipConnectorMetadata(**kw))
        conn.start_load_kv(None)
        if damage is not None:  # as if the restore had written a wrong byte
            caches["model.layers.1.self_attn.attn"][damage].view(torch.uint8)[0, 0, 3] ^= 1
        conn.wait_for_save()
        if conn.worker._background is not None:  # the CPU tier codes stores off the step
            assert conn.worker._background.drain(60)
        errors = conn.get_block_ids_with_load_errors()
        report = conn.build_connector_worker_meta()
        conn.clear_connector_metadata()
        return errors, report

    _, report = step(stores=[Store("a", key, (0, 1), 0)])
    assert report.stored == [key]
    assert conn.counts()["chunks_copied"] == 1
    errors, _ = step(loads=[Load("b", key, (4, 5), 0, 1)], seen_report=1)  # block 4 held
    assert errors == set()
    c = conn.counts()
    assert {k: c[k] for k in list(c)[:5]} == {
        "blocks_checked": 1,
        "blocks_differ": 0,
        "blocks_equal": 1,
        "restored_blocks_without_copy": 0,
        "chunks_copied": 1,
    }
    # every hook the steps called is timed: the tier's part and the checker's apart
    assert c["hook_calls"]["start_load_kv"] >= 2 and c["hook_calls"]["wait_for_save"] >= 2
    assert c["hook_seconds"]["checker"] > 0
    errors, _ = step(loads=[Load("c", key, (8, 9), 0)], seen_report=1, damage=9)
    c = conn.counts()
    assert errors == set() and c["blocks_checked"] == 3 and c["blocks_differ"] == 1
    # a chunk the tier does not hold fails its load (vLLM recomputes it): nothing to check
    errors, _ = step(loads=[Load("d", bytes([8]) * 32, (10, 11), 0)], seen_report=1)
    assert errors == {10, 11} and conn.counts()["blocks_checked"] == 3
    # a second chunk stored (rows 2, 3) adds a segment; the first chunk's rows stay where they are
    key2 = bytes([9]) * 32
    _, report = step(stores=[Store("e", key2, (2, 3), 0)], seen_report=1)
    assert conn.counts()["chunks_copied"] == 2 and len(conn._c_bank) == 2
    errors, _ = step(loads=[Load("f", key, (6, 7), 0), Load("g", key2, (10, 11), 0)], seen_report=2)
    c = conn.counts()
    assert errors == set() and c["blocks_checked"] == 7 and c["blocks_differ"] == 1
    # a wrong byte in a block whose reference lies in the second segment is caught there too
    errors, _ = step(loads=[Load("h", key2, (0, 1), 0)], seen_report=2, damage=1)
    c = conn.counts()
    assert errors == set() and c["blocks_checked"] == 9 and c["blocks_differ"] == 2
    # the steps' timeline: one row per step, its chunks loaded, host times in order
    assert [x["loads"] for x in c["steps"]] == [0, 1, 1, 1, 0, 2, 1]
    assert all(x["load"] >= 0 and x["forward"] >= 0 and x["after"] >= 0 for x in c["steps"])
    assert c["steps"][-1]["rest"] is None and all(x["rest"] >= 0 for x in c["steps"][:-1])
