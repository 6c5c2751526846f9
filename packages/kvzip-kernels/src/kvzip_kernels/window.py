"""The residual window in vLLM's cache (spec/residual_window.md): the last ``R`` tokens of every
running sequence kept in bf16 beside the format's rows, read by attention instead of them.

Storage, as the sink pool's: every block of every layer reserves ``window_reserve_bytes`` per
token and KV head after its rows and sink reserve, and ``blocks_per_slot`` consecutive blocks'
reserves form one window slot: a ring ``[R, 2 (K, V), num_kv_heads, head_size]`` bf16, position
``p`` at ``p mod R``. vLLM sizes and reports the cache with the reserve in it, so the capacity
it reports is the memory used; one slot per ``slot_tokens`` tokens of cache costs
``R x 16 / slot_tokens`` bits per element (``slot_tokens``: the expected session length).

Which slot is a sequence's (``WindowPool``, host side, one per model): the block holding its
last token is its own (vLLM shares only full cached blocks, and computes at least a prompt's
last token into a block of its own), so each step finds a sequence's slot under the block of
its last token before the step and files it under the block of its last token after it. A
sequence without one (its first step, a prefix-cache hit whose window another request wrote,
or more sequences than slots) gets the least recently used slot, which holds its positions
from the step's first new token on (``valid_from``); earlier positions are read from the rows.

What attention reads, per sequence of ``ctx`` cached and ``q`` new tokens: the rows, with the
ring's positions ``max(ctx - R, valid_from, sink_tokens) .. ctx - 1`` and the step's new tokens
(the forward's own bf16 K/V) in bf16: a decode reads its last ``R + 1`` tokens in bf16, a
prefill chunk its own tokens and the ``R`` before them (a superset of every query's band).
After attention the step's last ``R`` new tokens go into the ring.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: Default tokens of cache per window slot (``KVZIP_WINDOW_SLOT_TOKENS``).
DEFAULT_SLOT_TOKENS = 32768


def window_reserve_bytes(recent: int, head_size: int, slot_tokens: int) -> int:
    """Bytes per token and KV head that every block reserves for window slots."""
    return -(-4 * recent * head_size // slot_tokens) if recent else 0


class WindowPool:
    """Window slots of one model (every layer's cache has the same blocks and slots).

    ``owner[s]``: the block slot ``s`` is filed under (-1: none); ``slot_of_block``: block ->
    slot; ``valid_from[s]``: the first position the slot's ring holds; ``last_used[s]``: the
    step that last planned it. Host state only: the plan reads two block ids per sequence."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.owner = [-1] * num_slots
        self.valid_from = [0] * num_slots
        self.last_used = [0] * num_slots
        self.slot_of_block: dict[int, int] = {}
        self.step = 0
        self.misses = 0  # sequences with cached tokens that found no slot of theirs
        self.unplaced = 0  # sequences left without a slot (more than the pool holds)

    def plan(
        self, ctx: Sequence[int], prev_blocks: Sequence[int], new_blocks: Sequence[int]
    ) -> tuple[list[int], list[int]]:
        """Per sequence of the step (``ctx`` cached tokens; the blocks of its last token before
        and after the step, ``prev_blocks[i]`` ignored where ``ctx[i] == 0``): its slot (-1:
        none) and the first position its ring holds."""
        self.step += 1
        slots, starts = [], []
        for c, prev, new in zip(ctx, prev_blocks, new_blocks, strict=True):
            s = self.slot_of_block.get(prev, -1) if c > 0 else -1
            if s >= 0 and self.owner[s] != prev:
                s = -1
            if s < 0:
                self.misses += c > 0
                s = self._free()
                if s >= 0:
                    self.valid_from[s] = c
            if s < 0:
                self.unplaced += 1
                slots.append(-1)
                starts.append(c)  # nothing in a ring: rows up to the new tokens
                continue
            old = self.owner[s]
            if old >= 0 and self.slot_of_block.get(old) == s:
                del self.slot_of_block[old]
            self.owner[s] = new
            self.slot_of_block[new] = s
            self.last_used[s] = self.step
            slots.append(s)
            starts.append(self.valid_from[s])
        return slots, starts

    def _free(self) -> int:
        """The least recently used slot not yet planned this step (-1 if none)."""
        best, when = -1, self.step
        for s, t in enumerate(self.last_used):
            if t < when:
                best, when = s, t
        return best


@dataclass
class StepWindow:
    """One step's window plan, shared by every layer (device tensors, ``[batch]``): each
    sequence's slot (clamped to 0 where it has none), whether it has one, where its window
    starts being held (``valid_from``), its cached length; and the ring writes after
    attention: the step's token rows, their slot and ring index."""

    recent: int
    slots: torch.Tensor  # [b] int64
    has: torch.Tensor  # [b] bool
    valid_from: torch.Tensor  # [b] int64
    ctx: torch.Tensor  # [b] int64
    ctx_host: list[int]
    valid_from_host: list[int]
    has_host: list[bool]
    w_rows: torch.Tensor  # [m] int64: rows of the step's key/value
    w_slots: torch.Tensor  # [m] int64
    w_ring: torch.Tensor  # [m] int64

    def select(self, idx: torch.Tensor) -> StepWindow:
        """The read side for the sequences ``idx`` (no writes)."""
        ih = idx.tolist()
        none = self.w_rows[:0]
        return StepWindow(
            self.recent,
            self.slots[idx],
            self.has[idx],
            self.valid_from[idx],
            self.ctx[idx],
            [self.ctx_host[i] for i in ih],
            [self.valid_from_host[i] for i in ih],
            [self.has_host[i] for i in ih],
            none,
            none,
            none,
        )


def plan_window(
    pool: WindowPool,
    recent: int,
    qsl: Sequence[int],
    seq_lens: Sequence[int],
    block_table: torch.Tensor,
    block_size: int,
) -> StepWindow:
    """The step's ``StepWindow`` from its query offsets and lengths (host lists) and the block
    table (device; the two block ids per sequence the pool keys by are read to the host)."""
    b = len(seq_lens)
    ctx = [seq_lens[i] - (qsl[i + 1] - qsl[i]) for i in range(b)]
    dev = block_table.device
    pairs = zip(ctx, seq_lens, strict=True)
    cols = torch.tensor(
        [[max(c - 1, 0) // block_size, (n - 1) // block_size] for c, n in pairs],
        dtype=torch.int64,
        device=dev,
    ).view(b, 2)
    ids = torch.gather(block_table.to(torch.int64), 1, cols).tolist()
    slots, starts = pool.plan(ctx, [r[0] for r in ids], [r[1] for r in ids])
    rows, w_slots, ring = [], [], []
    for i, (c, n, s) in enumerate(zip(ctx, seq_lens, slots, strict=True)):
        if s < 0:
            continue
        for p in range(max(c, n - recent), n):  # the step's last `recent` new tokens
            rows.append(qsl[i] + p - c)
            w_slots.append(s)
            ring.append(p % recent)

    def t(x, dtype=torch.int64):
        return torch.tensor(x, dtype=dtype, device=dev)

    return StepWindow(
        recent,
        t([max(s, 0) for s in slots]),
        t([s >= 0 for s in slots], torch.bool),
        t(starts),
        t(ctx),
        ctx,
        starts,
        [s >= 0 for s in slots],
        t(rows),
        t(w_slots),
        t(ring),
    )
