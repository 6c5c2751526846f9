"""kvzip_kernels."""

from kvzip_kernels._version import __version__

__all__ = ["__version__"]
