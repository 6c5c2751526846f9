"""The `kvzip` command reads as one tool: every command takes the same output options, prints
a table, and `kvzip report` rebuilds a report from any command's --json output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvzip_eval.cli import SUBCOMMANDS, main

REPO = Path(__file__).resolve().parents[3]
#: commands that print no result table (`kvzip model path` prints a folder): no --json/--report;
#: `kvzip bench`'s subcommands write their files into --out DIR (tests/test_bench_*.py)
NO_RESULT = {"model", "bench"}


@pytest.mark.parametrize("name", sorted(set(SUBCOMMANDS) - NO_RESULT))
def test_every_command_lists_the_shared_output_options(name):
    res = CliRunner().invoke(main, [name, "--help"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "--report DIRECTORY Write report.md (and its plots) into DIR." in text
    if name != "report":  # report reads a JSON; it writes only the report
        assert "--json FILE Write the results as JSON to PATH ('-': standard output;" in text


def test_group_help_lists_every_command():
    res = CliRunner().invoke(main, ["--help"])
    assert res.exit_code == 0
    for name in ("eval", "calibrate", "capacity", "lossless", "report"):
        assert f"  {name} " in res.output


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_unknown_option_is_an_error(name):
    res = CliRunner().invoke(main, [name, "--no-such-option"])
    assert res.exit_code == 2 and "No such option '--no-such-option'" in res.output


def test_unknown_command_is_an_error():
    res = CliRunner().invoke(main, ["reprot"])
    assert res.exit_code == 2 and "No such command 'reprot'" in res.output


def test_json_to_stdout_keeps_stdout_parseable():
    res = CliRunner().invoke(main, ["capacity", "--formats", "bf16,int4", "--json", "-"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)  # the table went to stderr
    assert doc["result"] == "capacity" and {r["format"] for r in doc["rows"]} == {"bf16", "int4"}
    assert "| model | gpu | format |" in res.stderr


def test_report_rebuilds_a_capacity_report(tmp_path):
    out = tmp_path / "cap.json"
    res = CliRunner().invoke(
        main, ["capacity", "--json", str(out), "--report", str(tmp_path / "a")]
    )
    assert res.exit_code == 0, res.output
    first = (tmp_path / "a" / "report.md").read_text()
    # default folder: next to the JSON, named after it
    res = CliRunner().invoke(main, ["report", str(out)])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "cap" / "report.md").read_text() == first
    assert "| llama-3.1-8b | h100-80g | fp8 |" in first and "command:" in first


@pytest.mark.slow  # end to end: a full report with its plots
def test_report_of_a_saved_eval_result_has_every_plot(tmp_path):
    # a result written before results carried a "result" field: recognised by its keys
    src = REPO / "results" / "quality" / "baselines.json"
    res = CliRunner().invoke(main, ["report", str(src), "--report", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    md = (tmp_path / "r" / "report.md").read_text()
    data = json.loads(src.read_text())
    for name in data["formats"]:
        assert f"| {name} |" in md
    for png in ("kl.png", "capacity.png", "retrieval.png"):
        assert (tmp_path / "r" / png).read_bytes()[:4] == b"\x89PNG"


def test_report_refuses_what_is_not_a_result(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    res = CliRunner().invoke(main, ["report", str(bad)])
    assert res.exit_code == 2 and "not a kvzip result" in res.output
    bad.write_text("{not json")
    res = CliRunner().invoke(main, ["report", str(bad)])
    assert res.exit_code == 2 and "bad.json" in res.output
    bad.write_text('{"result": "frobnicate"}')
    res = CliRunner().invoke(main, ["report", str(bad)])
    assert res.exit_code == 2 and "unknown result kind 'frobnicate'" in res.output
    res = CliRunner().invoke(main, ["report", str(tmp_path / "missing.json")])
    assert res.exit_code == 2 and "does not exist" in res.output
