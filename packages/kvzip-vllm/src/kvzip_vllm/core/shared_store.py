"""The shared tier: the capacity tier's compressed blocks in a Redis server that many vLLM
instances reach, so a prefix computed on one instance is restored on another.

:class:`SharedBlobStore` holds exactly what :class:`kvzip_vllm.core.store.BlockStore` holds for a
block (its kvzip-lossless blobs, layer 0 K, layer 0 V, layer 1 K, ...) under the same key
(:func:`kvzip_vllm.core.store.block_key`), the Redis key being ``<namespace>:v<format version>:``
and that key (an instance running another version of this value format never reads these).
It keeps nothing of its own in memory: the byte budget and the eviction live on the server,
which it configures on every connection (``CONFIG SET maxmemory <budget_bytes>`` and
``maxmemory-policy allkeys-lru``) or, where the server refuses CONFIG SET, checks (``CONFIG
GET``) and refuses to use with a message naming the setting. Both settings are the whole
server's (every database in it): give the tier a Redis server of its own, and every instance
on it the same ``budget_bytes`` (the last to connect sets it).

One value per block: a header (magic ``KVZS``, format version, blob count, the block's
uncompressed bytes, each blob's length), the blobs back to back, then a BLAKE2b-256 digest
over the Redis key and everything before it. Every read checks the digest before anything is
returned: a mismatch (or a truncated or foreign value) is a miss, counted in
``shared_corrupt``, and the key is deleted (a put of the same block then writes it anew).
The blobs carry kvzip-lossless's own per-tile CRCs on top, checked when they are decoded.

Failure is a miss, never an exception into the caller's step nor a wait past the socket
timeouts: a server that is down, unreachable or stalled answers ``None`` / ``False`` within
``connect_timeout_s`` / ``read_timeout_s`` (the read timeout bounds each wait for bytes: a
server that keeps sending, slowly, is not cut off), counted in ``shared_errors`` /
``shared_timeouts`` with at most one log line per kind of failure per ``log_interval_s``; the
store then answers misses at once (``shared_skipped_down``) until its backoff (doubling from
``backoff_initial_s`` to ``backoff_max_s``) has passed, and the next call tries again. A
restarted server is reconfigured on reconnection (its CONFIG SET values are gone with it).

Composition (the connector's): the in-process :class:`~kvzip_vllm.core.store.BlockStore` stays in
front as the cache. On a local miss, ``entry = shared.get_entry(key)`` and, if found,
``local.put_blobs(key, tuple(entry.blobs), entry.raw_bytes)`` then ``local.get(key, outs)``
(which decodes and checks the blobs' CRCs); after a local store, ``shared.put(key, blobs,
raw_bytes=...)``. ``contains_many`` is one pipelined round trip of EXISTS (which, unlike GET,
does not refresh a key's LRU age). Every instance on one server must code with the same table
set (the same ``tables_path``, or tables embedded per blob): a blob that references another
set fails to decode (kvzip_lossless.CorruptBlobError: a miss, never wrong data).
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as e:  # pragma: no cover  (the extra is not installed)
    raise ImportError(
        "kvzip_vllm.core.shared_store needs the Redis client: pip install 'kvzip-vllm[shared]'"
    ) from e

log = logging.getLogger("kvzip_vllm.shared_store")  # its name before the move

MAGIC = b"KVZS"
FORMAT_VERSION = 1
#: magic, format version, 3 zero bytes, blob count, the block's uncompressed bytes
_HEADER = struct.Struct("<4sB3xIQ")
DIGEST_BYTES = 32
_PERSON = b"kvzip-shared"  # BLAKE2b personalisation: this format's digests only
POLICY = "allkeys-lru"


class SharedStoreConfigError(redis.exceptions.RedisError, ValueError):
    """The server cannot hold the tier as configured; the message names the setting."""


class CorruptValueError(ValueError):
    """A stored value that is not a well-formed, intact value of this format for its key."""


def _digest(rkey: bytes, parts: Sequence[bytes | memoryview]) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=_PERSON)
    h.update(struct.pack("<I", len(rkey)))
    h.update(rkey)
    for p in parts:
        h.update(p)
    return h.digest()


def encode_value(rkey: bytes, blobs: Sequence[bytes | memoryview], raw_bytes: int = 0) -> bytes:
    """The stored value of one block's ``blobs`` under the Redis key ``rkey``."""
    sizes = [memoryview(b).nbytes for b in blobs]
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, len(sizes), raw_bytes)
    lengths = struct.pack(f"<{len(sizes)}Q", *sizes)
    parts = [head, lengths, *blobs]
    return b"".join([*parts, _digest(rkey, parts)])


