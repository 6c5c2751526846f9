"""One evaluation run: KL, words changed and retrieval for several formats on the same inputs.

Settings presets: ``quick`` (about a minute on 2 CPU cores) for tests and checks,
``default`` (KL only, a few minutes there) for a first look, ``full`` for published numbers:
the quality protocol, 8 windows of the model's full context, 256 prompts x 32 new tokens,
100 samples per retrieval task and length. ``full`` is meant for a GPU (``--device cuda``):
on 2 shared CPU cores an 8,192-token forward of SmolLM2-135M took 128 s, so the protocol
would take days there. Every count can be changed with the command's options.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

import torch
from tqdm.auto import tqdm

from kvzip_eval.corpus import token_windows
from kvzip_eval.quality import kl as kl_mod
from kvzip_eval.quality import retrieval, stats, window, words
from kvzip_eval.quality.generate import generate


@dataclass(frozen=True)
class Settings:
    kl_windows: int
    kl_length: int  # 0 = the model's context length
    prompts: int
    passage_tokens: int
    new_tokens: int
    retrieval_lengths: tuple[int, ...]  # 0 = the model's context length
    retrieval_samples: int
    tasks: tuple[str, ...] = retrieval.DEFAULT_TASKS
    gen_batch: int = 8
    seed: int = 0
    #: run the bf16 reference twice (KL and words changed) and report the difference: the
    #: noise floor of a device whose kernels are not bit-reproducible (GPUs)
    noise_floor: bool = False

    def resolved(self, max_context: int) -> Settings:
        """Lengths of 0 (or beyond the model) become the model's context length."""
        kl_len = self.kl_length if 0 < self.kl_length <= max_context else max_context
        lens = sorted({L if 0 < L <= max_context else max_context for L in self.retrieval_lengths})
        return replace(self, kl_length=kl_len, retrieval_lengths=tuple(lens))


PRESETS = {
    "quick": Settings(
        kl_windows=1,
        kl_length=256,
        prompts=2,
        passage_tokens=64,
        new_tokens=16,
        retrieval_lengths=(512,),
        retrieval_samples=1,
    ),
    # The first look, sized to finish in minutes on 2 CPU cores: KL, which tells the formats
    # apart on 2,048 positions. Words changed and retrieval are left out (prompts = 0,
    # retrieval_samples = 0): with 4 prompts and 2 samples per task (the earlier default) they
    # took 231 s and 266 s of a 616 s suite for 8 formats at load ~6 and could not separate
    # the formats (retrieval of bf16 itself 0.50); --full on a GPU measures them.
    "default": Settings(
        kl_windows=2,
        kl_length=1024,
        prompts=0,
        passage_tokens=128,
        new_tokens=64,
        retrieval_lengths=(512,),
        retrieval_samples=0,
    ),
    # The quality protocol of docs/protocol.md. Words changed over a short window: 256
    # prompts x 32 greedy tokens separate fp8, int4 and int4-rot beyond their 95% intervals
    # (first departure on 48 CPU prompts: fp8 14.3 [11.1, 17.7], int4 2.6 [1.6, 3.9], int4-rot
    # 4.5 [3.0, 6.4]; the intervals narrow as 1/sqrt(prompts)); longer continuations only
    # add text written after the outputs parted. Retrieval: the tasks and lengths bf16
    # passes (>= 0.9, results/quality/retrieval_bf16.md), 100 samples per cell. gen_batch
    # 100: a retrieval cell in one batch on a GPU (the command lowers it to 8 on the CPU).
    "full": Settings(
        kl_windows=8,
        kl_length=0,
        prompts=256,
        passage_tokens=128,
        new_tokens=32,
        retrieval_lengths=(512, 1024),
        retrieval_samples=100,
        gen_batch=100,
    ),
}
#: What the quality protocol asks for (docs/protocol.md, "Quality protocol").
PROTOCOL = PRESETS["full"]


@dataclass
class SuiteResult:
    formats: dict = field(default_factory=dict)
    reference: dict = field(default_factory=dict)
    timings_s: dict = field(default_factory=dict)


#: The words-changed statistics besides the two means (``words.summarize``).
WORDS_EXTRA = ("words_changed_ci95", "identical_ci95", "first_departure", "first_departure_ci95")


def bits_of(fmt, info) -> dict:
    """Effective bits per element by the accounting of docs/protocol.md: at the Llama-3.1-8B
    shape (131k tokens) and at the evaluated model's own shape."""
    return {
        "bits": round(fmt.bits_per_element(), 4),
        "bits_model": round(
            fmt.bits_per_element(
                head_dim=info.head_dim,
                num_layers=info.num_layers,
                num_kv_heads=info.num_kv_heads,
            ),
            4,
        ),
    }


