"""Python's switch interval while the tier's threads work.

The tier's load and store threads run in the engine's process, beside vLLM's engine loop,
which keeps the GIL busy (it polls while requests wait for their loads and schedules every
step). A thread that releases the GIL (a stream or event call, a copy, a lock) then waits for
the engine loop to give it back, which Python forces only every switch interval (5 ms by
default). A restore or store that releases the GIL a few times per chunk runs at a fraction of
its speed: on an H100 with vLLM's defaults, a restore's host part took about 1.6 ms a chunk
(0.3 ms when it ran on the engine's own thread) and the store thread was busy 8.4 s for 2.3 s
of coding and copying (``results/vllm/tier_vs_offload/h100_restore_defaults``). A thread that
releases the GIL after each 10 us of Python beside a spinning loop made 194 chunks/s at 5 ms,
2,711 at 0.2 ms, while the loop kept 0.85 of its rate (2 CPU cores, 2026-12-06).

:func:`busy` shortens the interval while any tier thread has work and gives the process its
own interval back when none has: steps with no restore or store in flight are untouched.
"""

from __future__ import annotations

import contextlib
import sys
import threading

_lock = threading.Lock()
_depth = 0
_saved: float | None = None


@contextlib.contextmanager
def busy(seconds: float | None):
    """While inside, Python's switch interval is at most ``seconds`` (None or 0: unchanged);
    nested and concurrent uses share one change, undone when the last one leaves."""
    global _depth, _saved
    if not seconds:
        yield
        return
    with _lock:
        if _depth == 0:
            current = sys.getswitchinterval()
            if seconds < current:
                _saved = current
                sys.setswitchinterval(seconds)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                sys.setswitchinterval(_saved)
                _saved = None
