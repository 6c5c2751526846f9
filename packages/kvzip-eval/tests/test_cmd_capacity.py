import json

from click.testing import CliRunner

from kvzip_eval.cli import main


def test_capacity_json_rows(tmp_path):
    out = tmp_path / "cap.json"
    result = CliRunner().invoke(main, ["capacity", "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    rows = {(r["model"], r["gpu"], r["format"]): r for r in data["rows"]}
    assert rows[("llama-3.1-8b", "h100-80g", "bf16")]["sessions"] == 3
    assert rows[("llama-3.1-8b", "h100-80g", "fp8")]["sessions"] == 6
    assert rows[("llama-3.1-70b", "8xh100-80g", "fp8")]["vs_fp8"] == 1.0
    assert set(rows[("llama-3.1-8b", "h200", "int4")]) == {
        "model",
        "gpu",
        "format",
        "bits",
        "sessions",
        "vs_fp8",
    }
    assert data["provenance"]["versions"]["kvzip-formats"]


def test_capacity_unknown_format_is_a_usage_error():
    result = CliRunner().invoke(main, ["capacity", "--formats", "bf16,int3"])
    assert result.exit_code == 2
    assert "unknown format 'int3'" in result.output
