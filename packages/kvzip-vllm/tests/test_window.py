"""The residual window in the backend's cache (``kvzip_kernels.window``,
``PagedAttention(recent=)``, spec/residual_window.md), no vLLM needed.

A sequence runs as vLLM runs it (prefill chunks, then decode steps: the write, then attention
over the cache, then the ring write), and every step's attention is checked against a direct
computation from the K/V the steps produced: per query, the format's round trip of each cached
token, except the sink token, the ring's positions ``max(ctx - R, valid_from) .. ctx - 1`` and
the step's own tokens, read as produced (bf16). The reference path must match it to float32
rounding; the kernels (decode) and the prefill workspace within the earned bf16 tolerance. A
second sequence sharing the first one's cached blocks (a prefix-cache hit) finds no slot of
its own and reads the hit's window from the rows until its own tokens fill it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import kvzip_formats  # noqa: E402
from kvzip_kernels.paged import PagedAttention, plan_step, sink_plan, triton_runs  # noqa: E402
from kvzip_kernels.testing import synthetic_calibration  # noqa: E402
from kvzip_kernels.window import WindowPool, plan_window, window_reserve_bytes  # noqa: E402

HQ, HKV, D, BS, R, SLOT_TOKENS = 4, 2, 64, 16, 16, 256


def _paged(**kw) -> PagedAttention:
    fmt = kvzip_formats.get_format("4bit", calibration=synthetic_calibration(HKV, D))
    kw = {"recent": R, "window_slot_tokens": SLOT_TOKENS, **kw}
    return PagedAttention(
        fmt, num_heads=HQ, num_kv_heads=HKV, head_size=D, block_size=BS, scale=D**-0.5, **kw
    )


def _roundtrip(p, x, kind):
    return p.fmt.decode(p.fmt.encode(x, kind=kind, layer=0), kind=kind, layer=0, head_dim=D)


def _expected(p, q, ks, vs, ctx, valid_from):
    """Attention of the step's queries (positions ctx..) over every token so far: round trips
    except the sink, the ring's held positions and the step's own tokens (bf16 as produced)."""
    n = ks.shape[0]
    k, v = _roundtrip(p, ks, "k"), _roundtrip(p, vs, "v")
    lo = max(ctx - R, valid_from, p.sink_tokens)
    exact = torch.zeros(n, dtype=torch.bool)
    exact[: p.sink_tokens] = True
    exact[lo:] = True
    k = torch.where(exact[:, None, None], ks.float(), k.float())
    v = torch.where(exact[:, None, None], vs.float(), v.float())
    rep = HQ // HKV
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    qf = q.float().view(-1, HQ, D)
    s = torch.einsum("qhd,khd->hqk", qf, k) * D**-0.5
    qpos = torch.arange(ctx, ctx + qf.shape[0])
    s.masked_fill_(torch.arange(n)[None, None, :] > qpos[None, :, None], -math.inf)
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


class Run:
    """Sequences stepped through one cache; raw K/V kept per sequence for the expectation."""

    def __init__(self, p: PagedAttention, num_blocks=64, seed=0, device="cpu"):
        self.p, self.g, self.dev = p, torch.Generator().manual_seed(seed), device
        self.cache = p.new_cache(num_blocks, device)
        self.sinks = p.new_pool(self.cache)
        self.windows = p.new_window_pool(self.cache)
        self.free = list(torch.randperm(num_blocks, generator=self.g).tolist())
        self.tables: dict[str, list[int]] = {}
        self.kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def share(self, name, other, blocks):
        """``name`` starts with ``other``'s first ``blocks`` blocks cached (a prefix hit)."""
        self.tables[name] = list(self.tables[other][:blocks])
        k, v = self.kv[other]
        self.kv[name] = (k[: blocks * BS], v[: blocks * BS])

    def step(self, batch: dict[str, int]):
        """One step: ``batch`` maps sequences to their new token counts. Returns per sequence
        (output, expected)."""
        p = self.p
        names = list(batch)
        qsl, lens, ks, vs, qs = [0], [], [], [], []
        for nm in names:
            q_n = batch[nm]
            k0, v0 = self.kv.get(nm, (torch.zeros(0, HKV, D), torch.zeros(0, HKV, D)))
            n = k0.shape[0] + q_n
            table = self.tables.setdefault(nm, [])
            while len(table) * BS < n:
                table.append(self.free.pop())
            k_new = (torch.randn(q_n, HKV, D, generator=self.g) * 2).bfloat16()
            v_new = torch.randn(q_n, HKV, D, generator=self.g).bfloat16()
            self.kv[nm] = (torch.cat([k0.bfloat16(), k_new]), torch.cat([v0.bfloat16(), v_new]))
            ks.append(k_new)
            vs.append(v_new)
            qs.append(torch.randn(q_n, HQ * D, generator=self.g).bfloat16())
            qsl.append(qsl[-1] + q_n)
            lens.append(n)
        width = max(len(self.tables[nm]) for nm in names) + 1
        bt = torch.zeros(len(names), width, dtype=torch.int32)
        for i, nm in enumerate(names):
            bt[i, : len(self.tables[nm])] = torch.tensor(self.tables[nm])
        key, value, query = torch.cat(ks), torch.cat(vs), torch.cat(qs)
        slots = []
        for i, nm in enumerate(names):
            for t in range(lens[i] - batch[nm], lens[i]):
                slots.append(self.tables[nm][t // BS] * BS + t % BS)
        fresh, rows = sink_plan(qsl, lens, p.sink_tokens)
        dev = self.dev
        bt_d, kd, vd = bt.to(dev), key.to(dev), value.to(dev)
        st = plan_step(self.sinks, bt_d[:, 0], fresh, rows)
        win = plan_window(self.windows, R, qsl, lens, bt_d, BS)
        p.write(kd, vd, self.cache, torch.tensor(slots, device=dev), layer=0, sinks=st)
        out_d = torch.empty(query.shape[0], HQ * D, dtype=torch.bfloat16, device=dev)
        p.attend(
            query.to(dev), self.cache, query_start_loc_cpu=torch.tensor(qsl),
            seq_lens_cpu=torch.tensor(lens),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev), block_table=bt_d,
            layer=0, out=out_d, sinks=st, window=win, key=kd, value=vd,
        )  # fmt: skip
        out = out_d.cpu()
        res = {}
        for i, nm in enumerate(names):
            k_all, v_all = self.kv[nm]
            ctx = lens[i] - batch[nm]
            want = _expected(
                p, query[qsl[i] : qsl[i + 1]], k_all, v_all, ctx, win.valid_from_host[i]
            )
            plain = _expected(p, query[qsl[i] : qsl[i + 1]], k_all, v_all, ctx, 1 << 30)
            res[nm] = (out[qsl[i] : qsl[i + 1]].float().view(-1, HQ, D), want, win, plain)
        return res


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _close(res, tol, contrast=True):
    """Within ``tol`` of the expectation, and (``contrast``) 5x that away from reading no
    window at all (a sequence whose window holds a few positions yet is close to both)."""
    got, want, _, plain = res
    assert _rel(got, want) <= tol, f"relative error {_rel(got, want):.2e} > {tol:.2e}"
    if contrast:
        assert _rel(got, plain) > 5 * tol, "no closer to the window than to no window"


def test_reserve_and_slot_geometry():
    p = _paged(kernels=False)
    assert p.window_reserve == window_reserve_bytes(R, D, SLOT_TOKENS) == 16
    assert p.window_blocks_per_slot * BS == SLOT_TOKENS
    cache = p.new_cache(64)
    store = p.window_store(cache)
    assert store.shape[0] == p.num_window_slots(64) == 4
    assert store.shape[1] * store.shape[2] == R * 2 * HKV * D  # one ring per slot
    # the window region is the blocks' last bytes, after the rows and the sink reserve
    store.fill_(1.0)
    rows = HKV * BS * (p.token_head_bytes + p.reserve)
    assert int(cache.view(64, -1)[:, :rows].count_nonzero()) == 0
    with pytest.raises(ValueError, match="whole number of blocks"):
        _paged(kernels=False, window_slot_tokens=SLOT_TOKENS * 3)


@pytest.mark.parametrize("path", ["reference", "workspace"])
def test_prefill_chunks_then_decode_read_the_window_and_the_new_tokens(path):
    p = _paged(kernels=False, prefill=path)
    run = Run(p)
    # the output is bf16 (2^-9 relative rounding); the workspace adds bf16 K/V and sdpa
    tol = 4e-3 if path == "reference" else 1e-2
    for q_n in (40, 20, 1, 1, 1):  # two chunks (the second reads the first's window), decodes
        res = run.step({"a": q_n})["a"]
        _close(res, tol)
    win = res[2]
    assert win.valid_from_host == [0]  # one slot held the whole sequence's window
    # the ring holds the last R positions, as produced
    ring = p.rings(run.cache, win.slots)[0]
    k_all = run.kv["a"][0]
    n = k_all.shape[0]
    pos = torch.arange(n - R, n)
    assert torch.equal(ring[pos % R, 0], k_all[pos])


CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ],
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_decode_kernels_and_the_workspace_read_the_window(device):
    """The kernels' decode (``recent=``, ``recent_from=``) and the prefill workspace, with a
    prefix hit among them; on CUDA the real kernels (``gpu``), on the CPU their twin."""
    if not triton_runs(torch.device(device)):
        pytest.skip(f"Triton does not run on {device}")
    p = _paged(kernels=True, prefill="workspace")
    run = Run(p, seed=3, device=device)
    run.step({"a": 50})
    run.share("b", "a", 2)
    _close(run.step({"a": 1, "b": 5})["a"], 1e-2)
    for _ in range(3):
        res = run.step({"a": 1, "b": 1})
        _close(res["a"], 1e-2)
        _close(res["b"], 1e-2, contrast=False)  # b's window: its own 6-8 tokens so far