def decode_value(rkey: bytes, value: bytes) -> tuple[list[bytes], int]:
    """``(blobs, raw_bytes)`` of a value read under ``rkey``; raises
    :class:`CorruptValueError` unless it is intact and well formed."""
    n = len(value)
    if n < _HEADER.size + DIGEST_BYTES:
        raise CorruptValueError(f"value of {n} bytes is shorter than a header and digest")
    magic, version, count, raw_bytes = _HEADER.unpack_from(value)
    if magic != MAGIC:
        raise CorruptValueError(f"bad magic {magic!r}, want {MAGIC!r}")
    if version != FORMAT_VERSION:  # the key names the version: this one is damaged
        raise CorruptValueError(f"format version {version} under a v{FORMAT_VERSION} key")
    view = memoryview(value)
    if _digest(rkey, [view[:-DIGEST_BYTES]]) != bytes(view[-DIGEST_BYTES:]):
        raise CorruptValueError("digest mismatch (damaged, truncated or under another key)")
    # the digest holds: from here on a mismatch is a writer's bug, still never served
    start = _HEADER.size + 8 * count
    if start > n - DIGEST_BYTES:
        raise CorruptValueError(f"{count} blob lengths do not fit in {n} bytes")
    sizes = struct.unpack_from(f"<{count}Q", value, _HEADER.size)
    if start + sum(sizes) != n - DIGEST_BYTES:
        raise CorruptValueError(f"blob lengths sum to {sum(sizes)}, the value holds more/less")
    blobs, a = [], start
    for size in sizes:
        blobs.append(bytes(view[a : a + size]))
        a += size
    return blobs, raw_bytes


class SharedStoreSettings(BaseModel):
    """The shared tier's settings, validated (a bad one raises ValueError naming it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    """``redis://host:port/db`` (``rediss://`` for TLS, ``unix:///path.sock?db=0``)."""
    budget_bytes: int = Field(gt=0)
    """The server's ``maxmemory``: what all the tier's values together may take there."""
    namespace: str = Field("kvzip", min_length=1)
    """Prefix of every Redis key (``<namespace>:v1:<block key>``), e.g. one per deployment."""
    connect_timeout_s: float = Field(0.2, gt=0, le=60)
    read_timeout_s: float = Field(0.5, gt=0, le=60)
    backoff_initial_s: float = Field(0.5, gt=0, le=3600)
    backoff_max_s: float = Field(30.0, gt=0, le=3600)
    configure_server: bool = True
    """CONFIG SET the server's maxmemory and policy (else only check them)."""
    log_interval_s: float = Field(60.0, ge=0)
    """At most one warning per kind of failure in this long (the rest are counted)."""

    @field_validator("budget_bytes", mode="before")
    @classmethod
    def _not_bool(cls, v):
        if isinstance(v, bool):
            raise ValueError("Input should be an integer, not a bool")
        return v

    @field_validator("connect_timeout_s", "read_timeout_s", "backoff_initial_s", "backoff_max_s")
    @classmethod
    def _finite(cls, v):
        if not math.isfinite(v):
            raise ValueError("must be finite")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v):
        scheme = urllib.parse.urlsplit(v).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(
                f"scheme {scheme!r} is not supported: use redis://host:port/db, "
                "rediss://host:port/db or unix:///path/to/redis.sock"
            )
        return v


