"""kvzip_eval."""

from kvzip_eval._version import __version__

__all__ = ["__version__"]
