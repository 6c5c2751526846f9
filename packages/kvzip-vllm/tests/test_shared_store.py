"""The shared tier's store against a real ``redis-server`` (a subprocess on 127.0.0.1):
bit-exact round trips, the digest on every read, the server's byte budget and LRU eviction, a
server killed, stalled or restarted, blocks written by one process and read by another, the
server's limits set or refused."""

from __future__ import annotations

import logging
import pickle
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
import torch
from redis_server import INSTALL_HINT, RedisServer, redis_server_binary

import kvzip_lossless
from kvzip_vllm.core.shared_store import (
    FORMAT_VERSION,
    SharedBlobStore,
    SharedStoreConfigError,
    encode_value,
)
from kvzip_vllm.core.store import block_key, namespace, pack_record

LOGGER = "kvzip_vllm.shared_store"
# A call may take its socket timeout plus scheduling noise (two cores shared by several jobs).
SLACK_S = 0.5
ACL_NO_CONFIG_SET = ["--user", "default", "on", "nopass", "~*", "&*", "+@all", "-config|set"]


def _require_redis():
    if redis_server_binary() is None:
        pytest.fail(INSTALL_HINT)


@pytest.fixture
def server():
    _require_redis()
    srv = RedisServer().start()
    yield srv
    srv.close()


def _raw(srv: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(srv.url, socket_timeout=5, protocol=2)


def _store(srv: RedisServer, budget: int = 64 << 20, **kw) -> SharedBlobStore:
    return SharedBlobStore(srv.url, budget, **kw)


def _key(i: int) -> bytes:
    ns = namespace(model="test", layout="nhd", block_size=16, dtype="bfloat16")
    return block_key(ns, i.to_bytes(8, "little"))


def _blobs(seed: int, sizes=(0, 1, 7, 4096, 50_000)) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(rng.choice(sizes)) for _ in range(rng.randint(1, 6))]


def _warnings(caplog, text: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == LOGGER and r.levelno == logging.WARNING and text in r.getMessage()
    ]


def _timed(fn, *args):
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


# ---------------------------------------------------------------------------- round trips
def test_roundtrip_random_blobs_bit_exact(server):
    with _store(server) as st:
        entries = {_key(i): _blobs(i) for i in range(24)}
        for i, (k, b) in enumerate(entries.items()):
            assert st.put(k, b, raw_bytes=1000 + i)
        sizes = 0
        for i, (k, b) in enumerate(entries.items()):
            e = st.get_entry(k)
            assert e is not None and e.blobs == b and e.raw_bytes == 1000 + i
            sizes += len(encode_value(st.redis_key(k), b, 1000 + i))
        s = st.stats
        assert s["shared_hits"] == 24 and s["shared_misses"] == 0 and s["shared_stored"] == 24
        assert s["shared_bytes_written"] == s["shared_bytes_read"] == sizes
        # first writer wins: a second put of a held key is not rewritten
        k0 = next(iter(entries))
        assert st.put(k0, [b"other"]) and st.get(k0) == entries[k0]
        assert st.stats["shared_already_held"] == 1
        assert st.get(_key(999)) is None and st.stats["shared_misses"] == 1
        assert st.stats["shared_up"] is True


@pytest.mark.slow  # kvzip-lossless's first compress in a process: ~18 s on 2 shared cores
def test_roundtrip_kvzip_lossless_blobs_from_records(server):
    """A BlockStore record's blob views go in; the blobs come out and decode bit-exactly."""
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(32, 3, 64, generator=g).to(torch.bfloat16) for _ in range(4)]
    blobs = [kvzip_lossless.compress(t) for t in tensors]
    _, views = pack_record(blobs)  # memoryviews into one uint8 record, as BlockStore holds
    with _store(server) as st:
        raw = sum(t.numel() * t.element_size() for t in tensors)
        assert st.put(_key(1), views, raw_bytes=raw)
        entry = st.get_entry(_key(1))
    assert entry.raw_bytes == raw and entry.blobs == [bytes(b) for b in blobs]
    for blob, t in zip(entry.blobs, tensors, strict=True):
        got = kvzip_lossless.decompress(blob)
        assert torch.equal(got.view(torch.int16), t.view(torch.int16))


