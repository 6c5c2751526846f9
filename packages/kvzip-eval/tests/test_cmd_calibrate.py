"""``kvzip calibrate``: the artifact it writes matches the model's own K/V, and errors are clear."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from kvzip_eval.cmd_calibrate import command


@pytest.mark.slow  # end to end: runs the command on the model
def test_calibrate_writes_artifact_matching_capture_kv(loaded, tmp_path):
    from kvzip_eval.corpus import token_windows
    from kvzip_eval.model import capture_kv
    from kvzip_formats import get_format
    from kvzip_formats.calibration import Calibration

    out = tmp_path / "cal"
    res = CliRunner().invoke(
        command,
        ["--out", str(out), "--windows", "1", "--length", "48"]
        + ["--json", str(tmp_path / "c.json"), "--report", str(tmp_path / "rep")],
    )
    assert res.exit_code == 0, res.output
    rec = json.loads((tmp_path / "c.json").read_text())
    assert rec["result"] == "calibrate" and rec["calibration_dir"] == str(out)
    assert rec["model"]["identity"] == loaded.info.identity and rec["windows"] == 1
    assert str(out) in (tmp_path / "rep" / "report.md").read_text()
    doc = json.loads((out / "calibration.json").read_text())
    assert doc["kvzip_calibration_version"] == 1
    assert doc["model"]["identity"] == loaded.info.identity
    assert doc["fit"]["split"] == "calib" and doc["fit"]["tokens_per_layer"] == 47
    cal = Calibration.load(out)
    cal.check_model(loaded.info)
    # the statistics are those of the calibration forward's K/V on the same window (float64,
    # the model's own forward to 1e-3: test_calibrate_exact.py), rounded once to float32
    from kvzip_eval.calibrate.exact import ExactLlama

    ids = token_windows(loaded.tokenizer, 1, 48, split="calib", seed=0)
    kv = {li: (k, v) for li, _, _, k, v in ExactLlama(loaded.model).qkv(ids)}
    cache_kv = capture_kv(loaded, ids)  # what a bf16 cache stores, from the bf16 forward
    inv = loaded.model.model.rotary_emb.inv_freq.double()
    keep = torch.cat((inv, inv)) * loaded.info.max_context <= 0.25  # pairs RoPE barely turns
    assert cal.fit["rotary_adjust"]["turning_channels"] == int((~keep).sum()) > 0
    for layer in (0, 17, 29):
        k, v = (t[1:] for t in kv[layer])
        mean, var, weight = cal.stats("k", layer)
        assert torch.allclose(mean.double()[:, keep], k.mean(0)[:, keep], rtol=1e-6, atol=1e-7)
        assert (mean[:, ~keep] == 0).all()
        want = k.var(0, unbiased=False)[:, keep]
        assert torch.allclose(var.double()[:, keep], want, rtol=1e-6, atol=1e-7)
        second = (k**2).mean(0)  # turning pairs: second moment about 0, averaged over the pair
        h = loaded.info.head_dim // 2
        pair = torch.cat(((second[:, :h] + second[:, h:]) / 2,) * 2, -1)
        assert torch.allclose(var.double()[:, ~keep], pair[:, ~keep], rtol=1e-6, atol=1e-7)
        assert (weight > 0).all()
        assert torch.allclose(cal.stats("v", layer)[0].double(), v.mean(0), rtol=1e-6, atol=1e-7)
        # and the bf16 cache's means to bf16's precision (its forward drifts from float64 by
        # up to 4e-2 of a layer's largest entry; the means, measured: <= 5e-3)
        kb, vb = (t[1:].double() for t in cache_kv[layer])
        for got, ref, big in (
            (mean[:, keep], kb.mean(0)[:, keep], kb.abs().max()),
            (cal.stats("v", layer)[0], vb.mean(0), vb.abs().max()),
        ):
            assert (got.double() - ref).abs().max() < 0.02 * big, layer
    x = cache_kv[3][0][:5]
    # and the formats run on it
    for name in ("4bit", "3.5bit", "3bit"):
        r = get_format(name, calibration=out).roundtrip(x, kind="k", layer=3)
        assert r.shape == x.shape and torch.equal(r[0], x[0])


def test_calibrate_text_too_short(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("only a few words here")
    res = CliRunner().invoke(command, ["--out", str(tmp_path / "c"), "--text-file", str(short)])
    assert res.exit_code == 2 and "text too short" in res.output
    assert not (tmp_path / "c").exists()


def test_calibrate_bad_model_path(tmp_path):
    res = CliRunner().invoke(
        command, ["--model", str(tmp_path / "missing"), "--out", str(tmp_path / "c")]
    )
    assert res.exit_code == 2 and "does not exist" in res.output


@pytest.mark.slow  # end to end: the whole default calibration (~3 minutes of CPU)
def test_shipped_calibration_is_what_kvzip_calibrate_makes(loaded, tmp_path):
    """The calibration shipped for the embedded model is reproduced byte for byte by the
    command it records (with the default settings); a change to the fit must ship a new one."""
    from kvzip_eval.calibrate.shipped import shipped_calibration

    shipped = shipped_calibration(loaded.info.identity)
    assert shipped is not None
    fit = json.loads((shipped / "calibration.json").read_text())["fit"]
    assert fit["command"].startswith("kvzip calibrate --out ")
    assert "--windows" not in fit["command"] and "--length" not in fit["command"]
    res = CliRunner().invoke(command, ["--out", str(tmp_path / "again")])
    assert res.exit_code == 0, res.output
    again = (tmp_path / "again" / "calibration.safetensors").read_bytes()
    assert again == (shipped / "calibration.safetensors").read_bytes(), (
        "`kvzip calibrate` no longer reproduces the shipped calibration: regenerate it with "
        f"{fit['command'].split(' --json')[0]}"
    )
