import json

import pytest
from click.testing import CliRunner

from kvzip_eval.cmd_eval import command
from kvzip_eval.quality.stats import wilson

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
    # bf16 never departs from itself: the whole continuation, an interval of one point
    n_ref = len(data["reference"]["outputs"])
    assert n_ref == 1 and bf16["first_departure"] >= 1
    assert bf16["first_departure_ci95"] == [bf16["first_departure"]] * 2
    assert bf16["words_changed_ci95"] == [0.0, 0.0]
    assert bf16["identical_ci95"] == pytest.approx(wilson(1, 1))  # 1 of 1 identical
    # retrieval per cell: sample count, Wilson interval, McNemar against bf16 (itself: p = 1)
    cell = ("niah_multikey_1", "300")
    for f in (bf16, int4):
        acc = f["retrieval"][cell[0]][cell[1]]
        assert f["retrieval_n"][cell[0]][cell[1]] == 1
        assert f["retrieval_ci95"][cell[0]][cell[1]] == pytest.approx(wilson(round(acc), 1))
    assert bf16["retrieval_p_vs_bf16"][cell[0]][cell[1]] == 1.0
    assert 0 <= int4["first_departure"] <= bf16["first_departure"]
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
    assert "first departure, identical outputs (95% intervals)" in md
    assert "| bf16 | 0.000 [0.000, 0.000] |" in md
    for png in ("frontier.png", "kl.png", "capacity.png", "retrieval.png"):
        assert (out / "rep" / png).read_bytes()[:4] == b"\x89PNG"
    # readable without the docs: column meanings, the best format for the size, what next
    assert "top1_agree: share of positions where the most likely next token is bf16's" in (
        res.output
    )
    assert "Best quality for the size" in res.output and "  int4 (4.250 bits" in res.output
    assert "kvzip eval --full --device cuda" in res.output
    assert f"wrote {out / 'rep' / 'report.md'}" in res.output


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
    from kvzip_eval.calibrate import shipped

    monkeypatch.setattr(model, "cache_dir", lambda: tmp_path)  # no default calibration there
    monkeypatch.setattr(shipped, "shipped_calibration", lambda identity: None)  # none shipped
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


def test_shipped_calibration_is_used_for_the_embedded_model(loaded, tmp_path, monkeypatch):
    """The first `kvzip eval` needs no calibration run: one ships for the embedded model,
    found by its identity (weights' contents), and only for it."""
    import dataclasses

    import click

    from kvzip_eval import model
    from kvzip_eval.calibrate.shipped import shipped_calibration
    from kvzip_eval.cmd_eval import resolve_formats
    from kvzip_formats.calibration import Calibration

    monkeypatch.setattr(model, "cache_dir", lambda: tmp_path)  # nothing cached
    d = shipped_calibration(loaded.info.identity)
    assert d is not None, f"no shipped calibration for identity {loaded.info.identity}"
    Calibration.load(d).check_model(loaded.info)
    assert sum(f.stat().st_size for f in d.iterdir()) < 200_000  # small enough to ship
    got = resolve_formats(["4bit"], None, loaded.info, auto_calibrate=lambda: 1 / 0)
    assert got["4bit"].calibration.identity == loaded.info.identity
    # another model (other weights: another identity) does not get it
    other = dataclasses.replace(loaded.info, identity="0" * 16)
    assert shipped_calibration(other.identity) is None
    with pytest.raises(click.UsageError, match="needs a calibration"):
        resolve_formats(["4bit"], None, other)


def test_frontier_names_the_best_format_for_each_size():
    from kvzip_eval.quality.report import frontier

    def r(**fmts):
        return {"formats": {n: {"bits": b, "kl_mean": k} for n, (b, k) in fmts.items()}}

    on, beaten = frontier(
        r(bf16=(16, 0.0), fp8=(8, 0.01), int4=(4.25, 0.13), rot=(4.25, 0.06), c4=(4.1251, 0.058))
    )
    assert on == ["c4", "fp8", "bf16"]  # fewest bits first
    assert dict(beaten) == {"rot": "c4", "int4": "c4"}
    # about one size (within 0.01 bits): the closer to bf16 wins; a tie beats neither
    on, beaten = frontier(r(a=(4.125, 0.07), b=(4.1251, 0.05), c=(3.0, 0.05)))
    assert on == ["c"] and dict(beaten) == {"a": "c", "b": "c"}
    on, _ = frontier(r(a=(4.125, 0.05), b=(4.1251, 0.05)))
    assert on == ["a", "b"]


