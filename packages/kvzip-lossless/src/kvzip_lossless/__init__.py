"""kvzip_lossless."""

from kvzip_lossless._version import __version__

__all__ = ["__version__"]