def test_a_prefix_hit_reads_the_hits_window_from_the_rows_until_its_own_fills():
    p = _paged(kernels=False)
    run = Run(p, seed=5)
    run.step({"a": 48})
    run.share("b", "a", 2)  # b starts with a's first 32 tokens cached
    res = run.step({"a": 1, "b": 3})
    _close(res["a"], 4e-3)
    _close(res["b"], 4e-3, contrast=False)  # b holds only its 3 new tokens
    win = res["b"][2]
    assert win.valid_from_host == [0, 32]  # a: its slot since its start; b: from its new tokens
    assert run.windows.misses == 1


def test_window_pool_keys_by_the_last_block_and_reuses_the_least_recent():
    pool = WindowPool(2)
    s, v = pool.plan([0, 0], [0, 0], [10, 20])  # two new sequences
    assert s == [0, 1] and v == [0, 0]
    s, v = pool.plan([16, 5], [10, 20], [11, 20])  # a moves to block 11, b stays in 20
    assert s == [0, 1] and v == [0, 0]
    s, v = pool.plan([32, 6], [10, 20], [12, 20])  # a looks under block 10, filed under 11
    assert s == [0, 1] and v == [32, 0] and pool.misses == 1  # a: a fresh start at 32
    pool.plan([7], [20], [20])  # only b runs
    s, v = pool.plan([0], [0], [40])  # a new sequence takes the least recently used slot
    assert s == [0] and v == [0]
    s, v = pool.plan([0, 0, 0], [0, 0, 0], [1, 2, 3])  # three sequences, two slots
    assert s[2] == -1 and v[2] == 0 and pool.unplaced == 1


