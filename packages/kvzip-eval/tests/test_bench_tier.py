"""``kvzip bench tier`` without vLLM: its workload (prompts, shared prefixes, distinct pages,
the CPU bytes of each workload), the user's prompts, the rows beside offload and recompute, the
result files and the plot. The run in vLLM: kvzip-vllm's tests/test_bench_vllm.py."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvzip_eval.bench import connectors as cn
from kvzip_eval.bench import output
from kvzip_eval.bench import tier as tb
from kvzip_eval.bench.engines import LLAMA31_8B, kv_bytes_per_token
from kvzip_eval.cli import main

SMOL = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "hidden_size": 576, "vocab_size": 49152, "max_position_embeddings": 8192}  # fmt: skip


def test_kv_bytes_per_token_and_prompt_lengths():
    assert kv_bytes_per_token(LLAMA31_8B) == 32 * 8 * 128 * 2 * 2 == 131072
    assert kv_bytes_per_token(SMOL) == 30 * 3 * 64 * 2 * 2 == 23040
    assert tb.prompt_tokens(8192) == 8192 - 256 + 1
    for bad in (100, 256, 8200):
        with pytest.raises(tb.WorkloadError, match="multiples of 256"):
            tb.prompt_tokens(bad)


def test_workload_pairs_share_half_their_prompt_and_distinct_pages_count_once():
    ps = tb.build_workload({1024: (2, 1), 2048: (0, 2)}, vocab=1000, seed=3)
    assert [p.name for p in ps] == ["1024-pair0a", "1024-pair0b", "1024-pair1a", "1024-pair1b",
                                    "1024-own0", "2048-own0", "2048-own1"]  # fmt: skip
    a, b = ps[0].tokens, ps[1].tokens
    assert a[:512] == b[:512] and a[512:] != b[512:] and a[:512] != ps[2].tokens[:512]
    assert all(len(p.tokens) == tb.prompt_tokens(p.context) for p in ps)
    assert tb.build_workload({1024: (2, 1)}, 1000, 3) == ps[:5]
    one = tb.build_workload({1024: (1, 1)}, vocab=1000, seed=0)
    whole = tb.prompt_tokens(1024) // 16 * 16
    assert tb.distinct_tokens(one, 16) == 512 + 2 * (whole - 512) + whole
    assert tb.distinct_tokens([one[2], one[2]], 16) == whole
    assert tb.cpu_bytes_for(1300, 1.3) == 1000 and tb.cpu_bytes_for(750, 0.75) == 1000
    with pytest.raises(tb.WorkloadError, match="must be > 0"):
        tb.cpu_bytes_for(100, 0)
    a = tb.passes(10, 3, seed=5)
    assert a == tb.passes(10, 3, seed=5) and all(sorted(p) == list(range(10)) for p in a)
    assert tb.batches(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]


def test_user_prompts_are_grouped_by_the_power_of_two_above_them(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt_token_ids": [5, 6, 7]}\n\n{"name": "doc", "prompt_token_ids": '
                 + json.dumps(list(range(1, 1001))) + "}\n")  # fmt: skip
    got = tb.read_prompts(str(p), None, 4096)
    assert [(x.name, x.context, len(x.tokens)) for x in got] == [
        ("user0", 4, 3),
        ("doc", 1024, 1000),
    ]
    p.write_text('{"prompt": "hello"}\n')
    with pytest.raises(tb.WorkloadError, match="need --model"):
        tb.read_prompts(str(p), None, 4096)
    p.write_text('{"prompt_token_ids": ' + json.dumps(list(range(50))) + "}\n")
    with pytest.raises(tb.WorkloadError, match="50 tokens"):
        tb.read_prompts(str(p), None, 40)


def _engine(conn, workload, ttfts, *, held, used, exact=None, first=1, cached=None):
    returns = [{"prompt": f"p{i}", "pass": 0, "context": c, "tokens": tb.prompt_tokens(c),
                "ttft_s": t, "first_token": first,
                "cached_tokens": tb.prompt_tokens(c) - 1 if cached is None else cached}
               for i, (c, t) in enumerate(ttfts)]  # fmt: skip
    # each context's prompts once more alone, at half their time in the pass
    returns += [{**q, "pass": "alone", "ttft_s": q["ttft_s"] / 2} for q in list(returns)]
    tier = {"tokens_held": held, "bytes_used": used, "stores_dropped": 0, "bit_exact": exact,
            "load_errors": 0 if conn == "kvzip" else None}  # fmt: skip
    if held and used:
        tier["tokens_per_byte_used"] = held / used
    return {"workload": workload, "connector": conn, "cpu_bytes": 0 if conn == "none" else 10_000,
            "tier": tier, "returns": returns}  # fmt: skip


def _engines():
    traffic = [(1024, 0.10), (1024, 0.12), (2048, 0.30), (2048, 0.40)]
    return [
        _engine("none", "-", [(c, 5 * t) for c, t in traffic], held=0, used=0, cached=0, first=2),
        _engine("offload", "restore", traffic, held=100, used=10_000),
        _engine(
            "kvzip",
            "restore",
            [(c, t * 0.8) for c, t in traffic],
            held=150,
            used=10_000,
            exact=True,
        ),  # fmt: skip
        _engine("kvzip", "capacity", traffic, held=150, used=10_000, exact=True),
        {"workload": "capacity", "connector": "offload", "cpu_bytes": 1, "error": "rc 1"},
    ]


def test_tier_rows_per_workload_context_and_connector_beside_offload():
    rows = tb.build_rows(_engines())
    keys = {(r["workload"], r["context"], r["connector"]) for r in rows}
    assert keys == {(w, c, k) for w in ("restore", "capacity") for c in (1024, 2048, "all")
                    for k in ("none", "kvzip")} | {
        ("restore", c, "offload") for c in (1024, 2048, "all")}  # fmt: skip

    def row(w, c, k):
        return next(r for r in rows if (r["workload"], r["context"], r["connector"]) == (w, c, k))

    off = row("restore", 1024, "offload")
    assert off["n"] == 2 and off["ttft_p50_s"] == pytest.approx(0.11)
    # the lone returns: their own column, not in the pass's figures or the "all" row's
    assert off["ttft_alone_s"] == pytest.approx(0.055) and off["ttft_alone_vs_offload"] == 1.0
    assert row("restore", 2048, "kvzip")["ttft_alone_vs_offload"] == pytest.approx(0.8)
    assert row("restore", "all", "offload")["n"] == 4
    assert row("restore", "all", "offload")["ttft_alone_s"] is None
    assert off["ttft_p90_s"] == pytest.approx(0.118) and off["hit_rate"] == 1.0
    assert off["first_token_equal_none"] == 0.0 and off["ttft_p50_vs_offload"] == 1.0
    kv = row("restore", "all", "kvzip")
    assert kv["ttft_mean_vs_offload"] == 0.8 and kv["tokens_per_byte_vs_offload"] == 1.5
    assert kv["bit_exact"] is True and kv["load_errors"] == 0
    assert row("capacity", "all", "kvzip")["ttft_p50_vs_offload"] is None  # offload failed
    none = row("capacity", "all", "none")
    assert none["hit_rate"] == 0.0 and none["first_token_equal_none"] is None


def test_tier_result_files_and_plot(tmp_path):
    engs = _engines()
    engs[2]["tier"]["stats_end"] = {"restore_seconds": 1.2866, "load_host_seconds": 1.2413,
                                    "load_jobs_async": 14, "load_jobs_merged": 3}  # fmt: skip
    rows = tb.build_rows(engs)
    doc = output.header("tier", "tier", "cpu")
    doc.update(model="m", prompts="synthetic", rows=rows, engines=engs,
               settings={"repeats": 1},
               workload={"prompts": 4, "contexts": [1024, 2048], "kv_bytes_per_token": 8,
                         "working_set_bytes": 1000, "cpu_bytes": {"restore": 1333},
                         "working_set_over_cpu_bytes": {"restore": 0.75}})  # fmt: skip
    paths = output.write(tmp_path, "bench_tier", doc, tb._markdown(doc),
                         lambda ax: tb._plot(ax, rows))  # fmt: skip
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    md = paths["md"].read_text()
    assert "| restore | all | kvzip | 4 | 0.168 | 0.296 | 0.184 | 0.8 | - | - | 1 | 150 |" in md
    assert "| restore | 1024 | kvzip | 2 | 0.088 | 0.0944 | 0.088 | 0.8 | 0.044 | 0.8 | 1 |" in md
    assert "| 0.015 | 1.5 | 0 | 0 | True | 0 |" in md  # 1.5x offload's tokens per byte
    assert "did not start; error: 'rc 1'" in md
    assert "| kvzip | 1.287 | 1.241 | 14 | 3 | - | - | - | - |" in md  # where its time went


def test_bench_tier_help_says_what_it_measures():
    res = CliRunner().invoke(main, ["bench", "tier", "--help"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    for words in ("lossless tier beside vLLM's CPU offloading and recompute, same CPU bytes",
                  "time to first token p50/p90", "hit rate", "bit-exactness", "--prompts",
                  "--workloads"):  # fmt: skip
        assert words in text, words


def test_a_kvzip_variant_is_named_with_its_settings():
    assert cn.parse_connector("kvzip") == ("kvzip", {})
    assert cn.parse_connector("kvzip:load_mode=sync;switch_interval_s=0") == (
        "kvzip",
        {"load_mode": "sync", "switch_interval_s": 0},
    )
    assert cn.parse_connector("kvzip:stats_path=/tmp/a b") == ("kvzip", {"stats_path": "/tmp/a b"})
    assert cn.file_label("kvzip:load_mode=sync;switch_interval_s=0.0002") == (
        "kvzip-load_mode-sync-switch_interval_s-0.0002"
    )
    for bad, said in (("zip", "one of offload, kvzip, none"), ("offload:x=1", "only kvzip"),
                      ("kvzip:sync", "not KEY=VALUE"), ("kvzip:=1", "not KEY=VALUE")):  # fmt: skip
        with pytest.raises(cn.ConnectorError, match=said):
            cn.parse_connector(bad)


@pytest.mark.parametrize("sub", ["tier", "tier-decode"])
def test_bench_connectors_are_checked_before_any_engine_starts(sub):
    for arg, said in (("kvzip,zip", "one of offload, kvzip, none"),
                      ("kvzip,kvzip", "names a connector twice"),
                      ("kvzip:load_mode", "not KEY=VALUE")):  # fmt: skip
        res = CliRunner().invoke(main, ["bench", sub, "--connectors", arg])
        assert res.exit_code == 2 and said in " ".join(res.output.split()), res.output
    # (a variant's settings are checked by kvzip-vllm's: its tests/test_bench_vllm.py)
