"""Every CPU command the READMEs show runs as written (issue 37).

A README marks a code block as a CPU command to test with an HTML comment line right before
it (invisible on GitHub); the block is fenced (```` ``` ````) or indented by four spaces:

    <!-- cpu-test -->
    <!-- cpu-test: timeout=900 -->

The documents read are README.md, packages/*/README.md and docs/*.md. Each marked block runs
in ``bash -e -o pipefail`` with a timeout, at the root of a fresh copy of the repository (the
working tree's files that git tracks or would track, as a clone of it would hold them; one copy
for the whole session, blocks in document order) and in the shell a fresh machine gives: the
machine's own ``python3`` and ``uv`` on ``PATH``, no virtual environment active and no
``KVZIP_*``/``TRITON_INTERPRET`` variable set (``KVZIP_CACHE_DIR`` and the caches under
``$HOME`` are kept: the uv package cache and the converted model). A block passes when it
exits with status 0. Options, after ``cpu-test:``, separated by spaces:

- ``timeout=SECONDS``: the block's limit (default 600 s, 900 s for a ``vllm serve`` block);
- ``venv``: the block runs with the copy's project environment active (``.venv/bin`` first on
  ``PATH``, ``VIRTUAL_ENV`` set), as after ``. .venv/bin/activate``; the environment is made
  first with ``python3 -m uv sync --frozen`` (the quick start's step) where it is missing.

A block whose first command is ``vllm serve`` (after any ``VAR=value`` assignments and a
``uv run`` or ``python3 -m uv run`` prefix) is a server: that command starts in the background
(its own process group), the harness waits until ``/health`` answers, asks ``/v1/models`` for
the served model, sends one completion request (greedy, 8 tokens) and checks its answer, runs
the block's remaining lines (client commands: each must exit with 0), then stops the server
with SIGINT and requires that it stopped (exit status 0, or 130 as a shell reports a command
that Ctrl-C stopped) and no traceback in its log before the shutdown. The
server listens where the command says (vLLM's default, port 8000, unless it names
``--port``); the port must be free.

A block that repeats an earlier one runs once, as the earlier one: the same commands with the
same options, or, for a server, the same ``vllm serve`` command with client lines that the
earlier block also runs (``repeats``; a package README may repeat the quick start's server).

Nothing is skipped: a marker without a block after it, an unknown option, or a block that
cannot run fails its test. The documentation of the convention is docs/development.md.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
#: a marker line; indented by four spaces or more it is code (an example), not a marker
MARKER = re.compile(r"^ {0,3}<!--\s*cpu-test(?::\s*(?P<opts>[^>]*?))?\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})")
DEFAULT_TIMEOUT, SERVE_TIMEOUT = 600, 900
#: ``VAR=value`` assignments, then an optional ``uv run [options]`` or ``python3 -m uv run
#: [options]`` prefix, then ``vllm serve``
SERVE = re.compile(
    r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*"
    r"(?:(?:python3?\s+-m\s+)?uv\s+run(?:\s+--?[\w-]+(?:[= ](?!vllm\b)\S+)?)*\s+)?"
    r"vllm\s+serve\b"
)


class MarkerError(ValueError):
    """A ``cpu-test`` marker that does not mark a block, or marks it with an unknown option."""


@dataclass
class Block:
    """One marked code block: where it is, its text (dedented) and its options."""

    doc: str
    line: int  # the marker's line (1-based)
    text: str
    timeout: int
    venv: bool = False
    serve: bool = field(init=False)

    def __post_init__(self):
        self.serve = bool(SERVE.match(_commands(self.text)[0])) if self.text.strip() else False

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def _options(raw: str | None, where: str) -> dict:
    opts: dict = {}
    for word in (raw or "").split():
        key, _, value = word.partition("=")
        if key == "timeout" and value.isdigit() and int(value) > 0:
            opts["timeout"] = int(value)
        elif key == "venv" and not value:
            opts["venv"] = True
        else:
            raise MarkerError(f"{where}: unknown cpu-test option {word!r} (timeout=N, venv)")
    return opts


def parse_blocks(text: str, doc: str) -> list[Block]:
    """The blocks of one markdown document that a ``cpu-test`` marker marks, in order.
    :class:`MarkerError` for a marker that no code block follows."""
    lines = text.splitlines()
    blocks = []
    for i, line in enumerate(lines):
        m = MARKER.match(line)
        if not m:
            continue
        where = f"{doc}:{i + 1}"
        opts = _options(m.group("opts"), where)
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j == len(lines):
            raise MarkerError(f"{where}: a cpu-test marker with no code block after it")
        f = FENCE.match(lines[j])
        if f:
            fence = f.group("fence")
            body = []
            k = j + 1
            while k < len(lines) and not lines[k].lstrip(" ").startswith(fence):
                body.append(lines[k][len(f.group("indent")) :])
                k += 1
            if k == len(lines):
                raise MarkerError(f"{where}: the fenced block after the marker is not closed")
        elif lines[j].startswith("    ") or lines[j].startswith("\t"):
            body = []
            k = j
            while k < len(lines) and (lines[k].startswith(("    ", "\t")) or not lines[k].strip()):
                body.append(lines[k][4:] if lines[k].startswith("    ") else lines[k][1:])
                k += 1
            while body and not body[-1].strip():
                body.pop()
        else:
            raise MarkerError(
                f"{where}: a cpu-test marker must be followed by a fenced or indented code block"
            )
        if not "\n".join(body).strip():
            raise MarkerError(f"{where}: the marked code block is empty")
        timeout = opts.get("timeout")
        b = Block(
            doc, i + 1, "\n".join(body) + "\n", timeout or DEFAULT_TIMEOUT, opts.get("venv", False)
        )
        if b.serve and timeout is None:
            b.timeout = SERVE_TIMEOUT
        blocks.append(b)
    return blocks


def _commands(text: str) -> list[str]:
    """A block's shell commands: its lines joined where a command goes on (a trailing
    backslash, an open quote); comment and blank lines dropped."""
    out, cur = [], ""
    for line in text.splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        cur = f"{cur}\n{line}" if cur else line
        if cur.endswith("\\"):
            continue
        try:
            shlex.split(cur, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        out.append(cur)
        cur = ""
    if cur:
        out.append(cur)
    return out or [""]


def documents(root: Path = ROOT) -> list[Path]:
    docs = [root / "README.md", *sorted(root.glob("packages/*/README.md"))]
    return [p for p in docs + sorted(root.glob("docs/*.md")) if p.is_file()]


def _collect() -> tuple[list[Block], list[str]]:
    blocks, errors = [], []
    for p in documents():
        try:
            blocks += parse_blocks(p.read_text(), str(p.relative_to(ROOT)))
        except MarkerError as e:
            errors.append(str(e))
    return blocks, errors


def _norm(command: str) -> str:
    return " ".join(command.replace("\\\n", " ").split())


def repeats(block: Block, earlier: list[Block]) -> Block | None:
    """The earlier block that runs everything ``block`` runs, or None: the same options and
    commands; for a server, the same ``vllm serve`` command (whitespace and line breaks
    aside) and client lines that are among the earlier block's."""
    mine = [_norm(c) for c in _commands(block.text)]
    for e in earlier:
        theirs = [_norm(c) for c in _commands(e.text)]
        if (e.venv, e.serve, e.timeout) != (block.venv, block.serve, block.timeout):
            continue
        if mine == theirs or (block.serve and mine[0] == theirs[0] and set(mine) <= set(theirs)):
            return e
    return None


