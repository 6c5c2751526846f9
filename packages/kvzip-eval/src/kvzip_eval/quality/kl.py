"""KL(P_bf16 || P_format) at every position of token windows, over the full vocabulary.

``measure_kl`` runs the bf16 reference once per window and each format once, keeps only the
final hidden states (``[T, hidden]``, 9 MB for 8,192 tokens of SmolLM2), then projects both
to logits chunk by chunk (8,192 x 49,152 float32 logits would be 1.6 GB) with the model's own
lm_head (bf16, as the served model computes them) and takes log-softmax and KL in float32.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from kvzip_eval.quality import window
from kvzip_eval.quality.hook import FormatCache

#: Positions per logits chunk: 512 x 49,152 float32 = 100 MB per tensor.
CHUNK = 512
#: Name under which ``measure_kl(rerun_reference=True)`` reports the reference against itself.
RERUN = "__bf16_rerun__"
#: KL-by-position is reported as the mean over this many equal spans of the window.
POSITION_BUCKETS = 8


@dataclass
class KLStats:
    kl_mean: float
    kl_median: float
    kl_p99: float
    top1_agree: float
    positions: int
    #: mean KL over POSITION_BUCKETS equal spans of the window, first to last
    kl_by_position: list[float] = field(default_factory=list)
    #: True when the format was bit-exact on every K/V of the reference run (reused)
    exact: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def final_hidden(loaded, ids: torch.Tensor, fmt=None, probes=None) -> tuple[torch.Tensor, set]:
    """Final-norm hidden states ``[T, hidden]`` of one window ``ids [1, T]`` through ``fmt``."""
    cache = FormatCache(loaded.model.config, fmt, probes=probes)
    with window.reading(cache):
        out = loaded.model.model(input_ids=ids, past_key_values=cache, use_cache=True)
    return out.last_hidden_state[0], cache.exact


def _log_probs(loaded, h: torch.Tensor) -> torch.Tensor:
    logits = loaded.model.get_output_embeddings()(h)
    return torch.log_softmax(logits.float(), dim=-1)


@torch.no_grad()
def kl_positions_many(
    loaded, h_ref: torch.Tensor, hs: dict[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per-position KL(ref || fmt) (float32 ``[T]``) and top-1 agreement (bool ``[T]``) for
    each format's hidden states in ``hs``; the reference's log-probs are computed once per
    chunk (the lm_head is ~20% of a window's cost at 8,192 tokens)."""
    kls = {n: [] for n in hs}
    agree = {n: [] for n in hs}
    for s in range(0, h_ref.shape[0], CHUNK):
        lp_ref = _log_probs(loaded, h_ref[s : s + CHUNK])
        p_ref = lp_ref.exp()
        top_ref = lp_ref.argmax(-1)
        for n, h in hs.items():
            # A reused reference (an exact format) has the same hidden states: same log-probs.
            lp = lp_ref if h is h_ref else _log_probs(loaded, h[s : s + CHUNK])
            kls[n].append((p_ref * (lp_ref - lp)).sum(-1))
            agree[n].append(top_ref == lp.argmax(-1))
    return {n: (torch.cat(kls[n]), torch.cat(agree[n])) for n in hs}


def kl_positions(
    loaded, h_ref: torch.Tensor, h_fmt: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position KL(ref || fmt) and top-1 agreement for one format."""
    return kl_positions_many(loaded, h_ref, {"x": h_fmt})["x"]


def summarize(kl: torch.Tensor, agree: torch.Tensor, exact: bool = False) -> KLStats:
    """Stats over ``kl``/``agree`` of shape ``[windows, T]``."""
    flat = kl.flatten().double()
    buckets = [float(c.mean()) for c in kl.double().chunk(POSITION_BUCKETS, dim=1)]
    return KLStats(
        kl_mean=float(flat.mean()),
        kl_median=float(flat.median()),
        kl_p99=float(torch.quantile(flat, 0.99)),
        top1_agree=float(agree.float().mean()),
        positions=flat.numel(),
        kl_by_position=buckets,
        exact=exact,
    )


@torch.no_grad()
def measure_kl(
    loaded,
    formats: dict,
    windows: torch.Tensor,
    *,
    reuse_exact: bool = True,
    progress: bool = True,
    rerun_reference: bool = False,
) -> dict[str, KLStats]:
    """KL of each format against the bf16 reference on ``windows`` (``LongTensor[n, T]``).

    The reference runs once per window. With ``reuse_exact`` a format that is bit-exact on
    every K/V of the reference run (e.g. ``bf16``) is not run again: its forward would repeat
    the reference's bit for bit, so its KL is exactly 0 (``KLStats.exact`` says so).

    ``rerun_reference`` runs the bf16 reference a second time per window and adds its KL
    against the first under ``RERUN``: 0 where the device computes bit-reproducibly (the
    CPU), the run's noise floor where it does not.

    Example::

        loaded = load_model()
        wins = token_windows(loaded.tokenizer, 2, 2048)
        stats = measure_kl(loaded, {"int4": get_format("int4")}, wins)
        stats["int4"].kl_mean
    """
    if windows.dim() != 2:
        raise ValueError(f"windows must be LongTensor[n, T], got shape {tuple(windows.shape)}")
    names = list(formats) + ([RERUN] if rerun_reference else [])
    kls = {n: [] for n in names}
    agrees = {n: [] for n in names}
    exact_all = set(formats) if reuse_exact else set()
    bar = tqdm(total=len(windows) * (len(names) + 1), desc="KL", unit="run", disable=not progress)
    for ids in windows:
        ids = ids.unsqueeze(0).to(loaded.model.device)
        probes = {n: formats[n] for n in exact_all}
        h_ref, exact = final_hidden(loaded, ids, None, probes=probes)
        exact_all &= exact
        bar.update(1)
        hs = {}
        for n in names:
            bar.set_postfix_str(n)
            if n == RERUN:
                hs[n] = final_hidden(loaded, ids, None)[0]
            else:
                hs[n] = h_ref if n in exact_all else final_hidden(loaded, ids, formats[n])[0]
            bar.update(1)
        for n, (kl, agree) in kl_positions_many(loaded, h_ref, hs).items():
            kls[n].append(kl)
            agrees[n].append(agree)
    bar.close()
    return {
        n: summarize(torch.stack(kls[n]).cpu(), torch.stack(agrees[n]).cpu(), exact=n in exact_all)
        for n in names
    }
