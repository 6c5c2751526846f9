"""kvzip_formats."""

from kvzip_formats._version import __version__

__all__ = ["__version__"]
