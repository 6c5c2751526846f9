"""The user's kvzip settings: environment variables, overridable by vLLM's additional config.

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

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

ENV_FORMAT = "KVZIP_KV_FORMAT"
ENV_CALIBRATION = "KVZIP_CALIBRATION"


@dataclass(frozen=True)
class BackendSettings:
    kv_format: str
    calibration: str | None


def backend_enabled() -> bool:
    return bool(os.environ.get(ENV_FORMAT, "").strip())


def backend_settings(vllm_config=None) -> BackendSettings:
    """The format and calibration for this process (env, then ``additional_config['kvzip']``)."""
    name = os.environ.get(ENV_FORMAT, "").strip()
    calibration = os.environ.get(ENV_CALIBRATION) or None
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
    return BackendSettings(name, calibration)


@lru_cache(maxsize=8)
def load_format(name: str, calibration: str | None):
    """The kvzip_formats codec (loaded once per process)."""
    import kvzip_formats

    return kvzip_formats.get_format(name, calibration=calibration)


# ---------------------------------------------------------------------------- connector
# The lossless tier's settings: ``kv_connector_extra_config`` keys, with environment fallbacks.

ENV_TIER_BYTES = "KVZIP_TIER_BYTES"
ENV_STATS_PATH = "KVZIP_STATS_PATH"
ENV_TIER_TABLES = "KVZIP_TIER_TABLES"
DEFAULT_BUDGET_BYTES = 4 << 30
#: key -> environment variable read when the key is absent
CONNECTOR_ENV = {
    "budget_bytes": ENV_TIER_BYTES,
    "stats_path": ENV_STATS_PATH,
    "tables_path": ENV_TIER_TABLES,
}


class ConnectorSettingsError(ValueError):
    """A ``kv_connector_extra_config`` the tier cannot take; the message names the key."""


class ConnectorSettings(BaseModel):
    """The tier's settings (``kv_connector_extra_config``), validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    budget_bytes: int = Field(DEFAULT_BUDGET_BYTES, gt=0)
    """CPU memory the compressed blocks may take."""
    stats_path: str | None = None
    """JSON file the worker rewrites with the tier's counters."""
    tables_path: str | None = None
    """A ``kvzip_lossless.TableSet`` file for this model (fitted offline)."""
    fit_tokens: int = Field(1024, ge=0)
    """Without ``tables_path``: fit the table set from the first this many tokens stored
    (0: never; every blob then embeds its own table)."""

    @field_validator("budget_bytes", "fit_tokens", mode="before")
    @classmethod
    def _not_bool(cls, v):
        if isinstance(v, bool):
            raise ValueError("Input should be an integer, not a bool")
        return v


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
        if key not in values and environ.get(env):
            values[key] = environ[env]
            source[key] = f"environment variable {env}"
    try:
        return model(**values)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            key = str(err["loc"][0]) if err["loc"] else "?"
            problems.append(
                f"{key}={values.get(key)!r} (from {source.get(key, 'default')}): {err['msg']}"
            )
        raise ConnectorSettingsError(
            "kvzip-vllm connector: bad setting " + "; ".join(problems)
        ) from None
