"""The user's kvzip settings: environment variables, overridable by vLLM's additional config.

Every variable is a row of kvzip's one table of settings (``kvzip_formats.settings``: its
type, default and documentation); this module reads them through those rows.

- ``KVZIP_KV_FORMAT=4bit`` turns the compact-format attention backend on (any name
  ``kvzip_formats.list_formats()`` shows). It has to be an environment variable: vLLM loads
  general plugins in every process before it parses a config, and an unset variable keeps
  the plugin inert.
- ``KVZIP_CALIBRATION=DIR``: the calibration directory (``kvzip calibrate --out DIR``) for
  formats that need one.
- ``--additional-config '{"kvzip": {"kv_format": "4bit", "calibration": "DIR"}}'`` overrides
  both once the backend is on (handy for one server among several in an environment).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvzip_formats import settings as table

ENV_FORMAT = table.KV_FORMAT.name
ENV_CALIBRATION = table.CALIBRATION.name
#: tokens of cache per residual-window slot (``window.py``; a format spelled ``NAME+rN``)
ENV_WINDOW_SLOT_TOKENS = table.WINDOW_SLOT_TOKENS.name


@dataclass(frozen=True)
class BackendSettings:
    kv_format: str  # the format's name, without a residual window's ``+rN``
    calibration: str | None
    recent: int = 0  # a residual window of this many bf16 tokens (``NAME+rN``)
    window_slot_tokens: int = table.WINDOW_SLOT_TOKENS.default


def backend_enabled() -> bool:
    return table.KV_FORMAT.raw() is not None


def backend_settings(vllm_config=None) -> BackendSettings:
    """The format and calibration for this process (env, then ``additional_config['kvzip']``)."""
    name = table.KV_FORMAT.raw() or ""
    calibration = table.CALIBRATION.raw()
    if vllm_config is None:
        try:
            from vllm.config import get_current_vllm_config

            vllm_config = get_current_vllm_config()
        except Exception:  # noqa: BLE001  (no config is current outside an engine)
            vllm_config = None
    extra = getattr(vllm_config, "additional_config", None) or {}
    kvzip = extra.get("kvzip", {}) if isinstance(extra, dict) else {}
    name = kvzip.get("kv_format", name)
    calibration = kvzip.get("calibration", calibration)
    if not name:
        raise ValueError(f"kvzip-vllm: set {ENV_FORMAT} (e.g. {ENV_FORMAT}=4bit) for the backend")
    from kvzip_formats.window import split_name

    base, recent = split_name(name)
    slot = table.WINDOW_SLOT_TOKENS
    raw = slot.raw() or kvzip.get("window_slot_tokens")
    try:
        slot_tokens = slot.default if raw in (None, "") else slot.parse(str(raw))
    except table.SettingError as e:
        raise ValueError(f"kvzip-vllm: {e}") from None
    return BackendSettings(base, calibration, recent, slot_tokens)


@lru_cache(maxsize=8)
def load_format(name: str, calibration: str | None):
    """The kvzip_formats codec (loaded once per process)."""
    import kvzip_formats

    return kvzip_formats.get_format(name, calibration=calibration)


# ---------------------------------------------------------------------------- connector
# The lossless tier's settings: ``kv_connector_extra_config`` keys, with environment fallbacks.

ENV_TIER_BYTES = table.TIER_BYTES.name
ENV_STATS_PATH = table.STATS_PATH.name
ENV_TIER_TABLES = table.TIER_TABLES.name
ENV_SHARED_URL = table.SHARED_URL.name
ENV_SHARED_BYTES = table.SHARED_BYTES.name
ENV_CHUNK_TOKENS = table.TIER_CHUNK_TOKENS.name
DEFAULT_BUDGET_BYTES = table.TIER_BYTES.default
#: tokens per stored entry by default (see ``ConnectorSettings.chunk_tokens``)
DEFAULT_CHUNK_TOKENS = table.TIER_CHUNK_TOKENS.default
#: key -> environment variable read when the key is absent (the table's rows whose override
#: is a ``kv_connector_extra_config`` key)
CONNECTOR_ENV = table.connector_env()


class ConnectorSettingsError(ValueError):
    """A ``kv_connector_extra_config`` the tier cannot take; the message names the key."""


class ConnectorSettings(BaseModel):
    """The tier's settings (``kv_connector_extra_config``), validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    budget_bytes: int = Field(DEFAULT_BUDGET_BYTES, gt=0)
    """CPU memory the tier takes: its arena of compressed chunks, allocated once at this size
    (page-locked on a CUDA host)."""
    chunk_tokens: int = Field(DEFAULT_CHUNK_TOKENS, gt=0)
    """Tokens per stored entry, a multiple of vLLM's block size: the tier stores, keys and
    restores whole chunks of this many tokens (a prompt's tokens past its last whole chunk
    are computed by vLLM)."""
    stats_path: str | None = None
    """JSON file the worker rewrites with the tier's counters."""
    tables_path: str | None = None
    """A ``kvzip_lossless.TableSet`` file for this model (fitted offline)."""
    store_queue_bytes: int | None = Field(None, gt=0)
    """GPU memory the stores waiting to be coded may take (their staged bf16 copies, made on
    the device so vLLM can reuse the blocks at once, and outside vLLM's KV-cache accounting).
    None (the default): half the device memory still free once vLLM has allocated its KV
    cache, less the coder's working memory (twice ``KVZIP_STORE_ENCODE_BYTES``: 1 GiB), at
    most 16 GiB (at least one 8,192-token prefill step of an 8B-shaped model fits in 1 GiB).
    A step's stores that would pass it are spilled raw to page-locked host memory inside
    ``budget_bytes`` (``stores_spilled_host``) and coded later, or, with no room there
    either, the step waits for the queue (``stores_waited_queue_full``). An empty queue
    always takes one step's stores; the first ``fit_tokens`` tokens' copies are also kept
    until the table set is fitted from them. On the CPU: the host memory the copies of chunks
    waiting for the coder thread may take (None: 1 GiB; past it the step waits for room;
    ``kvzip_vllm.core.background``)."""
    store_queue_reserved: bool = False
    """CUDA: the store queue's device memory (``store_queue_bytes``) is allocated once, when
    the tier starts, and each step's staged copies take an extent of it (a step whose copies
    find no room there is allocated by torch: ``stores_stage_allocated``). False (the default
    until a GPU run compares the two): each step's copies are allocated by torch's caching
    allocator as they come; with vLLM holding most of the device, an allocation it cannot
    serve from its cache makes it free the cache and retry, which waits for the whole device
    (``cuda_alloc_retries``). Reserved, the queue's unused bytes are no longer free for the
    encoder's working memory (about 1.7x the bf16 bytes of the job it codes), and the default
    queue is taken from no more than what vLLM leaves outside its budget (``1 -
    gpu_memory_utilization`` of the device): reserved from the memory free at start-up, which
    still holds what vLLM's forward needs for its activations, it ran the forward out of
    memory on an H100."""
    load_mode: Literal["async", "sync"] = "async"
    """How a prefix hit is restored. ``"async"`` (the default): the request waits in vLLM's
    ``WAITING_FOR_REMOTE_KVS`` while the tier's load thread copies, decodes and writes its
    chunks on the tier's own streams; the forward of the running requests never waits for it,
    a failed chunk is known before the request computes anything, and vLLM's asynchronous
    scheduling and model runner V2 are accepted. ``"sync"``: the chunks are restored inside
    the step that computes the request (before its forward), which needs synchronous
    scheduling and vLLM's V1 model runner (refused at start-up otherwise)."""
    switch_interval_s: float = Field(0.0002, ge=0, le=0.1)
    """Python's switch interval (``sys.setswitchinterval``) while the tier's load thread or
    (on CUDA) its store thread has work; restored when neither has (0: never changed).
    vLLM's engine loop keeps the GIL busy, and each time a tier thread releases it (a stream
    call, a copy) it waits up to the interval to get it back: 5 ms by Python's default, which
    made the tier's host work several times slower beside vLLM's loop
    (``kvzip_vllm.core.gil``)."""
    idle_wait_s: float = Field(0.005, ge=0, le=0.1)
    """In a step that schedules no tokens while asynchronous loads are in flight (requests
    only wait for their restores), vLLM's poll waits up to this long for a load to finish, the
    GIL released, instead of returning at once: the engine loop otherwise spins through such
    steps holding the GIL the load thread needs (0: never waits). A load that finishes ends
    the wait; a step that computes anything never waits."""
    fit_tokens: int = Field(1024, ge=0)
    """Without ``tables_path``: fit the table set from the first this many tokens stored
    (0: never; every blob then embeds its own table)."""
    shared_url: str | None = None
    """The shared tier's Redis server (``redis://127.0.0.1:6379/0``); None: off (the default).
    Needs ``tables_path`` or ``fit_tokens=0`` (every instance codes with the same tables)."""
    shared_budget_bytes: int | None = Field(None, gt=0)
    """The server's ``maxmemory`` (set by the tier, LRU eviction): the same on every instance."""
    shared_timeout_s: float | None = Field(None, gt=0, le=60)
    """Connect and read timeout of each call to the server (default 0.2 s / 0.5 s)."""

    @field_validator(
        "budget_bytes",
        "fit_tokens",
        "shared_budget_bytes",
        "chunk_tokens",
        "store_queue_bytes",
        mode="before",
    )
    @classmethod
    def _not_bool(cls, v):
        if isinstance(v, bool):
            raise ValueError("Input should be an integer, not a bool")
        return v

    @model_validator(mode="after")
    def _shared(self):
        if not self.shared_url:
            given = [k for k in ("shared_budget_bytes", "shared_timeout_s") if getattr(self, k)]
            if given:
                raise ValueError(f"{', '.join(given)} given without shared_url")
            return self
        if self.shared_budget_bytes is None:
            raise ValueError(
                "shared_url needs shared_budget_bytes (the server's maxmemory, the same on "
                "every instance)"
            )
        if not self.tables_path and self.fit_tokens != 0:
            raise ValueError(
                "shared_url needs tables_path (one table set file for every instance) or "
                "fit_tokens=0 (each blob embeds its table): a set fitted by each instance "
                "from its own first blocks differs between instances, so a block stored by one "
                "would not decode on another"
            )
        return self