BLOCKS, MARKER_ERRORS = _collect()
#: the blocks the slow test runs: each block but those repeating an earlier one
RUN = [b for i, b in enumerate(BLOCKS) if repeats(b, BLOCKS[:i]) is None]


# ------------------------------------------------------------------------- the harness
def fresh_env(venv: Path | None = None) -> dict:
    """The environment of a fresh machine's shell: this one without the test's virtual
    environment, Python path, kvzip variables (but the cache folder) or Triton interpreter;
    with ``venv`` active if given."""
    env = dict(os.environ)
    ours = {Path(sys.prefix).resolve(), Path(sys.executable).parent.resolve()}
    if env.get("VIRTUAL_ENV"):
        ours.add(Path(env["VIRTUAL_ENV"]).resolve())
    for name in list(env):
        if name.startswith("KVZIP_") and name != "KVZIP_CACHE_DIR":
            del env[name]
    for name in ("VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT", "PYTHONPATH", "PYTHONHOME"):
        env.pop(name, None)
    env.pop("TRITON_INTERPRET", None)

    def foreign(entry: str) -> bool:
        p = Path(entry).resolve() if entry else None
        if p is None or (p.parent / "pyvenv.cfg").exists():  # any virtual environment's bin
            return False  # (e.g. the project's, when the tests run under `uv run nox`)
        return not any(p == o or o in p.parents for o in ours)

    path = [e for e in env.get("PATH", "").split(os.pathsep) if foreign(e)]
    if venv is not None:
        path.insert(0, str(venv / "bin"))
        env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = os.pathsep.join(path)
    return env


