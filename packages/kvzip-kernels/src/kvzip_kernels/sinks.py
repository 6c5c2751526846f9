"""The sink pool (spec/4bit.md section 8): the first ``sink_tokens`` positions of every sequence
also kept in bf16, in slots made of every block's reserve (``_paged_cache.py``'s module
docstring has the layout); which slot is a sequence's, and one step's sink plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: One sink slot per this many tokens of cache: the reserve per token and KV head is
#: ``4 * sink_tokens * head_size / SINK_SLOT_TOKENS`` bytes (bf16 K and V), rounded up.
SINK_SLOT_TOKENS = 256


def sink_reserve_bytes(sink_tokens: int, head_size: int) -> int:
    """Bytes per token and KV head that every block reserves for the sink pool."""
    return -(-4 * sink_tokens * head_size // SINK_SLOT_TOKENS) if sink_tokens else 0


class SinkPool:
    """Which sink slot holds the sinks of each first block: one pool per model (every layer's
    cache has the same blocks and slots), on the cache's device.

    ``slot_of_block[b]``: the slot last given to block ``b`` (-1: none); ``owner[j]``: the
    block slot ``j`` was last given to (a block's slot is valid while it still owns it);
    ``last_used[j]``: the step that last read or wrote it. Nothing here reads the device.
    """

    def __init__(self, num_blocks: int, num_slots: int, device) -> None:
        if num_slots < 1:
            raise ValueError(
                f"a cache of {num_blocks} blocks has no sink slot (one per {SINK_SLOT_TOKENS} "
                "tokens); give vLLM more KV cache memory"
            )
        self.num_blocks, self.num_slots = num_blocks, num_slots
        self.slot_of_block = torch.full((num_blocks,), -1, dtype=torch.int64, device=device)
        self.owner = torch.full((num_slots,), -1, dtype=torch.int64, device=device)
        self.last_used = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.step = 0
        self.assigned = 0  # slots given out so far

    @property
    def index_bytes(self) -> int:
        """Device bytes the pool's index vectors take (the only memory beside vLLM's cache)."""
        return sum(
            t.numel() * t.element_size() for t in (self.slot_of_block, self.owner, self.last_used)
        )

    @property
    def may_miss(self) -> bool:
        """Whether a first block may have lost its slot (more slots given than exist)."""
        return self.assigned > self.num_slots

    def begin_step(self, first_blocks: torch.Tensor, fresh: Sequence[int]):
        """Mark the slots of this step's sequences (first blocks ``[batch]``) as used and give
        the ``fresh`` ones (indices into the batch: sequences whose first chunk this is) the
        least recently used slots. Returns ``(slots, valid)`` ``[batch]`` on the device."""
        self.step += 1
        first = first_blocks.to(torch.int64)
        slot = self.slot_of_block[first]
        safe = slot.clamp_min(0)
        valid = (slot >= 0) & (self.owner[safe] == first)
        self.last_used.scatter_reduce_(0, safe, torch.where(valid, self.step, 0), "amax")
        if fresh:
            if len(fresh) > self.num_slots:
                raise ValueError(
                    f"{len(fresh)} new sequences in one step but the cache has {self.num_slots} "
                    f"sink slots (one per {SINK_SLOT_TOKENS} tokens); lower max_num_seqs or "
                    "give vLLM more KV cache memory"
                )
            idx = torch.tensor(list(fresh), dtype=torch.int64, device=first.device)
            blocks = first[idx]
            victims = torch.topk(self.last_used, len(fresh), largest=False).indices
            self.slot_of_block[blocks] = victims
            self.owner[victims] = blocks
            self.last_used[victims] = self.step
            slot = slot.clone()
            slot[idx] = victims
            valid = valid.clone()
            valid[idx] = True
            self.assigned += len(fresh)
        return slot.clamp_min(0), valid


@dataclass
class StepSinks:
    """One step's sink plan, shared by every layer: per sequence its slot, whether the slot
    still holds its sinks, its first block; and the new tokens at sink positions: their row in
    the step's key/value, the position, and (``write_req``) the sequences they belong to."""

    slots: torch.Tensor  # [batch] int64
    valid: torch.Tensor  # [batch] bool
    first: torch.Tensor  # [batch] int64
    may_miss: bool
    rows: torch.Tensor  # [m] int64: row in key/value
    row_req: torch.Tensor  # [m] int64: index into write_req
    pos: torch.Tensor  # [m] int64: position < sink_tokens
    write_req: torch.Tensor  # [u] int64: sequences (batch index) that write sinks

    def select(self, idx: torch.Tensor) -> StepSinks:
        """The read side for the sequences ``idx`` (no writes)."""
        none = self.rows[:0]
        return StepSinks(
            self.slots[idx],
            self.valid[idx],
            self.first[idx],
            self.may_miss,
            none,
            none,
            none,
            none,
        )


def sink_plan(qsl: Sequence[int], seq_lens: Sequence[int], sink_tokens: int):
    """From a step's query start offsets ``[batch + 1]`` and sequence lengths (host lists):
    the sequences whose first chunk this is, and every new token at a position
    ``< sink_tokens`` as ``(row, sequence, position)``."""
    fresh, rows = [], []
    for i, n in enumerate(seq_lens):
        q = qsl[i + 1] - qsl[i]
        ctx = n - q
        if q and ctx == 0:
            fresh.append(i)
        for p in range(ctx, min(sink_tokens, n)):
            rows.append((qsl[i] + p - ctx, i, p))
    return fresh, rows


def plan_step(pool: SinkPool, first_blocks, fresh, rows) -> StepSinks:
    """The step's ``StepSinks``: slots from ``pool`` (``fresh`` get new ones) and the sink
    writes ``rows`` (``(row, sequence, position)``, from ``sink_plan``)."""
    slots, valid = pool.begin_step(first_blocks, fresh)
    dev = slots.device
    seqs = sorted({r[1] for r in rows})
    local = {q: j for j, q in enumerate(seqs)}

    def t(x):
        return torch.tensor(x, dtype=torch.int64, device=dev)

    return StepSinks(
        slots,
        valid,
        first_blocks.to(torch.int64),
        pool.may_miss,
        t([r[0] for r in rows]),
        t([local[r[1]] for r in rows]),
        t([r[2] for r in rows]),
        t(seqs),
    )