@dataclass
class SharedStats:
    """The shared tier's counters (``SharedBlobStore.stats`` returns them as a dict)."""

    shared_budget_bytes: int = 0
    shared_server_maxmemory: int = 0  # as read back from the server (0 until connected)
    shared_up: bool = False  # the last call reached the server
    shared_gets: int = 0
    shared_hits: int = 0
    shared_misses: int = 0  # every get that returned None (absent, failed or refused)
    shared_bytes_read: int = 0  # values' bytes of the hits
    shared_get_seconds: float = 0.0
    shared_puts: int = 0
    shared_stored: int = 0  # values written
    shared_already_held: int = 0  # puts of a key the server held already (not rewritten)
    shared_bytes_written: int = 0
    shared_put_seconds: float = 0.0
    shared_too_large: int = 0  # values larger than the whole budget: not sent
    shared_contains_calls: int = 0
    shared_deletes: int = 0
    shared_corrupt: int = 0  # values failing their digest or form: read as misses, deleted
    shared_errors: int = 0  # calls that failed: connection refused/lost, other client errors
    shared_timeouts: int = 0  # calls that ran into a socket timeout
    shared_refused: int = 0  # the server answered an error (e.g. OOM: nothing evictable)
    shared_config_errors: int = 0  # (re)connections refused: the server's limits are wrong
    shared_skipped_down: int = 0  # calls answered as misses at once, during the backoff
    shared_reconnects: int = 0


_FAILED = object()


