"""Gather calibration statistics with an attention hook (post-RoPE q, k, v of every layer)."""

from __future__ import annotations

import contextlib

import torch
from tqdm.auto import tqdm

HOOK_NAME = "kvzip_calibrate"
_ACTIVE: list = []  # the accumulator of the running fit (one at a time)


def _attention(module, query, key, value, attention_mask, **kwargs):
    """``query [B, Hq, T, d]``, ``key``/``value [B, Hkv, T, d]`` after RoPE; then plain sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _ACTIVE:
        acc = _ACTIVE[-1]
        for b in range(query.shape[0]):
            # the statistics accumulate in float64 on the CPU, wherever the model runs
            acc.update(
                module.layer_idx,
                query[b].transpose(0, 1).cpu(),
                key[b].transpose(0, 1).cpu(),
                value[b].transpose(0, 1).cpu(),
            )
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@contextlib.contextmanager
def _hooked(model, acc):
    from transformers import AttentionInterface

    AttentionInterface.register(HOOK_NAME, _attention)
    old = model.config._attn_implementation
    model.config._attn_implementation = HOOK_NAME
    _ACTIVE.append(acc)
    try:
        yield
    finally:
        _ACTIVE.pop()
        model.config._attn_implementation = old


def model_record(info) -> dict:
    """The model identity a calibration carries (spec/calibration.md, ``model``)."""
    return {
        "name": info.name,
        "identity": info.identity,
        "num_layers": info.num_layers,
        "num_q_heads": info.num_q_heads,
        "num_kv_heads": info.num_kv_heads,
        "head_dim": info.head_dim,
    }


@torch.no_grad()
def fit(loaded, windows: torch.Tensor, *, fit_record: dict | None = None, progress: bool = True):
    """Calibration of ``loaded`` (a kvzip_eval LoadedModel) on ``windows`` ``LongTensor[n, T]``."""
    from kvzip_formats.calibration import StatsAccumulator, rotary_adjust

    info = loaded.info
    if windows.dim() != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be LongTensor[n, T >= 2], got shape {tuple(windows.shape)}")
    acc = StatsAccumulator(info.num_layers, info.num_q_heads, info.num_kv_heads, info.head_dim)
    model = loaded.model
    with _hooked(model, acc):
        for ids in tqdm(windows, desc="calibrate", unit="window", disable=not progress):
            # logits_to_keep=1: only the attention layers matter here, not the 49k-way head
            model(input_ids=ids.unsqueeze(0).to(model.device), use_cache=False, logits_to_keep=1)
    o_proj = [layer.self_attn.o_proj.weight.detach().float().cpu() for layer in model.model.layers]
    record = dict(
        fit_record or {}, windows=int(windows.shape[0]), window_tokens=int(windows.shape[1])
    )
    cal = acc.finalize(o_proj, model_record(info), record)
    # K's mean and per-channel spread hold at long positions only for pairs RoPE barely turns
    # (kvzip_formats.calibration.rotary_adjust); the model's own inv_freq has any scaling in it
    inv_freq = model.model.rotary_emb.inv_freq.detach().double().cpu()
    return rotary_adjust(cal, inv_freq, info.max_context)