def test_settings_read_the_window_from_the_format_name(monkeypatch):
    from types import SimpleNamespace

    from kvzip_vllm.settings import backend_settings

    cfg = SimpleNamespace(additional_config=None)
    monkeypatch.setenv("KVZIP_KV_FORMAT", "4bit+r128")
    s = backend_settings(cfg)
    assert (s.kv_format, s.recent, s.window_slot_tokens) == ("4bit", 128, 32768)
    monkeypatch.setenv("KVZIP_WINDOW_SLOT_TOKENS", "4096")
    assert backend_settings(cfg).window_slot_tokens == 4096
    monkeypatch.setenv("KVZIP_WINDOW_SLOT_TOKENS", "1000")
    with pytest.raises(ValueError, match="power of two"):
        backend_settings(cfg)
    monkeypatch.setenv("KVZIP_KV_FORMAT", "4bit+r0")
    with pytest.raises(ValueError, match="N >= 1"):
        backend_settings(cfg)
    with pytest.raises(ValueError, match="compact formats"):
        PagedAttention(
            kvzip_formats.get_format("int4"), num_heads=4, num_kv_heads=2, head_size=64,
            block_size=16, scale=0.125, recent=16,
        )  # fmt: skip


GOLDEN = Path(__file__).parent / "golden" / "window" / "vectors.json"


def golden_state(kernels: bool = False) -> dict:
    """The bytes a fixed run leaves in the cache (spec/residual_window.md section 5): two
    sequences, prefill chunks then decodes, through the reference path. The window's region
    (every block's window reserve) as the sha256 of its bytes, and the rings' slots and first
    positions (the rows are the format's, frozen by its own golden vectors). ``kernels``: the
    rings written by ``kvzip_kernels.ring_write`` (and the decode through the kernels)."""
    import hashlib

    p = _paged(kernels=kernels)
    run = Run(p, num_blocks=64, seed=3)
    for batch in ({"a": 40}, {"a": 20, "b": 7}, {"a": 1, "b": 30}, {"a": 1, "b": 1}):
        res = run.step(batch)
    win = res["a"][2]
    region = p.window_store(run.cache).contiguous().view(torch.int16).numpy().tobytes()
    return {
        "config": dict(
            format="4bit",
            hq=HQ,
            hkv=HKV,
            head_dim=D,
            block_size=BS,
            recent=R,
            slot_tokens=SLOT_TOKENS,
            num_blocks=64,
            seed=3,
        ),  # fmt: skip
        "slots": [int(s) for s in win.slots.tolist()],
        "valid_from": list(win.valid_from_host),
        "window_region_sha256": hashlib.sha256(region).hexdigest(),
    }


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
def test_the_windows_bytes_are_the_frozen_golden_ones(kernels):
    """A change here is a change to the bytes vLLM's cache holds: bump the spec's version and
    regenerate (``tests/golden/window/make_golden.py``). The kernels' ring writes (the CUDA
    path; on the CPU under Triton's interpreter) leave the same bytes as the torch ones."""
    if kernels and not triton_runs(torch.device("cpu")):
        pytest.skip("Triton does not run on the CPU here")
    want = json.loads(GOLDEN.read_text())
    got = golden_state(kernels)
    assert got["config"] == want["config"]
    assert got["slots"] == want["slots"] and got["valid_from"] == want["valid_from"]
    assert got["window_region_sha256"] == want["window_region_sha256"], (
        "the window's ring bytes changed (spec/residual_window.md version "
        f"{want['spec_version']}): a new version of the spec, then make_golden.py"
    )
