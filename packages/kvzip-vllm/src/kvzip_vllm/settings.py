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