class SharedBlobStore:
    """Blocks' blobs in a Redis server, shared by every instance using the same URL and
    namespace. Thread-safe. Every method returns a miss (``None`` / ``False``) instead of
    raising when the server is down, slow or holds a bad value; bad arguments raise."""

    def __init__(self, url: str, budget_bytes: int, **settings):
        try:
            self.settings = SharedStoreSettings(url=url, budget_bytes=budget_bytes, **settings)
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(map(str, err['loc'])) or '?'}: {err['msg']}" for err in e.errors()
            )
            raise ValueError(f"kvzip-vllm shared store: bad setting {problems}") from None
        s = self.settings
        self._prefix = f"{s.namespace}:v{FORMAT_VERSION}:".encode()
        self._lock = threading.Lock()
        self._stats = SharedStats(shared_budget_bytes=s.budget_bytes)
        self._down = False
        self._retry_at = 0.0
        self._backoff = 0.0
        self._closed = False
        self._last_log: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}
        self._client = redis.Redis.from_url(
            s.url,
            socket_connect_timeout=s.connect_timeout_s,
            socket_timeout=s.read_timeout_s,
            # one try per call: our own backoff decides when to try again (redis-py's default
            # retries with sleeps of up to seconds would stall the caller's step)
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
            protocol=2,  # RESP2: served by every Redis (and look-alike) server
            redis_connect_func=self._on_connect,
        )
        try:
            self._client.ping()
        except SharedStoreConfigError:
            self._client.close()
            raise
        except Exception as e:  # noqa: BLE001  (down at start: degrade, retry with backoff)
            self._failed(e)
        else:
            with self._lock:
                self._stats.shared_up = True

    # ------------------------------------------------------------------ server config
    def _on_connect(self, conn) -> None:
        """Every new connection: the handshake, then the server's limits set and checked."""
        conn.on_connect()
        s = self.settings
        set_error = None
        if s.configure_server:
            try:
                for name, value in (("maxmemory", s.budget_bytes), ("maxmemory-policy", POLICY)):
                    conn.send_command("CONFIG", "SET", name, value)
                    conn.read_response()
            except redis.ResponseError as e:
                set_error = e
        try:
            conn.send_command("CONFIG", "GET", "maxmemory*")
            reply = conn.read_response()
        except redis.ResponseError as e:
            raise SharedStoreConfigError(
                f"kvzip-vllm shared store: cannot read the server's maxmemory and "
                f"maxmemory-policy (CONFIG GET: {e})"
                + (f"; CONFIG SET was refused too ({set_error})" if set_error else "")
                + f"; the tier needs maxmemory <= budget_bytes ({s.budget_bytes}) and "
                f"maxmemory-policy {POLICY} on the server"
            ) from None
        if isinstance(reply, dict):  # RESP3 answers a map, RESP2 a flat list
            pairs = list(reply.items())
        else:
            pairs = [(reply[i], reply[i + 1]) for i in range(0, len(reply) - 1, 2)]
        got = {_text(k): _text(v) for k, v in pairs}
        policy = got.get("maxmemory-policy", "?")
        maxmemory = int(got.get("maxmemory", "0") or 0)
        problems = []
        if policy != POLICY:
            problems.append(
                f"maxmemory-policy is {policy!r}, the tier needs {POLICY!r} "
                f"(CONFIG SET maxmemory-policy {POLICY}, or in redis.conf)"
            )
        if maxmemory == 0 or maxmemory > s.budget_bytes:
            have = "0 (no limit)" if maxmemory == 0 else f"{maxmemory} bytes"
            problems.append(
                f"maxmemory is {have}, the tier needs 1..{s.budget_bytes} (budget_bytes) "
                f"(CONFIG SET maxmemory {s.budget_bytes}, or in redis.conf)"
            )
        if problems:
            why = f"; CONFIG SET was refused: {set_error}" if set_error else ""
            raise SharedStoreConfigError(
                "kvzip-vllm shared store: the server's " + "; its ".join(problems) + why
            )
        with self._lock:
            self._stats.shared_server_maxmemory = maxmemory

    # ------------------------------------------------------------------ failure handling
    def _log(self, kind: str, message: str, *, level: int = logging.WARNING) -> None:
        """One line per kind per ``log_interval_s``; the lines held back are counted in it."""
        now = time.monotonic()
        with self._lock:
            last = self._last_log.get(kind)
            if last is not None and now - last < self.settings.log_interval_s:
                self._unlogged[kind] = self._unlogged.get(kind, 0) + 1
                return
            self._last_log[kind] = now
            held = self._unlogged.pop(kind, 0)
        more = f" ({held} more since the last report)" if held else ""
        log.log(level, "kvzip-vllm shared store %s: %s%s", self.settings.url, message, more)

    def _failed(self, error: BaseException) -> None:
        """Count ``error``; for all but the server's own error replies, back off."""
        s = self._stats
        if isinstance(error, redis.ResponseError):
            with self._lock:
                s.shared_refused += 1
            self._log(
                "refused",
                f"server refused a command ({type(error).__name__}: {error}); read as a miss",
            )
            return
        if isinstance(error, SharedStoreConfigError):
            kind, counter = "config", "shared_config_errors"
        elif isinstance(error, redis.TimeoutError):
            kind, counter = "timeout", "shared_timeouts"
        else:
            kind, counter = "error", "shared_errors"
        now = time.monotonic()
        with self._lock:
            setattr(s, counter, getattr(s, counter) + 1)
            first = not self._down
            self._down = True
            s.shared_up = False
            b = self.settings.backoff_initial_s if first else self._backoff * 2
            self._backoff = min(b, self.settings.backoff_max_s)
            self._retry_at = now + self._backoff
            backoff = self._backoff
        try:  # drop every pooled socket: none may hold a late reply to a failed command
            self._client.connection_pool.disconnect()
        except Exception:  # noqa: BLE001
            pass
        self._log(
            kind,
            f"{type(error).__name__}: {error}; answering misses, next try in {backoff:.2f} s",
        )

    def _call(self, fn: Callable[[redis.Redis], object]) -> object:
        """``fn(client)``, or :data:`_FAILED` (counted, logged) without raising; during the
        backoff, :data:`_FAILED` at once."""
        with self._lock:
            if self._closed:
                return _FAILED
            if self._down and time.monotonic() < self._retry_at:
                self._stats.shared_skipped_down += 1
                return _FAILED
            was_down = self._down
        try:
            result = fn(self._client)
        except Exception as e:  # noqa: BLE001  (never into the caller's step)
            self._failed(e)
            return _FAILED
        if was_down:
            with self._lock:
                reconnected = self._down
                self._down = False
                self._backoff = 0.0
                if reconnected:
                    self._stats.shared_reconnects += 1
            if reconnected:
                self._log("reconnect", "server reachable again", level=logging.INFO)
        with self._lock:
            self._stats.shared_up = True
        return result

    # ------------------------------------------------------------------ the store
    def redis_key(self, key: bytes) -> bytes:
        """The Redis key holding block ``key``."""
        if not isinstance(key, bytes | bytearray | memoryview) or len(key) == 0:
            raise TypeError(f"key must be non-empty bytes, got {type(key).__name__}")
        return self._prefix + bytes(key)

    def get(self, key: bytes) -> list[bytes] | None:
        """The blobs stored under ``key`` (refreshing its LRU age on the server), or None:
        not held, evicted, damaged (deleted) or the server unreachable."""
        entry = self.get_entry(key)
        return None if entry is None else entry.blobs

    def get_entry(self, key: bytes) -> SharedEntry | None:
        """Like :meth:`get`, with the block's uncompressed bytes as stored by :meth:`put`."""
        rkey = self.redis_key(key)
        t0 = time.perf_counter()
        value = self._call(lambda c: c.get(rkey))
        s = self._stats
        entry = None
        if value is not _FAILED and value is not None:
            try:
                blobs, raw_bytes = decode_value(rkey, value)
                entry = SharedEntry(blobs, raw_bytes)
            except CorruptValueError as e:
                with self._lock:
                    s.shared_corrupt += 1
                self._log("corrupt", f"key {rkey[-8:].hex()}…: {e}; deleted, read as a miss")
                self._call(lambda c: c.delete(rkey))
        with self._lock:
            s.shared_gets += 1
            s.shared_get_seconds += time.perf_counter() - t0
            if entry is None:
                s.shared_misses += 1
            else:
                s.shared_hits += 1
                s.shared_bytes_read += len(value)
        return entry

    def put(self, key: bytes, blobs: Sequence[bytes | memoryview], *, raw_bytes: int = 0) -> bool:
        """Store one block's ``blobs`` under ``key`` unless the server holds it already
        (first writer wins: equal keys mean equal prefixes). ``raw_bytes``: the block's
        uncompressed bytes (kept for the reader's counters). True if the server holds the
        key after the call; False if not sent (larger than the budget, server unreachable)
        or refused by the server."""
        rkey = self.redis_key(key)
        if len(blobs) == 0:
            raise ValueError("blobs is empty: a block has one blob per layer and kind")
        if not isinstance(raw_bytes, int) or raw_bytes < 0:
            raise ValueError(f"raw_bytes must be a non-negative int, got {raw_bytes!r}")
        t0 = time.perf_counter()
        value = encode_value(rkey, blobs, raw_bytes)
        s = self._stats
        if len(value) > self.settings.budget_bytes:
            with self._lock:
                s.shared_puts += 1
                s.shared_too_large += 1
            return False
        reply = self._call(lambda c: c.set(rkey, value, nx=True))
        with self._lock:
            s.shared_puts += 1
            s.shared_put_seconds += time.perf_counter() - t0
            if reply is _FAILED:
                return False
            if reply is None:  # NX: held already
                s.shared_already_held += 1
            else:
                s.shared_stored += 1
                s.shared_bytes_written += len(value)
        return True

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether the server holds it now (one pipelined round trip of
        EXISTS, which leaves the keys' LRU ages alone); all False if unreachable. A key
        found here may still be evicted before it is read: :meth:`get` may miss."""
        rkeys = [self.redis_key(k) for k in keys]
        if not rkeys:
            return []

        def probe(c: redis.Redis):
            pipe = c.pipeline(transaction=False)
            for rk in rkeys:
                pipe.exists(rk)
            return pipe.execute()

        reply = self._call(probe)
        with self._lock:
            self._stats.shared_contains_calls += 1
        if reply is _FAILED:
            return [False] * len(rkeys)
        return [bool(r) for r in reply]

    def delete(self, key: bytes) -> bool:
        """Remove ``key``; True if the server held it."""
        rkey = self.redis_key(key)
        reply = self._call(lambda c: c.delete(rkey))
        with self._lock:
            self._stats.shared_deletes += 1
        return reply is not _FAILED and bool(reply)

    @property
    def stats(self) -> dict:
        """A snapshot of the counters (:class:`SharedStats`)."""
        with self._lock:
            d = asdict(self._stats)
        d["shared_hit_rate"] = (
            round(d["shared_hits"] / d["shared_gets"], 4) if d["shared_gets"] else 0.0
        )
        return d

    def close(self) -> None:
        """Disconnect; every later call is a miss."""
        with self._lock:
            self._closed = True
            self._stats.shared_up = False
        self._client.close()

    def __enter__(self) -> SharedBlobStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class SharedEntry:
    blobs: list[bytes]
    raw_bytes: int


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
