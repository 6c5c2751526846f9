"""Per-call host work of the wrappers: with the Triton launches stubbed, a decode or write call
of a compact format issues no torch compute or copy op (no per-call upload of transforms or
codebook tables from host memory, which waits for the stream on CUDA: ~1 ms per call on the
H200, results/kernels/bench_paged_decode_compact.md at commit 7fa2a4a); a compact write is one
launch."""

import collections
import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvzip_formats import get_format
from kvzip_formats.ops import new_paged_cache
from kvzip_kernels import cache_write, paged_decode
from kvzip_kernels.testing import synthetic_calibration

# allocations and views only
ALLOWED = {"slice", "view", "empty", "empty_like", "detach", "transpose"}


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class _Stub:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` does nothing (the grids
    are recorded in ``launches`` when one is given)."""

    def __init__(self, launches=None):
        self.launches = launches

    def __getitem__(self, grid):
        if self.launches is not None:
            self.launches.append(grid)
        return lambda *a, **k: None


@pytest.fixture
def stubbed(monkeypatch):
    for name in (
        "kvzip_kernels.decode_plan",
        "kvzip_kernels._device_consts",
        "kvzip_kernels._merge_extra",
    ):
        mod = importlib.import_module(name)
        for attr in dir(mod):
            if attr.endswith("_kernel"):
                monkeypatch.setattr(mod, attr, _Stub())


@pytest.mark.parametrize("name", ["4bit", "3bit"])
def test_decode_issues_no_torch_compute(name, stubbed):
    fmt = get_format(name, calibration=synthetic_calibration(2, 128))
    kc = new_paged_cache(fmt, 4, 2, 16, 128, kind="k")
    vc = new_paged_cache(fmt, 4, 2, 16, 128, kind="v")
    q = torch.randn(2, 8, 128).bfloat16()
    bt = torch.arange(4, dtype=torch.int32).view(2, 2)
    sl = torch.tensor([20, 32], dtype=torch.int32)
    paged_decode(fmt, q, kc, vc, bt, sl, block_size=16, max_seq_len=32)  # fills the caches
    with _Count() as c:
        paged_decode(fmt, q, kc, vc, bt, sl, block_size=16, max_seq_len=32)
    assert set(c.ops) <= ALLOWED, dict(c.ops)


def test_compact_write_issues_no_torch_compute(monkeypatch):
    """The compact write is one kernel launch: with it stubbed, a call as vLLM's (no host
    reads) issues no torch op but views (the split write before it issued a ``sub`` and a
    ``bmm``, NOTES.md)."""
    wc = importlib.import_module("kvzip_kernels._write_compact")
    launches = []
    monkeypatch.setattr(wc, "_compact_write_kernel", _Stub(launches))
    fmt = get_format("4bit", calibration=synthetic_calibration(2, 128))
    cache = new_paged_cache(fmt, 4, 2, 16, 128, kind="k")
    x = torch.randn(5, 2, 128).bfloat16()
    slots = torch.arange(5)
    args = dict(kind="k", block_size=16, check_slots=False, check_values=False)  # as vLLM's
    cache_write(fmt, x, cache, slots, **args)  # fills the device-constant caches
    launches.clear()
    with _Count() as c:
        cache_write(fmt, x, cache, slots, **args)
    # the only op: the cache's float16 view for the token scales (``view`` + ``detach`` as the
    # dispatcher sees a dtype view); no copy, no compute
    assert dict(c.ops) == {"view": 1, "detach": 1}, dict(c.ops)
    assert len(launches) == 1
    # checking the values costs a zeroed status word and its read on the host (the sync;
    # ``tolist`` does not pass the dispatcher)
    with _Count() as c:
        cache_write(fmt, x, cache, slots, **{**args, "check_values": True})
    assert dict(c.ops) == {"zeros": 1, "view": 1, "detach": 1}, dict(c.ops)


# views only: what a planned layer call may issue besides its launches
VIEWS = {"slice", "view", "detach", "transpose", "as_strided", "select"}


@pytest.mark.parametrize("name", ["4bit", "int4"])
def test_a_planned_layer_call_only_launches(name, stubbed):
    """``DecodePlan.run`` (a layer of a planned step, ``out`` given): no allocation, no
    compute, no copy; the scratch buffers are the plan's."""
    from kvzip_kernels import plan

    cal = synthetic_calibration(2, 128) if name == "4bit" else None
    fmt = get_format(name, calibration=cal)
    kc = new_paged_cache(fmt, 4, 2, 16, 128, kind="k")
    vc = new_paged_cache(fmt, 4, 2, 16, 128, kind="v")
    q = torch.randn(2, 8, 128).bfloat16()
    bt = torch.arange(4, dtype=torch.int32).view(2, 2)
    sl = torch.tensor([20, 32], dtype=torch.int32)
    p = plan(
        fmt, num_q_heads=8, head_dim=128, block_table=bt, seq_lens=sl, k_cache=kc, v_cache=vc,
        block_size=16, max_seq_len=32,
    )  # fmt: skip
    out = torch.empty_like(q)
    p.run(q, kc, vc, out=out)  # fills the device-constant caches
    with _Count() as c:
        p.run(q, kc, vc, out=out, layer=0)
    assert set(c.ops) <= VIEWS, dict(c.ops)