def test_namespaces_are_separate_and_prefix_the_key(server):
    raw = _raw(server)
    with _store(server, namespace="a") as a, _store(server, namespace="b") as b:
        assert a.put(_key(1), [b"from a"])
        rkey = f"a:v{FORMAT_VERSION}:".encode() + _key(1)
        assert raw.exists(rkey) == 1 and a.redis_key(_key(1)) == rkey
        assert b.get(_key(1)) is None and b.contains_many([_key(1)]) == [False]
        assert a.get(_key(1)) == [b"from a"]


def test_contains_many_is_one_pipelined_probe(server):
    with _store(server) as st:
        for i in (0, 2, 3):
            st.put(_key(i), [b"x"])
        assert st.contains_many([_key(i) for i in range(5)]) == [True, False, True, True, False]
        assert st.contains_many([]) == []
        assert st.delete(_key(2)) and not st.delete(_key(2))
        assert st.contains_many([_key(2), _key(3)]) == [False, True]
        assert st.stats["shared_contains_calls"] == 2  # the empty probe sent nothing


def test_concurrent_threads_bit_exact(server):
    with _store(server) as st:
        bad: list[str] = []

        def work(t: int):
            for i in range(25):
                k, b = _key(1000 * t + i), _blobs(1000 * t + i)
                if not st.put(k, b):
                    bad.append(f"put {t}/{i}")
                if st.get(k) != b:
                    bad.append(f"get {t}/{i}")

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
        assert bad == [] and st.stats["shared_hits"] == 100


# ---------------------------------------------------------------------------- damage
def _flip(raw, rkey, offset):
    v = raw.get(rkey)
    raw.setrange(rkey, offset % len(v), bytes([v[offset % len(v)] ^ 0x10]))


