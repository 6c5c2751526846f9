"""The benchmarks' one model and engine set-up: Llama-3.1-8B's shape (dummy weights) or the
user's checkpoint, the environment of an engine's process, vLLM's settings as the engine used
them, and the child processes that hold one engine each (the GPU is freed between engines).

Also imported by the GPU scripts under ``packages/*/benchmarks`` (one copy of the 8B config).
Only the standard library at import time; torch and vLLM are imported by the functions.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

#: Llama-3.1-8B's published config.json (shapes only; the weights are vLLM's dummy ones).
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "initializer_range": 0.02,
    "use_cache": True,
}

#: A two-layer Llama of the same kind, for a quick run (dummy weights).
TINY = dict(
    LLAMA31_8B,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    max_position_embeddings=4096,
    rope_scaling=None,
    bos_token_id=1,
    eos_token_id=2,
)

#: The environment of an engine's process (a value already set wins).
ENV = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # the engine in the benchmark's process: its hooks and counters are read in-process
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}

PACKAGES = ("kvzip-formats", "kvzip-kernels", "kvzip-lossless", "kvzip-vllm", "kvzip-eval")
#: a line a child process prints for its parent: ``BENCH {"kind": ..., ...}``
MARK = "BENCH "


def write_config(cfg: dict, folder: Path) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return str(folder)


def model_folder(model: str | None, root: Path, tiny: bool = False) -> tuple[dict, str, str]:
    """(config, folder, load_format): the user's checkpoint (a folder with config.json and its
    weights), else Llama-3.1-8B's shape (``tiny``: :data:`TINY`) with dummy weights, its config
    written under ``root``."""
    if model:
        cfg = json.loads((Path(model) / "config.json").read_text())
        return cfg, str(model), "auto"
    cfg = TINY if tiny else LLAMA31_8B
    return cfg, write_config(cfg, root / ("tiny-llama" if tiny else "llama31-8b-shape")), "dummy"


def kv_bytes_per_token(cfg: dict, dtype_bytes: int = 2) -> int:
    """Bytes of K and V per token: layers x KV heads x head dim x 2 x ``dtype_bytes``."""
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * heads * head_dim * 2 * dtype_bytes


def prompts(n: int, length: int, seed: int, vocab: int, fast: bool = False) -> list[dict]:
    """``n`` prompts of ``length`` random token ids (seeded). ``fast``: ``random.choices``,
    several times faster for the millions of tokens of a full cache (other tokens)."""
    rng = random.Random(seed)
    if fast:
        ids = range(100, vocab - 100)
        return [{"prompt_token_ids": rng.choices(ids, k=length)} for _ in range(n)]
    return [
        {"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(length)]}
        for _ in range(n)
    ]


def synthetic_calibration_dir(root: Path, cfg: dict) -> str:
    """Random but valid channel statistics at the model's shape (dummy weights have no real
    statistics; the decode work does not depend on them)."""
    from kvzip_kernels.testing import synthetic_calibration

    d = root / "calibration-synthetic"
    synthetic_calibration(
        cfg["num_key_value_heads"],
        cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        num_layers=cfg["num_hidden_layers"],
        num_q_heads=cfg["num_attention_heads"],
    ).save(d)
    return str(d)


def plugin_path(root: Path, extra: tuple[str, ...] = ()) -> str:
    """PYTHONPATH entries for an engine's process where the kvzip packages are not installed
    (a checkout on ``PYTHONPATH``): each package's src/ and a dist-info carrying kvzip's
    ``vllm.general_plugins`` entry point, then ``extra`` (e.g. a benchmarks folder). Where
    kvzip-vllm is installed, only ``extra``."""
    from importlib.metadata import entry_points

    if any(e.name == "kvzip" for e in entry_points(group="vllm.general_plugins")):
        return os.pathsep.join(extra)
    d = root / "kvzip-plugin"
    di = d / "kvzip_vllm_bench-0.dist-info"
    di.mkdir(parents=True, exist_ok=True)
    (di / "METADATA").write_text("Metadata-Version: 2.1\nName: kvzip-vllm-bench\nVersion: 0\n")
    (di / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nkvzip = kvzip_vllm.plugin:register\n"
    )
    src = Path(__file__).resolve().parents[4]  # packages/ of a checkout
    srcs = [str(src / p / "src") for p in PACKAGES if (src / p / "src").is_dir()]
    return os.pathsep.join([str(d), *extra, *srcs])


def child_env(root: Path, extra: dict | None = None) -> dict:
    """The environment of an engine's process: :data:`ENV` under the caller's own settings,
    the plugin path, ``extra`` (e.g. the kvzip format's variables) last."""
    env = dict(os.environ, **{k: os.environ.get(k, v) for k, v in ENV.items()})
    path = plugin_path(root)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def engine_settings(llm) -> dict:
    """What the engine runs with, read from its ``VllmConfig`` (vLLM's defaults included):
    ``config`` is the line vLLM logs at start-up ("... with config: ...")."""
    import vllm

    vc = llm.llm_engine.vllm_config
    cc, mc, sc = vc.cache_config, vc.model_config, vc.scheduler_config
    comp, kt = vc.compilation_config, vc.kv_transfer_config
    att = getattr(vc, "attention_config", None)

    def s(x):  # an enum by its name
        return None if x is None else str(getattr(x, "name", x))

    try:
        v2 = bool(vc.use_v2_model_runner)
    except Exception:  # noqa: BLE001 - a vLLM without the property: V1
        v2 = False
    return {
        "vllm": vllm.__version__,
        "async_scheduling": bool(getattr(sc, "async_scheduling", False)),
        "model_runner": "v2" if v2 else "v1",
        "compilation_mode": s(getattr(comp, "mode", getattr(comp, "level", None))),
        "cudagraph_mode": s(getattr(comp, "cudagraph_mode", None)),
        "cudagraph_capture_sizes": sorted(
            int(x) for x in (getattr(comp, "cudagraph_capture_sizes", None) or [])
        ),
        "enforce_eager": bool(mc.enforce_eager),
        "attention_backend": s(getattr(att, "backend", None)),
        "dtype": s(mc.dtype),
        "kv_cache_dtype": s(cc.cache_dtype),
        "block_size": cc.block_size,
        "num_gpu_blocks": cc.num_gpu_blocks,
        "enable_prefix_caching": bool(cc.enable_prefix_caching),
        "gpu_memory_utilization": cc.gpu_memory_utilization,
        "kv_cache_memory_bytes": getattr(cc, "kv_cache_memory_bytes", None),
        "max_model_len": mc.max_model_len,
        "max_num_seqs": sc.max_num_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "tensor_parallel_size": vc.parallel_config.tensor_parallel_size,
        "kv_connector": getattr(kt, "kv_connector", None),
        "kv_connector_extra_config": dict(getattr(kt, "kv_connector_extra_config", None) or {}),
        "config": str(vc),
    }


def start_engine(spec: dict, **kw):
    """In an engine's process: vLLM on the spec's model (``model_dir``, ``load_format``; no
    tokenizer, bf16, seed 0) with ``kw``; the "engine" record (start-up seconds, vLLM's
    settings as the engine used them, the device) emitted. Returns (the LLM, that record)."""
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model_dir"],
        load_format=spec["load_format"],
        skip_tokenizer_init=True,
        dtype="bfloat16",
        seed=0,
        **kw,
    )
    rec = {"init_s": round(time.perf_counter() - t0, 1), "settings": engine_settings(llm),
           "device": device_name()}  # fmt: skip
    emit("engine", **rec)
    return llm, rec


