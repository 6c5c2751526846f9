"""Regenerate the frozen bytes of the residual window in the backend's cache (run by hand,
never by tests):

    uv run python packages/kvzip-vllm/tests/golden/window/make_golden.py

Writes ``vectors.json`` from ``test_window.golden_state`` (a fixed run of two sequences through
the reference path). A change here is a change to the bytes vLLM's cache holds: bump
``spec/residual_window.md``'s version (``SPEC_VERSION`` below) first.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
SPEC_VERSION = 1

sys.path.insert(0, str(HERE.parents[1]))
from test_window import golden_state  # noqa: E402

if __name__ == "__main__":
    doc = {"spec_version": SPEC_VERSION, **golden_state()}
    (HERE / "vectors.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1))