def _bar(total: int, desc: str, progress: bool):
    return tqdm(total=total, desc=desc, unit="prompt", disable=not progress)


def run_words(loaded, formats: dict, prompts: list[str], s: Settings, progress: bool) -> dict:
    tok = loaded.tokenizer
    ids = words.prompt_ids(tok, prompts)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # little padding per batch
    sorted_ids = [ids[i] for i in order]
    bar = _bar(len(ids) * (len(formats) + 1), "words", progress)
    bar.set_postfix_str("bf16 reference")
    ref, exact = generate(
        loaded,
        sorted_ids,
        None,
        max_new_tokens=s.new_tokens,
        batch_size=s.gen_batch,
        probes=formats,
        on_batch=bar.update,
    )
    ref_text = [tok.decode(o, skip_special_tokens=True) for o in ref]
    out = {}
    if s.noise_floor:
        bar.set_postfix_str("bf16 again")
        again, _ = generate(
            loaded, sorted_ids, None, max_new_tokens=s.new_tokens, batch_size=s.gen_batch
        )
        again_text = [tok.decode(o, skip_special_tokens=True) for o in again]
        out["__rerun__"] = words.summarize(ref_text, again_text, ref, again)
    for name, fmt in formats.items():
        bar.set_postfix_str(name)
        if name in exact:
            got = ref
            bar.update(len(ids))
        else:
            got, _ = generate(
                loaded,
                sorted_ids,
                fmt,
                max_new_tokens=s.new_tokens,
                batch_size=s.gen_batch,
                on_batch=bar.update,
            )
        got_text = [tok.decode(o, skip_special_tokens=True) for o in got]
        out[name] = words.summarize(ref_text, got_text, ref, got)
        out[name]["exact"] = name in exact
    bar.close()
    out["__reference__"] = {"outputs": [ref_text[order.index(i)] for i in range(len(ids))]}
    return out


def run_retrieval(loaded, formats: dict, s: Settings, text_file, progress: bool) -> dict:
    tok = loaded.tokenizer
    samples = retrieval.make_samples(
        tok, s.tasks, s.retrieval_lengths, s.retrieval_samples, seed=s.seed, text_file=text_file
    )
    groups: dict[tuple[str, int], list] = {}
    for smp in samples:
        groups.setdefault((smp.task, smp.length), []).append(smp)
    bar = _bar(len(samples) * (len(formats) + 1), "retrieval", progress)
    passed: dict[str, dict] = {n: {} for n in ["__reference__", *formats]}
    for (task, length), group in groups.items():
        prompts = [list(x.prompt_ids) for x in group]
        new = retrieval.ANSWER_TOKENS[task]
        bar.set_postfix_str(f"{task} {length} bf16")
        ref, exact = generate(
            loaded,
            prompts,
            None,
            max_new_tokens=new,
            batch_size=s.gen_batch,
            probes=formats,
            on_batch=bar.update,
        )
        runs = {"__reference__": ref}
        for name, fmt in formats.items():
            bar.set_postfix_str(f"{task} {length} {name}")
            if name in exact:
                runs[name] = ref
                bar.update(len(group))
            else:
                runs[name], _ = generate(
                    loaded,
                    prompts,
                    fmt,
                    max_new_tokens=new,
                    batch_size=s.gen_batch,
                    on_batch=bar.update,
                )
        for name, outs in runs.items():
            texts = [tok.decode(o, skip_special_tokens=True) for o in outs]
            passed[name][(task, length)] = [
                retrieval.score(x, t) for x, t in zip(group, texts, strict=True)
            ]
    bar.close()
    return {n: retrieval_stats(passed[n], passed["__reference__"]) for n in passed}


def retrieval_stats(passed: dict, reference: dict) -> dict:
    """Per task and length: accuracy, its Wilson 95% interval, the sample count, and the
    exact McNemar p-value of the format's pass/fail against bf16's on the same samples."""
    out = {"acc": {}, "ci95": {}, "n": {}, "p_vs_bf16": {}}
    for (task, length), ok in passed.items():
        L = str(length)
        out["acc"].setdefault(task, {})[L] = sum(ok) / len(ok)
        out["ci95"].setdefault(task, {})[L] = stats.wilson(sum(ok), len(ok))
        out["n"].setdefault(task, {})[L] = len(ok)
        out["p_vs_bf16"].setdefault(task, {})[L] = stats.mcnemar_p(ok, reference[(task, length)])
    return out


