"""Step helpers for the tier's unit tests (test code only)."""

from __future__ import annotations


def finish_loads(w) -> set[str]:
    """A worker's asynchronous loads finished and taken in (their failures recorded for the
    step's ``get_block_ids_with_load_errors``): the requests ``get_finished`` reports."""
    if not getattr(w, "async_loads", False) or w.tier is None:
        return set()
    assert w.tier.wait_loads(60), "asynchronous loads still in flight after 60 s"
    return w.get_finished(set())[1] or set()