def copy_checkout(dest: Path, root: Path = ROOT) -> Path:
    """The working tree's files that git tracks or would track (not ignored ones: no
    ``.venv``, no results of earlier runs), copied to ``dest``, as a clone holds them."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    names = sorted({n for n in out.decode().split("\0") if n and (root / n).exists()})
    for n in names:
        (dest / n).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / n, dest / n, follow_symlinks=False)
    return dest


def _run(script: str, cwd: Path, env: dict, timeout: float) -> tuple[int | str, str]:
    """``bash -e -o pipefail -c script`` in its own process group; (exit status or
    "timed out", its output)."""
    proc = subprocess.Popen(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return f"timed out after {timeout:.0f} s", out


def _port(command: str) -> int:
    m = re.search(r"--port[= ](\d+)", command)
    return int(m.group(1)) if m else 8000


def _get(url: str, body: dict | None = None, timeout: float = 300) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.status == 200, (url, r.status)
        return json.loads(r.read())


def serve(block: Block, cwd: Path, env: dict, log: Path) -> None:
    """A ``vllm serve`` block: start its first command, check it answers one completion, run
    the block's other commands, stop it with SIGINT (exit status 0, no traceback)."""
    sys.path.insert(0, str(ROOT / "packages" / "kvzip-vllm" / "benchmarks"))
    import serve_h200  # the server plumbing of tests/test_vllm_serve.py

    first, *rest = _commands(block.text)
    port = _port(first)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError as e:
            pytest.fail(f"{block.id}: port {port}, where the command serves, is taken: {e}")
    argv = ["bash", "-e", "-c", f"cd {shlex.quote(str(cwd))}\n{first}"]
    server = serve_h200.Server(argv, env, log, port)
    try:
        t0 = time.monotonic()
        server.wait_ready(block.timeout)
        models = _get(server.url + "/v1/models")["data"]
        assert models, models
        answer = _get(
            server.url + "/v1/completions",
            {
                "model": models[0]["id"],
                "prompt": "The capital of France is",
                "max_tokens": 8,
                "temperature": 0.0,
            },
        )
        choice = answer["choices"][0]
        assert isinstance(choice["text"], str) and choice["text"].strip(), answer
        assert choice["finish_reason"] in ("length", "stop"), answer
        assert 0 < answer["usage"]["completion_tokens"] <= 8, answer
        left = block.timeout - (time.monotonic() - t0)
        for command in rest:
            rc, out = _run(command, cwd, env, max(left, 60))
            assert rc == 0, f"{block.id}: {command!r} exited with {rc}:\n{out[-3000:]}"
    finally:
        rc = server.stop()
    text = log.read_text(errors="replace")
    # stopped by SIGINT within the limit: 0, or what a shell reports for a command Ctrl-C
    # stopped (130; -2 where the command itself died of the signal, not a wrapper)
    assert rc in (0, 128 + signal.SIGINT, -signal.SIGINT), (
        f"{block.id}: vllm serve did not stop on SIGINT: {rc}\n{text[-3000:]}"
    )
    serving = text.split("shutdown triggered", 1)[0]
    assert not re.search(r"Traceback|EngineDeadError", serving), serving[-3000:]


@pytest.fixture(scope="session")
def checkout(tmp_path_factory) -> Path:
    return copy_checkout(tmp_path_factory.mktemp("readme") / "kvzip")


# ------------------------------------------------------------------------------- tests
def test_the_markers_mark_blocks():
    assert not MARKER_ERRORS, MARKER_ERRORS
    assert BLOCKS, "no README code block is marked <!-- cpu-test -->"


@pytest.mark.slow
@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_a_readme_cpu_command_runs_as_written(block, checkout, tmp_path):
    venv = None
    if block.venv:
        venv = checkout / ".venv"
        if not (venv / "bin" / "python").exists():
            rc, out = _run("python3 -m uv sync --frozen", checkout, fresh_env(), 600)
            assert rc == 0, f"python3 -m uv sync --frozen: {rc}\n{out[-3000:]}"
    env = fresh_env(venv)
    if block.serve:
        serve(block, checkout, env, tmp_path / "serve.log")
        return
    rc, out = _run(block.text, checkout, env, block.timeout)
    assert rc == 0, f"{block.id} exited with {rc}:\n{block.text}\n--- output ---\n{out[-4000:]}"


# ---------------------------------------------------------------- the parser, on its own
SAMPLE = """# t

<!-- cpu-test -->
```sh
echo one \\
  two
```

text

<!-- cpu-test: timeout=30 venv -->

    kvzip model path
    echo done

```sh
not marked
```

<!-- cpu-test -->
```sh
OMP_NUM_THREADS=1 python3 -m uv run --frozen vllm serve "$(kvzip model path)" --port 8123 \\
  --kv-transfer-config '{"kv_connector": "KvzipConnector",
                         "kv_role": "kv_both"}'
curl -s localhost:8123/v1/models
```
"""