def connector_settings(extra: dict | None = None, environ=None):
    """The tier's settings from ``kv_connector_extra_config`` (``extra``), each absent key
    read from its environment variable (:data:`CONNECTOR_ENV`), then the default. An unknown
    key or a bad value raises :class:`ConnectorSettingsError` naming it and the known keys."""
    model = ConnectorSettings
    known = sorted(model.model_fields)
    environ = os.environ if environ is None else environ
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ConnectorSettingsError(
            f"kvzip-vllm connector: kv_connector_extra_config must be a dict, got "
            f"{type(extra).__name__}; known keys: {', '.join(known)}"
        )
    unknown = sorted(k for k in extra if k not in model.model_fields)
    if unknown:
        raise ConnectorSettingsError(
            f"kvzip-vllm connector: unknown kv_connector_extra_config key"
            f"{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"known keys: {', '.join(known)}"
        )
    values = dict(extra)
    source = {k: "kv_connector_extra_config" for k in values}
    for key, env in CONNECTOR_ENV.items():
        raw = table.find(env).raw(environ)
        if key not in values and raw is not None:
            values[key] = raw
            source[key] = f"environment variable {env}"
    try:
        return model(**values)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            if not err["loc"]:  # a rule over several keys: its message names them
                problems.append(err["msg"].removeprefix("Value error, "))
                continue
            key = str(err["loc"][0])
            problems.append(
                f"{key}={values.get(key)!r} (from {source.get(key, 'default')}): {err['msg']}"
            )
        raise ConnectorSettingsError(
            "kvzip-vllm connector: bad setting " + "; ".join(problems)
        ) from None


def blocks_per_chunk(chunk_tokens: int, block_size: int) -> int:
    """vLLM blocks per tier chunk; :class:`ConnectorSettingsError` unless ``chunk_tokens`` is
    a positive multiple of ``block_size``."""
    if block_size <= 0 or chunk_tokens <= 0 or chunk_tokens % block_size:
        raise ConnectorSettingsError(
            f"kvzip-vllm connector: chunk_tokens={chunk_tokens} is not a multiple of vLLM's "
            f"block size {block_size}; supported: chunk_tokens = k * {block_size} for k >= 1 "
            f"(e.g. {max(1, DEFAULT_CHUNK_TOKENS // max(block_size, 1)) * block_size})"
        )
    return chunk_tokens // block_size
