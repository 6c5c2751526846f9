"""The compact-format backend inside vLLM on CUDA (vLLM 0.26 on the H200), one vLLM per process.

    python vllm_gpu_backend.py --out r.json --format 4bit [--shape 8b|tiny] [--gpu-mem 0.9]
    python vllm_gpu_backend.py --out r.json --format fp8     # vLLM's own cache, fp8 (baseline)
    python vllm_gpu_backend.py --out r.json --format bf16    # vLLM's own cache, bf16

No weights or tokenizer: a Llama ``config.json`` (Llama-3.1-8B's shape, or a tiny one) with
``load_format="dummy"``; compact formats get a synthetic calibration of the model's shape
(``kvzip_kernels.testing.synthetic_calibration``: the byte sizes and kernels do not depend on
its values). CUDA graphs on (``enforce_eager=False``). Reports vLLM's KV capacity (blocks x
block size), the CUDA graph mode vLLM resolved, which backend paths ran (``paged.PATH_CALLS``:
vLLM runs in this process), and the generations: a prompt computed (chunked prefill), then the
same prompts again (prefix-cache hits: their first blocks' sinks read back from the pool).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # PATH_CALLS seen in-process
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # 0.26's sampler, no FlashInfer
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvzip_eval.bench.engines import LLAMA31_8B  # noqa: E402  (the one copy of the 8B config)

_SHAPE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
)

SHAPES = {
    # Llama-3.1-8B's attention and size (32 layers, 32 query heads, 8 KV heads, head 128)
    "8b": dict({k: LLAMA31_8B[k] for k in _SHAPE_KEYS}, head_dim=128),
    "tiny": dict(
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        vocab_size=32000,
        max_position_embeddings=8192,
        rope_theta=10000.0,
    ),
}


def model_dir(shape: str, root: Path) -> Path:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        **SHAPES[shape],
    }
    d = root / f"llama-{shape}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def calibration_dir(shape: str, root: Path) -> str:
    from kvzip_kernels.testing import synthetic_calibration

    s = SHAPES[shape]
    cal = synthetic_calibration(
        s["num_key_value_heads"],
        s["head_dim"],
        num_layers=s["num_hidden_layers"],
        num_q_heads=s["num_attention_heads"],
    )
    out = root / f"calibration-{shape}"
    cal.save(out)
    return str(out)


def run(args) -> dict:
    root = Path(tempfile.mkdtemp(prefix="kvzip-gpu-"))
    compact = args.format not in ("bf16", "fp8")
    if compact:
        os.environ["KVZIP_KV_FORMAT"] = args.format
        os.environ["KVZIP_CALIBRATION"] = calibration_dir(args.shape, root)
    else:
        os.environ.pop("KVZIP_KV_FORMAT", None)
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    from kvzip_kernels import paged

    if compact:
        # vLLM runs in this process, so registering here also works where kvzip-vllm's
        # entry point is not installed (PYTHONPATH=packages/*/src); with it, a no-op repeat
        from kvzip_vllm import plugin

        plugin.register_backend_if_enabled()
    t0 = time.perf_counter()
    llm = LLM(
        model=str(model_dir(args.shape, root)),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        kv_cache_dtype="fp8" if args.format == "fp8" else "auto",
        attention_backend="CUSTOM" if compact else None,
        enforce_eager=False,
        max_model_len=args.prompt_tokens + args.max_tokens + 64,
        max_num_seqs=max(args.num_prompts, 4),
        max_num_batched_tokens=args.batched_tokens,
        gpu_memory_utilization=args.gpu_mem,
        # a few graph sizes (the batch is at most max_num_seqs): capturing vLLM's default
        # list took most of the 47-65 s start of each engine measured on the H200
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]},
        seed=0,
    )
    start_s = time.perf_counter() - t0
    vcfg = llm.llm_engine.vllm_config
    cc = vcfg.cache_config
    g = torch.Generator().manual_seed(1)
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts = [
        {"prompt_token_ids": torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist()}
        for _ in range(args.num_prompts)
    ]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    paged.PATH_CALLS.clear()
    t = time.perf_counter()
    first = llm.generate(prompts, greedy, use_tqdm=False)
    first_s = time.perf_counter() - t
    calls_first = dict(paged.PATH_CALLS)
    t = time.perf_counter()
    again = llm.generate(prompts, greedy, use_tqdm=False)  # prefix-cache hits
    again_s = time.perf_counter() - t
    ids = [list(o.outputs[0].token_ids) for o in first]
    ids_again = [list(o.outputs[0].token_ids) for o in again]
    return {
        "format": args.format,
        "shape": args.shape,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "gpu_memory_utilization": args.gpu_mem,
        "block_size": cc.block_size,
        "num_blocks": cc.num_gpu_blocks,
        "capacity_tokens": cc.num_gpu_blocks * cc.block_size,
        "cudagraph_mode": str(vcfg.compilation_config.cudagraph_mode),
        "start_s": round(start_s, 1),
        "generate_s": [round(first_s, 2), round(again_s, 2)],
        "path_calls_first": calls_first,
        "path_calls": dict(paged.PATH_CALLS),
        "token_ids": ids,
        "token_ids_again": ids_again,
        "all_generated": all(len(i) == args.max_tokens for i in ids),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--format", default="4bit", help="a kvzip format, or bf16 / fp8 (vLLM's)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--gpu-mem", type=float, default=0.90)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--batched-tokens", type=int, default=2048, help="chunked prefill's chunk")
    args = ap.parse_args()
    args.out.write_text(json.dumps(run(args), indent=1))
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow teardown


if __name__ == "__main__":
    sys.exit(main())