def test_the_parser_finds_fenced_and_indented_blocks_with_their_options():
    a, b, c = parse_blocks(SAMPLE, "x.md")
    assert (a.line, a.text, a.timeout, a.venv, a.serve) == (
        3,
        "echo one \\\n  two\n",
        DEFAULT_TIMEOUT,
        False,
        False,
    )
    assert (b.text, b.timeout, b.venv, b.serve) == (
        "kvzip model path\necho done\n",
        30,
        True,
        False,
    )
    assert c.serve and c.timeout == SERVE_TIMEOUT and c.id == "x.md:20"
    first, rest = _commands(c.text)
    assert first.endswith('"kv_role": "kv_both"}\'') and _port(first) == 8123
    assert rest == "curl -s localhost:8123/v1/models"


def test_a_block_repeating_an_earlier_one_runs_once():
    doc = """<!-- cpu-test -->
```sh
vllm serve M --port 8123 \\
  --dtype bfloat16
curl -s localhost:8123/v1/models
```

<!-- cpu-test -->
```sh
vllm serve M --port 8123   --dtype bfloat16
```

<!-- cpu-test -->
```sh
vllm serve M --port 8123 --dtype float16
```

<!-- cpu-test -->
```sh
vllm serve M --port 8123 --dtype bfloat16
curl -s localhost:8123/health
```

<!-- cpu-test: venv -->
```sh
vllm serve M --port 8123 --dtype bfloat16
```

<!-- cpu-test -->
```sh
echo one
echo two
```

<!-- cpu-test -->
```sh
echo two
```
"""
    blocks = parse_blocks(doc, "x.md")
    got = [repeats(b, blocks[:i]) for i, b in enumerate(blocks)]
    # the server without its client line is the first block's; another dtype, another client
    # line, another option and a part of a plain block's commands are blocks of their own
    assert got == [None, blocks[0], None, None, None, None, None]


def test_an_indented_marker_is_an_example_not_a_marker():
    assert parse_blocks("    <!-- cpu-test -->\n    ```sh\n    echo\n    ```\n", "x") == []


@pytest.mark.parametrize(
    "command, serve_",
    [
        ("vllm serve M", True),
        ("uv run vllm serve M", True),
        ("python3 -m uv run --frozen vllm serve M --port 1", True),
        ("VLLM_X=0 uv run --frozen --extra cpu vllm serve M", True),
        ("vllm bench serve --model M", False),
        ("uv run python -c 'vllm serve'", False),
    ],
)
def test_a_serve_block_is_one_whose_first_command_is_vllm_serve(command, serve_):
    assert parse_blocks(f"<!-- cpu-test -->\n```\n{command}\n```\n", "x")[0].serve == serve_


@pytest.mark.parametrize(
    "doc, error",
    [
        ("<!-- cpu-test -->\n\nplain text\n", "must be followed by a fenced or indented"),
        ("<!-- cpu-test -->\n", "no code block after it"),
        ("<!-- cpu-test -->\n```sh\necho\n", "not closed"),
        ("<!-- cpu-test: fast -->\n```sh\necho\n```\n", "unknown cpu-test option 'fast'"),
        ("<!-- cpu-test: timeout=0 -->\n```sh\necho\n```\n", "unknown cpu-test option"),
    ],
)
def test_a_marker_without_a_runnable_block_is_an_error(doc, error):
    with pytest.raises(MarkerError, match=re.escape(error)):
        parse_blocks(doc, "x.md")


def test_the_shell_is_a_fresh_machines(tmp_path, monkeypatch):
    outer = tmp_path / "outer-venv"  # a virtual environment of the caller's (`uv run nox`)
    (outer / "bin").mkdir(parents=True)
    (outer / "pyvenv.cfg").write_text("home = /usr/bin\n")
    monkeypatch.setenv("PATH", f"{outer / 'bin'}{os.pathsep}{os.environ['PATH']}")
    env = fresh_env()
    assert str(outer / "bin") not in env["PATH"].split(os.pathsep)
    assert "VIRTUAL_ENV" not in env and "TRITON_INTERPRET" not in env
    assert not [n for n in env if n.startswith("KVZIP_") and n != "KVZIP_CACHE_DIR"]
    assert str(Path(sys.executable).parent) not in env["PATH"].split(os.pathsep)
    active = fresh_env(tmp_path / "v")
    assert active["PATH"].split(os.pathsep)[0] == str(tmp_path / "v" / "bin")
    assert shutil.which("bash", path=env["PATH"])


def test_the_copy_holds_the_tracked_files_and_not_the_ignored_ones(tmp_path):
    dest = copy_checkout(tmp_path / "c")
    assert (dest / "README.md").read_bytes() == (ROOT / "README.md").read_bytes()
    assert (dest / "packages" / "kvzip-vllm" / "tests" / Path(__file__).name).is_file()
    assert not (dest / ".venv").exists() and not (dest / ".git").exists()