def check_formats(loaded, formats: dict) -> None:
    """Refuse formats that cannot encode this model's K/V (head size, layer count, ...)."""
    from kvzip_formats import FormatError

    info = loaded.info
    x = torch.randn(2, info.num_kv_heads, info.head_dim, generator=torch.Generator().manual_seed(0))
    for name, fmt in formats.items():
        for layer in (0, info.num_layers - 1):
            try:
                fmt.roundtrip(x.to(torch.bfloat16), kind="k", layer=layer, start=0)
                fmt.roundtrip(x.to(torch.bfloat16), kind="v", layer=layer, start=0)
            except FormatError as e:
                raise FormatError(
                    f"format {name!r} cannot handle model {info.name} (head_dim "
                    f"{info.head_dim}, {info.num_kv_heads} KV heads, {info.num_layers} layers): {e}"
                ) from e


def run_suite(
    loaded,
    formats: dict,
    settings: Settings,
    *,
    text_file=None,
    prompts_file=None,
    progress: bool = True,
) -> tuple[dict, Settings]:
    """Measure every format; returns the ``formats`` section of the JSON and the settings used."""
    s = settings.resolved(loaded.info.max_context)
    check_formats(loaded, formats)
    # a residual window in the run: every run, the reference included, through one attention
    # function (window.band_attention) so the KL compares formats, not implementations
    banded = window.any_windowed(formats)
    with window.band_mode(loaded.model, banded):
        result = _measure(loaded, formats, s, text_file, prompts_file, progress)
    result["attention"] = ATTENTION_BAND if banded else ATTENTION_MODEL
    return result, s


#: What the ``attention`` field of a run says.
ATTENTION_MODEL = "the model's own (sdpa)"
ATTENTION_BAND = (
    "kvzip_eval.quality.window.band_attention (float32) for every run, the reference included:"
    " a residual-window format (+rN) is in the run"
)


def _measure(loaded, formats: dict, s: Settings, text_file, prompts_file, progress) -> dict:
    t = {}
    t0 = time.perf_counter()
    wins = token_windows(
        loaded.tokenizer, s.kl_windows, s.kl_length, text_file=text_file, seed=s.seed
    )
    kl = kl_mod.measure_kl(loaded, formats, wins, progress=progress, rerun_reference=s.noise_floor)
    t["kl"] = time.perf_counter() - t0

    # prompts = 0 / retrieval_samples = 0: that measure is not run (its fields are None / {})
    prompts, wc, rt = [], None, None
    if s.prompts > 0:
        t0 = time.perf_counter()
        if prompts_file:
            prompts = words.file_prompts(prompts_file, s.prompts)
        else:
            prompts = words.corpus_prompts(
                loaded.tokenizer, s.prompts, s.passage_tokens, text_file=text_file, seed=s.seed
            )
        wc = run_words(loaded, formats, prompts, s, progress)
        t["words"] = time.perf_counter() - t0
    if s.retrieval_samples > 0:
        t0 = time.perf_counter()
        rt = run_retrieval(loaded, formats, s, text_file, progress)
        t["retrieval"] = time.perf_counter() - t0

    out = {}
    for name, fmt in formats.items():
        k = kl[name]
        out[name] = {
            **bits_of(fmt, loaded.info),
            "kl_mean": k.kl_mean,
            "kl_median": k.kl_median,
            "kl_p99": k.kl_p99,
            "top1_agree": k.top1_agree,
            "words_changed": wc[name]["words_changed"] if wc else None,
            "identical": wc[name]["identical"] if wc else None,
            **{k: wc[name][k] if wc else None for k in WORDS_EXTRA},
            "retrieval": rt[name]["acc"] if rt else {},
            "retrieval_ci95": rt[name]["ci95"] if rt else {},
            "retrieval_n": rt[name]["n"] if rt else {},
            "retrieval_p_vs_bf16": rt[name]["p_vs_bf16"] if rt else {},
            "kl_by_position": k.kl_by_position,
            "kl_positions": k.positions,
            "reused_reference": {"kl": k.exact, "words": wc[name]["exact"] if wc else None},
        }
    reference = {
        "retrieval": rt["__reference__"]["acc"] if rt else {},
        "retrieval_ci95": rt["__reference__"]["ci95"] if rt else {},
        "outputs": wc["__reference__"]["outputs"] if wc else [],
    }
    if s.noise_floor:
        again = kl[kl_mod.RERUN]
        reference["noise_floor"] = {
            "kl_mean": again.kl_mean,
            "kl_p99": again.kl_p99,
            "top1_agree": again.top1_agree,
            "words_changed": wc["__rerun__"]["words_changed"] if wc else None,
            "identical": wc["__rerun__"]["identical"] if wc else None,
            "first_departure": wc["__rerun__"]["first_departure"] if wc else None,
        }
    extra = {
        "reference": reference,
        "prompts": prompts,
        "timings_s": {k: round(v, 1) for k, v in t.items()},
    }
    return {"formats": out, **extra}


def settings_dict(s: Settings) -> dict:
    return asdict(s)