DAMAGE = {
    "blob-byte": lambda raw, rk, ok: _flip(raw, rk, len(raw.get(rk)) // 2),
    "blob-count": lambda raw, rk, ok: _flip(raw, rk, 8),
    "digest-byte": lambda raw, rk, ok: _flip(raw, rk, -1),
    "magic": lambda raw, rk, ok: _flip(raw, rk, 0),
    "format-version": lambda raw, rk, ok: _flip(raw, rk, 4),
    "truncated": lambda raw, rk, ok: raw.set(rk, raw.get(rk)[:-1]),
    "extended": lambda raw, rk, ok: raw.set(rk, raw.get(rk) + b"\0"),
    "short": lambda raw, rk, ok: raw.set(rk, b"hello"),
    "empty": lambda raw, rk, ok: raw.set(rk, b""),
    "value-of-another-key": lambda raw, rk, ok: raw.set(rk, raw.get(ok)),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_value_is_a_miss_and_deleted(server, damage, caplog):
    raw = _raw(server)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with _store(server) as st:
        k, other = _key(1), _key(2)
        b = _blobs(5, sizes=(4096,))
        assert st.put(k, b) and st.put(other, _blobs(6, sizes=(4096,)))
        DAMAGE[damage](raw, st.redis_key(k), st.redis_key(other))
        assert st.get(k) is None
        s = st.stats
        assert s["shared_corrupt"] == 1 and s["shared_misses"] == 1 and s["shared_hits"] == 0
        assert raw.exists(st.redis_key(k)) == 0, "the damaged value was left on the server"
        assert raw.exists(st.redis_key(other)) == 1
        assert len(_warnings(caplog, "deleted, read as a miss")) == 1
        assert st.put(k, b) and st.get(k) == b  # rewritten by the next store, served again


# ---------------------------------------------------------------------------- budget
def test_budget_server_evicts_least_recently_used_and_store_misses():
    """Past maxmemory the server evicts the least recently used values; the store reads
    them as misses and every value it returns is the one written. Redis ages keys to the
    second and samples candidates: the server here samples every key (maxmemory-samples 64,
    more than it holds) and the test waits out a tick between old and recent keys."""
    _require_redis()
    with RedisServer("--maxmemory-samples", "64") as srv:
        raw = _raw(srv)
        size = 40_000  # value and probe in the same allocator size class (40 KiB)
        # what one value costs the server: the increment over 8 more (the first also grows
        # the client's query buffer)
        raw.set(b"probe0", b"\0" * size)
        base = raw.info("memory")["used_memory"]
        for i in range(1, 9):
            raw.set(b"probe%d" % i, b"\0" * size)
        per_value = (raw.info("memory")["used_memory"] - base) // 8
        raw.delete(*[b"probe%d" % i for i in range(9)])
        base = raw.info("memory")["used_memory"]
        budget = base + 24 * per_value  # room for about 24 values
        st = _store(srv, budget)
        assert raw.config_get("maxmemory") == {"maxmemory": str(budget)}
        assert raw.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}

        blobs = {}
        for i in range(32):  # two blobs of size/2 each
            rng = random.Random(i)
            blobs[i] = [rng.randbytes(size // 2), rng.randbytes(size // 2)]
        cold, hot, new = range(0, 12), range(12, 20), range(20, 32)
        for i in (*cold, *hot):
            assert st.put(_key(i), blobs[i])
        assert raw.info("stats")["evicted_keys"] == 0
        time.sleep(1.2)  # one LRU clock tick (1 s)
        for i in hot:
            assert st.get(_key(i)) == blobs[i]
        for i in new:
            assert st.put(_key(i), blobs[i])
        raw.ping()  # the server evicts before each command: now it is back within budget
        mem = raw.info("memory")["used_memory"]
        assert mem <= budget, f"server holds {mem} bytes, budget {budget}"
        evicted = raw.info("stats")["evicted_keys"]
        assert evicted >= 1

        held = st.contains_many([_key(i) for i in range(32)])
        misses_before = st.stats["shared_misses"]
        got = {i: st.get(_key(i)) for i in range(32)}
        missing = {i for i, g in got.items() if g is None}
        for i, g in got.items():
            assert g is None or g == blobs[i], f"block {i}: wrong data"
        assert [i not in missing for i in range(32)] == held
        assert len(missing) == evicted
        assert st.stats["shared_misses"] - misses_before == len(missing)
        assert missing <= set(cold), f"evicted {sorted(missing)}, the 12 oldest are 0..11"
        st.close()


def test_value_larger_than_budget_is_not_sent(server):
    raw = _raw(server)
    with _store(server, 8 << 20) as st:
        assert not st.put(_key(1), [b"\1" * (8 << 20)])
        assert st.stats["shared_too_large"] == 1 and raw.exists(st.redis_key(_key(1))) == 0


def test_server_out_of_memory_refuses_put_and_stays_up(server, caplog):
    """A value the server cannot fit even after evicting everything: refused (OOM), put is
    False, and the store keeps talking to the server (no backoff)."""
    raw = _raw(server)
    base = raw.info("memory")["used_memory"]
    budget = base + (256 << 10)
    with _store(server, budget) as st:
        assert not st.put(_key(1), [b"\2" * (budget - 4096)])
        s = st.stats
        assert s["shared_refused"] == 1 and s["shared_errors"] == 0 and s["shared_up"]
        assert len(_warnings(caplog, "OutOfMemoryError")) == 1
        # the server frees the refused argument's buffers within a cron tick or two
        deadline = time.monotonic() + 5
        while not st.put(_key(2), [b"small"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert st.get(_key(2)) == [b"small"]
        s = st.stats
        assert s["shared_skipped_down"] == 0 and s["shared_errors"] == 0  # never backed off


# ---------------------------------------------------------------------------- failures
def _assert_miss_phase(st, seconds: float, bound: float) -> None:
    """Calls for ``seconds``: each answers a miss within ``bound`` seconds, none raises."""
    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline:
        i += 1
        got, dt = _timed(st.get, _key(i))
        assert got is None and dt < bound, f"get took {dt:.3f} s"
        ok, dt = _timed(st.put, _key(10_000 + i), [b"v"])
        assert ok is False and dt < bound, f"put took {dt:.3f} s"
        held, dt = _timed(st.contains_many, [_key(1), _key(2)])
        assert held == [False, False] and dt < bound, f"contains_many took {dt:.3f} s"
        time.sleep(0.02)


def _wait_until_up(st, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if st.put(_key(77_777), [b"probe"]):
            return
        time.sleep(0.05)
    raise AssertionError(f"store did not reconnect in {seconds} s: {st.stats}")


def test_server_killed_mid_run_then_restarted(server, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    raw = _raw(server)
    budget = 32 << 20
    st = _store(server, budget, backoff_initial_s=0.2, backoff_max_s=0.4)
    for i in range(10):
        assert st.put(_key(i), _blobs(i)) and st.get(_key(i)) == _blobs(i)

    server.kill()
    _assert_miss_phase(st, 1.5, bound=0.2 + 0.5 + SLACK_S)
    s = st.stats
    assert s["shared_up"] is False
    assert s["shared_errors"] >= 2, s  # tried again after each backoff
    assert s["shared_skipped_down"] >= 1, s  # answered at once in between
    assert s["shared_hits"] == 10
    assert len(_warnings(caplog, "ConnectionError")) == 1  # one line per kind

    server.start()  # same port, empty, maxmemory back to its default (0)
    _wait_until_up(st)
    assert st.stats["shared_reconnects"] == 1 and st.stats["shared_up"]
    # the limits were set again on the new connection
    assert raw.config_get("maxmemory") == {"maxmemory": str(budget)}
    assert raw.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
    assert st.get(_key(0)) is None  # gone with the old server: a miss, never stale
    for i in range(10):
        assert st.put(_key(i), _blobs(i)) and st.get(_key(i)) == _blobs(i)
    st.close()


def test_stalled_server_times_out_then_recovers(server):
    st = _store(server, read_timeout_s=0.3, backoff_initial_s=0.2, backoff_max_s=0.4)
    for i in range(5):
        assert st.put(_key(i), _blobs(i))
    server.pause()  # accepts connections, answers nothing
    try:
        _assert_miss_phase(st, 1.6, bound=0.3 + 0.2 + SLACK_S)
        assert st.stats["shared_timeouts"] >= 2 and st.stats["shared_skipped_down"] >= 1
    finally:
        server.resume()
    _wait_until_up(st)
    for i in range(5):
        assert st.get(_key(i)) == _blobs(i)  # the server kept them
    # puts sent into the stall may still have landed: whole values, or nothing
    for i in range(1, 200):
        got = st.get(_key(10_000 + i))
        assert got is None or got == [b"v"]
    st.close()


def test_server_down_at_start_degrades_then_connects():
    _require_redis()
    srv = RedisServer()  # not started yet
    try:
        st = _store(srv, backoff_initial_s=0.1, backoff_max_s=0.2)
        assert st.stats["shared_up"] is False and st.stats["shared_errors"] == 1
        assert st.get(_key(1)) is None
        srv.start()
        _wait_until_up(st)
        assert st.put(_key(1), [b"x"]) and st.get(_key(1)) == [b"x"]
        st.close()
    finally:
        srv.close()


def test_closed_store_answers_misses(server):
    st = _store(server)
    st.put(_key(1), [b"x"])
    st.close()
    assert st.get(_key(1)) is None and st.put(_key(2), [b"y"]) is False
    assert st.contains_many([_key(1)]) == [False] and st.delete(_key(1)) is False


# ---------------------------------------------------------------------------- server limits
@pytest.mark.parametrize(
    "args,want",
    [
        ([], ["maxmemory-policy is 'noeviction'", "maxmemory is 0 (no limit)", "config|set"]),
        (["--maxmemory", "16mb", "--maxmemory-policy", "allkeys-lru"], ["maxmemory is 16777216"]),
        (["--maxmemory", "4mb", "--maxmemory-policy", "volatile-lru"], ["'volatile-lru'"]),
    ],
    ids=["no-limits", "maxmemory-above-budget", "wrong-policy"],
)
def test_server_that_refuses_config_set_is_checked_and_refused(args, want):
    _require_redis()
    with RedisServer(*ACL_NO_CONFIG_SET, *args) as srv:
        with pytest.raises(SharedStoreConfigError) as e:
            _store(srv, 8 << 20)
        for w in want:
            assert w in str(e.value)


def test_server_that_refuses_config_set_but_has_the_limits_is_used():
    _require_redis()
    limits = ["--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"]
    with RedisServer(*ACL_NO_CONFIG_SET, *limits) as srv:
        with _store(srv, 8 << 20) as st:
            assert st.stats["shared_server_maxmemory"] == 4 << 20
            assert st.put(_key(1), [b"x"]) and st.get(_key(1)) == [b"x"]


def test_server_without_config_access_is_refused():
    _require_redis()
    acl = ["--user", "default", "on", "nopass", "~*", "&*", "+@all", "-config"]
    with RedisServer(*acl) as srv:
        with pytest.raises(SharedStoreConfigError, match="cannot read the server's maxmemory"):
            _store(srv, 8 << 20)


def test_configure_server_false_only_checks(server):
    raw = _raw(server)
    with pytest.raises(SharedStoreConfigError, match="maxmemory is 0"):
        _store(server, 8 << 20, configure_server=False)
    assert raw.config_get("maxmemory") == {"maxmemory": "0"}  # left alone
    raw.config_set("maxmemory", 2 << 20)
    raw.config_set("maxmemory-policy", "allkeys-lru")
    with _store(server, 8 << 20, configure_server=False) as st:
        assert st.stats["shared_server_maxmemory"] == 2 << 20
    assert raw.config_get("maxmemory") == {"maxmemory": str(2 << 20)}


def test_restart_with_wrong_limits_mid_run_is_a_miss_not_an_exception(server, caplog):
    st = _store(server, backoff_initial_s=0.1, backoff_max_s=0.2)
    assert st.put(_key(1), [b"x"])
    server.kill()
    server.args = [*ACL_NO_CONFIG_SET]
    server.start()
    _assert_miss_phase(st, 0.8, bound=0.2 + 0.5 + SLACK_S)
    assert st.stats["shared_config_errors"] >= 1
    assert len(_warnings(caplog, "maxmemory-policy is 'noeviction'")) == 1
    st.close()


# ---------------------------------------------------------------------------- settings
@pytest.mark.parametrize(
    "url,budget,kw,want",
    [
        ("http://127.0.0.1:6379", 1 << 20, {}, "scheme 'http'"),
        ("redis://127.0.0.1:1/0", 0, {}, "budget_bytes"),
        ("redis://127.0.0.1:1/0", True, {}, "budget_bytes"),
        ("redis://127.0.0.1:1/0", 1 << 20, {"read_timeout_s": 0}, "read_timeout_s"),
        ("redis://127.0.0.1:1/0", 1 << 20, {"connect_timeout_s": float("inf")}, "connect_timeout"),
        ("redis://127.0.0.1:1/0", 1 << 20, {"namespace": ""}, "namespace"),
        ("redis://127.0.0.1:1/0", 1 << 20, {"budget": 3}, "budget"),
    ],
)
def test_bad_settings_are_named(url, budget, kw, want):
    with pytest.raises(ValueError, match="bad setting") as e:
        SharedBlobStore(url, budget, **kw)
    assert want in str(e.value)


def test_bad_arguments_raise(server):
    with _store(server) as st:
        with pytest.raises(TypeError, match="non-empty bytes"):
            st.get("text")
        with pytest.raises(TypeError, match="non-empty bytes"):
            st.put(b"", [b"x"])
        with pytest.raises(ValueError, match="blobs is empty"):
            st.put(_key(1), [])
        with pytest.raises(ValueError, match="raw_bytes"):
            st.put(_key(1), [b"x"], raw_bytes=-1)


# ---------------------------------------------------------------------------- two processes
_CHILD = r"""
import json, pickle, sys
from kvzip_vllm.core.shared_store import SharedBlobStore
url, mode, path = sys.argv[1], sys.argv[2], sys.argv[3]
st = SharedBlobStore(url, 64 << 20)
with open(path, "rb") as f:
    entries = pickle.load(f)
if mode == "put":
    ok = [st.put(k, b, raw_bytes=r) for k, (b, r) in entries.items()]
    assert all(ok), ok
else:
    got = {k: st.get_entry(k) for k in entries}
    with open(path, "wb") as f:
        pickle.dump({k: (e.blobs, e.raw_bytes) if e else None for k, e in got.items()}, f)
print(json.dumps(st.stats))
"""


def _child(srv: RedisServer, mode: str, path: Path) -> dict:
    import json

    out = subprocess.run(
        [sys.executable, "-c", _CHILD, srv.url, mode, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_blocks_cross_processes(server, tmp_path):
    """A block stored by one process's store is restored by another's, both ways."""
    written = {_key(i): (_blobs(i), 100 + i) for i in range(12)}
    path = tmp_path / "entries.pkl"
    path.write_bytes(pickle.dumps(written))
    stats = _child(server, "put", path)
    assert stats["shared_stored"] == 12
    with _store(server) as st:
        for k, (b, r) in written.items():
            e = st.get_entry(k)
            assert e is not None and e.blobs == b and e.raw_bytes == r
        mine = {_key(100 + i): (_blobs(100 + i), i) for i in range(12)}
        for k, (b, r) in mine.items():
            assert st.put(k, b, raw_bytes=r)
    path.write_bytes(pickle.dumps({**mine, _key(555): ([b""], 0)}))
    stats = _child(server, "get", path)
    assert stats["shared_hits"] == 12 and stats["shared_misses"] == 1
    got = pickle.loads(path.read_bytes())
    assert got.pop(_key(555)) is None
    assert got == mine
