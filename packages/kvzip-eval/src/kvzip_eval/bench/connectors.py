"""The connectors a tier benchmark runs (``kvzip bench tier`` and ``tier-decode``): vLLM's
``OffloadingConnector`` (``offload``), kvzip's tier (``kvzip``), none, and variants of kvzip's
tier named with their settings (``kvzip:KEY=VALUE;...``)."""

from __future__ import annotations

import json
import re

CONNECTORS = ("offload", "kvzip", "none")


class ConnectorError(ValueError):
    pass


def parse_connector(name: str) -> tuple[str, dict]:
    """``kvzip:KEY=VALUE;KEY=VALUE`` (a variant of the tier with those connector settings,
    ``kv_connector_extra_config``, e.g. ``kvzip:load_mode=sync`` or
    ``kvzip:switch_interval_s=0``: two designs side by side in one run) -> ("kvzip", {KEY:
    VALUE}); a plain name -> (name, {}). Values are JSON where they parse (numbers, true),
    text otherwise."""
    base, _, rest = name.partition(":")
    if base not in CONNECTORS:
        raise ConnectorError(
            f"connector {name!r}: one of {', '.join(CONNECTORS)}, or kvzip:KEY=VALUE;..."
        )
    if not rest:
        return base, {}
    if base != "kvzip":
        raise ConnectorError(f"connector {name!r}: only kvzip takes settings (kvzip:KEY=VALUE;...)")
    extra = {}
    for item in rest.split(";"):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConnectorError(f"connector {name!r}: {item!r} is not KEY=VALUE")
        try:
            extra[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            extra[key.strip()] = value
    return base, extra


def file_label(name: str) -> str:
    """A connector's name in a file name (``kvzip:load_mode=sync``: ``kvzip-load_mode-sync``)."""
    return re.sub(r"[^A-Za-z0-9_.]+", "-", name).strip("-")
