"""Gather calibration statistics: each layer's queries, keys (both after RoPE) and values from
the deterministic forward of ``kvzip_eval.calibrate.exact``, so the calibration's bytes are the
same on any CPU, SIMD width and thread count."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm


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
    from kvzip_eval.calibrate.exact import ExactLlama
    from kvzip_formats.calibration import StatsAccumulator, rotary_adjust

    info = loaded.info
    if windows.dim() != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be LongTensor[n, T >= 2], got shape {tuple(windows.shape)}")
    acc = StatsAccumulator(info.num_layers, info.num_q_heads, info.num_kv_heads, info.head_dim)
    model = loaded.model
    forward = ExactLlama(model)
    steps = info.num_layers * int(windows.shape[0])
    with tqdm(total=steps, desc="calibrate", unit="layer", disable=not progress) as bar:
        # the statistics accumulate in float64 on the CPU, wherever the model runs
        for layer, _, q, k, v in forward.qkv(windows):
            acc.update(layer, q.cpu(), k.cpu(), v.cpu())
            bar.update(1)
    o_proj = [layer.self_attn.o_proj.weight.detach().double().cpu() for layer in model.model.layers]
    record = dict(
        fit_record or {}, windows=int(windows.shape[0]), window_tokens=int(windows.shape[1])
    )
    cal = acc.finalize(o_proj, model_record(info), record)
    # K's mean and per-channel spread hold at long positions only for pairs RoPE barely turns
    # (kvzip_formats.calibration.rotary_adjust); the frequencies are the forward's own
    return rotary_adjust(cal, forward.inv_freq, info.max_context)