def test_frontier_sizes_residual_windows_by_their_bits():
    """The default run's formats, with KLs of results/quality/window_sweep_cpu: a 128-token
    window (+0.016 bits, 0.4-0.5%) is the same size as its format and beats it; int4-rot (3%
    larger than 4bit) is beaten by 4bit+r128; a window 1.5% larger than its format is a size
    of its own."""
    from kvzip_eval.quality.report import frontier, frontier_lines

    fmts = {
        "bf16": (16, 0.0),
        "fp8": (8, 0.0113),
        "int4": (4.25, 0.1349),
        "int4-rot": (4.25, 0.0623),
        "turbo4": (4.125, 0.0698),
        "4bit": (4.1251, 0.0586),
        "3bit": (3.125, 0.1443),
        "int4-rot+r128": (4.2656, 0.0045),
        "4bit+r128": (4.1407, 0.0033),
        "3bit+r128": (3.1406, 0.0082),
    }
    result = {"formats": {n: {"bits": b, "kl_mean": k} for n, (b, k) in fmts.items()}}
    on, beaten = frontier(result)
    assert on == ["3bit+r128", "4bit+r128", "bf16"]
    by = dict(beaten)
    assert by["3bit"] == "3bit+r128" and by["4bit"] == "4bit+r128"
    assert by["int4-rot"] == by["int4-rot+r128"] == by["fp8"] == "4bit+r128"
    text = "\n".join(frontier_lines(result))
    assert "not 3bit (3.125 bits, KL 0.1443): 3bit+r128 is 0.5% larger and closer" in text
    assert "not int4-rot (4.250 bits, KL 0.0623): 4bit+r128 is no larger and closer" in text
    # a wider window, 1.5% over its format's bits, no longer counts as the same size
    wide = {
        "4bit": {"bits": 4.125, "kl_mean": 0.0586},
        "4bit+r512": {"bits": 4.1875, "kl_mean": 0.001},
    }
    assert frontier({"formats": wide}) == (["4bit", "4bit+r512"], [])


def test_default_formats_add_the_recommended_windows(loaded):
    """Without --formats: every registered format, then int4-rot and the compact formats
    with the README's 128-token window, each measured through the window."""
    from kvzip_eval.cmd_eval import default_formats, resolve_formats
    from kvzip_eval.quality.window import Windowed
    from kvzip_formats import list_formats

    names = default_formats()
    assert names == [
        *list_formats(),
        "int4-rot+r128",
        "4bit+r128",
        "3.5bit+r128",
        "3bit+r128",
    ]
    fmts = resolve_formats(names, None, loaded.info, explicit=False)  # the shipped calibration
    assert list(fmts) == names
    for n in ("int4-rot", "4bit", "3.5bit", "3bit"):
        w = fmts[f"{n}+r128"]
        assert isinstance(w, Windowed) and w.recent == 128 and w.format.name == n
        # the window's bf16 copies are in its bits: 128 tokens x 16 bits over 131,072 tokens
        extra = w.bits_per_element() - fmts[n].bits_per_element()
        assert extra == pytest.approx(128 * 16 / 131072, rel=1e-6)


@pytest.mark.slow  # end to end: runs the command on the model
def test_default_style_run_kl_only_with_the_default_report_dir(loaded, tmp_path, monkeypatch):
    # --prompts 0 / --retrieval-samples 0 leave those measures out, as the default preset does
    from kvzip_eval.cmd_eval import DEFAULT_REPORT_DIR

    monkeypatch.chdir(tmp_path)
    args = ["--quick", "--no-progress", "--kl-length", "48", "--formats", "bf16,int4"]
    res = CliRunner().invoke(command, [*args, "--prompts", "0", "--retrieval-samples", "0"])
    assert res.exit_code == 0, res.output
    rep = tmp_path / DEFAULT_REPORT_DIR
    md = (rep / "report.md").read_text()
    assert (rep / "frontier.png").is_file() and not (rep / "retrieval.png").exists()
    head = res.stdout.splitlines()[0]
    assert head.startswith("| format | bits | kl_mean |") and "words_changed" not in head
    assert "retrieval" not in head
    assert "words changed and retrieval: not measured in this run" in res.output
    assert "Retrieval accuracy" not in md and "words changed not measured" in md
    res = CliRunner().invoke(command, [*args, "--prompts", "-1"])
    assert res.exit_code == 2 and "prompts must be >= 0" in res.output


def test_default_preset_is_sized_for_a_first_look():
    from kvzip_eval.quality.suite import PRESETS

    d = PRESETS["default"]
    # KL only: the stages that took 8 of 10 minutes on 2 shared cores and could not tell the
    # formats apart at this size are left to --full
    assert d.prompts == 0 and d.retrieval_samples == 0
    assert d.kl_windows * d.kl_length == 2048


@pytest.mark.slow  # end to end: runs the command on the model
def test_a_residual_window_format_end_to_end(loaded, tmp_path):
    """``int4+r16`` beside ``int4`` through KL, words and retrieval: the window's bf16 copies
    are in its bits, every run (bf16 included) used the band attention, the window brings the
    format closer to bf16, and the report says where it is served."""
    out = tmp_path / "w.json"
    res = CliRunner().invoke(
        command,
        [*TINY, "--formats", "int4,int4+r16", "--json", str(out), "--report", str(tmp_path / "r")],
    )
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    f = data["formats"]
    assert f["int4+r16"]["bits"] == pytest.approx(f["int4"]["bits"] + 16 * 16 / 131072, abs=1e-4)
    assert "band_attention" in data["attention"]
    assert f["int4+r16"]["kl_mean"] < f["int4"]["kl_mean"]
    assert f["int4+r16"]["words_changed"] is not None and f["int4+r16"]["retrieval"]
    assert "KVZIP_KV_FORMAT=4bit+r128" in (tmp_path / "r" / "report.md").read_text()
    res = CliRunner().invoke(command, [*TINY, "--formats", "int4+r0"])
    assert res.exit_code == 2 and "N >= 1" in res.output
