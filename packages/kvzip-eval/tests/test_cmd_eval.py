import json

import pytest
from click.testing import CliRunner

from kvzip_eval.cmd_eval import command

TINY = [
    "--quick",
    "--no-progress",
    "--kl-length",
    "48",
    "--prompts",
    "1",
    "--new-tokens",
    "4",
    "--tasks",
    "niah_multikey_1",
    "--retrieval-lengths",
    "300",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory, loaded):
    out = tmp_path_factory.mktemp("eval")
    res = CliRunner().invoke(
        command,
        [
            *TINY,
            "--formats",
            "bf16,int4",
            "--json",
            str(out / "q.json"),
            "--report",
            str(out / "rep"),
            "--noise-floor",
        ],
    )
    assert res.exit_code == 0, res.output
    return res, json.loads((out / "q.json").read_text()), out


@pytest.mark.slow  # end to end: runs the command on the model
def test_json_schema_and_values(run):
    _, data, _ = run
    assert data["model"]["name"] == "SmolLM2-135M-Instruct"
    assert data["text"] == "pydoc_data.topics"
    assert set(data["formats"]) == {"bf16", "int4"}
    for f in data["formats"].values():
        for key in (
            "bits",
            "kl_mean",
            "kl_median",
            "kl_p99",
            "top1_agree",
            "words_changed",
            "identical",
            "retrieval",
        ):
            assert key in f
        assert set(f["retrieval"]) == {"niah_multikey_1"}
        assert set(f["retrieval"]["niah_multikey_1"]) == {"300"}
    bf16, int4 = data["formats"]["bf16"], data["formats"]["int4"]
    assert bf16["kl_mean"] == 0.0 and bf16["identical"] == 1.0 and bf16["words_changed"] == 0
    assert int4["kl_mean"] > 0 and int4["bits"] == 4.25 and bf16["bits"] == 16
    prov = data["provenance"]
    assert {"date", "machine", "versions", "command"} <= set(prov)


@pytest.mark.slow  # end to end: runs the command on the model
def test_noise_floor_is_zero_on_the_cpu(run):
    # the CPU computes bit-reproducibly: the reference run twice agrees with itself exactly
    _, data, out = run
    nf = data["reference"]["noise_floor"]
    assert nf["kl_mean"] == 0 and nf["top1_agree"] == 1
    assert nf["words_changed"] == 0 and nf["identical"] == 1
    assert "noise floor" in (out / "rep" / "report.md").read_text()
    assert "__bf16_rerun__" not in data["formats"]


@pytest.mark.slow  # end to end: runs the command on the model
def test_table_and_report(run):
    res, _, out = run
    assert "| bf16 |" in res.output and "| int4 |" in res.output
    md = (out / "rep" / "report.md").read_text()
    assert "command:" in md and "versions:" in md and "| int4 |" in md
    for png in ("kl.png", "capacity.png", "retrieval.png"):
        assert (out / "rep" / png).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow  # end to end: runs the command on the model
def test_report_command_rebuilds_the_eval_report(run, tmp_path):
    from kvzip_eval.cli import main

    _, data, out = run
    assert data["result"] == "eval"
    res = CliRunner().invoke(main, ["report", str(out / "q.json"), "--report", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "report.md").read_text() == (out / "rep" / "report.md").read_text()
    for png in ("kl.png", "capacity.png", "retrieval.png"):
        assert (tmp_path / png).is_file()


def test_unknown_format_and_task():
    res = CliRunner().invoke(command, [*TINY, "--formats", "int5"])
    assert res.exit_code != 0 and "unknown format 'int5'" in res.output
    res = CliRunner().invoke(command, ["--quick", "--tasks", "niah_x"])
    assert res.exit_code != 0 and "unknown tasks" in res.output


def test_bad_model_path(tmp_path):
    res = CliRunner().invoke(command, [*TINY, "--model", str(tmp_path / "nope")])
    assert res.exit_code != 0 and "does not exist" in res.output


def test_unsupported_head_dim_refused(loaded):
    from kvzip_eval.quality.suite import check_formats
    from kvzip_formats import FormatError

    class NeedsHead128:
        def roundtrip(self, x, *, kind, layer, start=0):
            raise FormatError(f"head_dim must be 128, got {x.shape[-1]}")

    with pytest.raises(FormatError, match=r"cannot handle model SmolLM2.*head_dim 64"):
        check_formats(loaded, {"h128": NeedsHead128()})


def test_calibrated_formats_need_calibration(loaded, tmp_path, monkeypatch):
    import click

    from kvzip_eval import model
    from kvzip_eval.cmd_eval import resolve_formats
    from kvzip_formats import get_format, list_formats

    needs = [n for n in list_formats() if get_format(n).needs_calibration]
    assert needs, "the compact formats (4bit, 3.5bit, 3bit) need a calibration"
    monkeypatch.setattr(model, "cache_dir", lambda: tmp_path)  # no default calibration there
    with pytest.raises(click.UsageError, match=f"format '{needs[0]}' needs a calibration"):
        resolve_formats(["int4", needs[0]], None, loaded.info)
    # Asked for every format by default: skipped with a note instead.
    got = resolve_formats(["int4", needs[0]], None, loaded.info, explicit=False)
    assert list(got) == ["int4"]
    # `kvzip eval` passes an auto-calibration: it runs once, only for a format that needs it,
    # and a calibration it could not make still ends in the clear error.
    calls = []
    with pytest.raises(click.UsageError, match="needs a calibration"):
        resolve_formats(
            ["int4", needs[0]], None, loaded.info, auto_calibrate=lambda: calls.append(1)
        )
    assert calls == [1]


def test_device_cuda_without_gpu_refused(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = CliRunner().invoke(command, [*TINY, "--device", "cuda"])
    assert res.exit_code == 2 and "torch sees no CUDA GPU" in res.output
