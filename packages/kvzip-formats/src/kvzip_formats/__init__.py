"""kvzip_formats: KV-cache format specs, bit accounting and reference codecs."""

from kvzip_formats import baselines as _baselines  # noqa: F401  (registers the baselines)
from kvzip_formats._version import __version__
from kvzip_formats.base import (
    FormatError,
    KVFormat,
    get_format,
    list_formats,
    register_format,
)

__all__ = [
    "FormatError",
    "KVFormat",
    "__version__",
    "get_format",
    "list_formats",
    "register_format",
]
from kvzip_formats import compact as _compact  # noqa: F401