def engine_result(base: dict, name: str, rc, recs: list[dict], log: Path) -> dict:
    """In the parent: one engine's entry, from its child's records: ``base``, its name, exit
    code, vLLM's settings and device, and its "result" record's fields, or the log's tail as
    the error when it gave none."""
    r = next((x for x in recs if x["kind"] == "result"), None)
    info = next((x for x in recs if x["kind"] == "engine"), {})
    e = {**base, "name": name, "rc": rc, "settings": info.get("settings"),
         "device": info.get("device")}  # fmt: skip
    if r is None:
        e["error"] = f"rc {rc}: " + log.read_text(errors="replace")[-1500:]
    else:
        e.update({k: v for k, v in r.items() if k not in ("kind", "settings", "device")})
    return e


def emit(kind: str, **record) -> None:
    """A record for the parent (a line of the child's log)."""
    print(MARK + json.dumps({"kind": kind, **record}, default=str), flush=True)


def records(text: str) -> list[dict]:
    """The records a child printed (:func:`emit`)."""
    return [json.loads(ln[len(MARK) :]) for ln in text.splitlines() if ln.startswith(MARK)]


def run_child(
    module: str,
    spec: dict,
    log: Path,
    env: dict,
    timeout_s: float,
    progress: Callable[[list[dict]], None] | None = None,
) -> tuple[object, list[dict]]:
    """Run ``python -m module --child SPEC`` (one engine) with its output in ``log``, at most
    ``timeout_s``; ``progress`` sees the records printed so far, about once a second. Returns
    (exit code or "timeout", the records: those of a stopped child are kept)."""
    spec_path = log.with_suffix(".spec.json")
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", module, "--child", str(spec_path)]
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        rc: object = None
        while rc is None:
            try:
                rc = proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                if time.monotonic() - t0 > timeout_s:
                    rc = "timeout"
            if progress is not None:
                progress(records(log.read_text(errors="replace")))
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    return rc, records(log.read_text(errors="replace"))


def child_spec() -> dict | None:
    """In a child process: its spec (``--child SPEC``), with :data:`ENV` set; else None."""
    if len(sys.argv) != 3 or sys.argv[1] != "--child":
        return None
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    return json.loads(Path(sys.argv[2]).read_text())


def device_name() -> str:
    """The GPU's name, else the CPU's."""
    import platform

    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
