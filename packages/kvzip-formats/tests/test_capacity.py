from kvzip_formats.capacity import DEPLOYMENTS, capacity_rows, session_bytes, sessions


def _row(rows, model, gpu, fmt):
    (r,) = [r for r in rows if (r["model"], r["gpu"], r["format"]) == (model, gpu, fmt)]
    return r


def test_reference_figures_of_the_capacity_method():
    rows = capacity_rows(["bf16", "fp8", "int4"])
    assert _row(rows, "llama-3.1-8b", "h100-80g", "bf16")["sessions"] == 3
    assert _row(rows, "llama-3.1-8b", "h100-80g", "fp8")["sessions"] == 6
    assert _row(rows, "llama-3.1-8b", "h100-80g", "fp8")["vs_fp8"] == 1.0
    assert {r["gpu"] for r in rows} == {"h100-80g", "8xh100-80g", "h200"}


def test_session_bytes_of_8b_bf16_is_17_18_gb():
    h100 = DEPLOYMENTS[0]
    assert round(session_bytes(16, h100.model) / 1e9, 2) == 17.18


def test_bit_budgets_of_the_compact_formats_give_the_session_goals():
    h100 = DEPLOYMENTS[0]
    assert sessions(4.198, h100) == 13
    assert sessions(3.2, h100) == 17
    # The 3.64-bit budget (docs/protocol.md, "Targets") gives 14 sessions; 15 need <= 3.638.
    assert sessions(3.64, h100) == 14
    assert sessions(3.638, h100) == 15
