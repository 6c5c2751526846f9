"""kvzip_vllm."""

from kvzip_vllm._version import __version__

__all__ = ["__version__"]
