"""What the tier's scheduler and worker send each other through vLLM, once per step."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvzip_vllm.core.blocks import as_ids


class Load(NamedTuple):
    """Restore chunk ``pos`` of ``req_id`` (``key``) into its paged-cache blocks
    ``block_ids`` (one per vLLM block of the chunk), all but the first ``skip`` of them (those
    are already in vLLM's own prefix cache: the chunk's first ``skip`` blocks stay as they are)."""

    req_id: str
    key: bytes
    block_ids: tuple[int, ...] | int
    pos: int
    skip: int = 0

    @property
    def ids(self) -> tuple[int, ...]:
        return as_ids(self.block_ids)

    @property
    def written(self) -> tuple[int, ...]:
        """The block ids the load writes (those after ``skip``)."""
        return as_ids(self.block_ids)[self.skip :]


class Store(NamedTuple):
    """Store chunk ``pos`` of ``req_id`` (its paged-cache blocks ``block_ids``) under ``key``."""

    req_id: str
    key: bytes
    block_ids: tuple[int, ...] | int
    pos: int

    @property
    def ids(self) -> tuple[int, ...]:
        return as_ids(self.block_ids)


class Refusal(NamedTuple):
    """Chunk ``pos`` of ``req_id`` (``key``) was not stored: a load it depends on failed."""

    req_id: str
    pos: int
    key: bytes


@dataclass
class KvzipConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, one step."""

    loads: list[Load] = field(default_factory=list)  # before the forward
    stores: list[Store] = field(default_factory=list)  # after it
    #: for each request with stores this step, its paged-cache block ids from block 0 up to
    #: its last store: the worker refuses a store when any earlier block failed to load
    req_blocks: dict[str, list[int]] = field(default_factory=dict)
    clear: bool = False  # empty the tier (reset_cache)
    #: the last worker report the scheduler had taken in when it built this step: failures
    #: reported up to it are known to the scheduler (vLLM recomputes from them), so the
    #: worker stops refusing on their account
    seen_report: int = 0
    #: with tensor parallelism, ``seen_report`` per rank (each rank numbers its own reports)
    seen_by_rank: dict[int, int] = field(default_factory=dict)
    #: keys every rank drops before this step's loads and stores: a rank refused to store
    #: them (computed on a load that failed there), so another rank's copy may be wrong too
    drop: list[bytes] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # requests finished since last step
    #: the step schedules no tokens (requests only wait, e.g. for their loads): the worker's
    #: poll may then wait for the tier's load thread, the GIL released (``idle_wait_s``)
    idle: bool = False


@dataclass
class KvzipWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, one step: keys now held, keys no longer held, stores refused.

    Keys are the scheduler's (rank-free) keys. With tensor parallelism each rank sends its
    own report (``rank``) and vLLM folds them into one with :meth:`aggregate` (0.32-0.33:
    ``KVOutputAggregator`` over every worker's output): the fold keeps each rank's report
    apart (``by_rank``), so the scheduler counts which ranks hold a block."""

    stored: list[bytes] = field(default_factory=list)
    dropped: list[bytes] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)
    #: (req_id, chunk pos) of each load that failed: vLLM recomputes the request from there
    failed_loads: list[tuple[str, int]] = field(default_factory=list)
    #: the worker emptied its store (``clear``) before everything this report lists
    cleared: bool = False
    seq: int = 0  # the worker's report number (echoed back as ``seen_report``)
    rank: int = 0  # the tensor-parallel rank that sent it
    #: the other ranks' reports folded into this one by :meth:`aggregate`
    others: list[KvzipWorkerMetadata] = field(default_factory=list)

    def by_rank(self) -> list[KvzipWorkerMetadata]:
        """The reports folded into this one, one per rank that sent one (this one first)."""
        return [replace(self, others=[]), *self.others]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvzipWorkerMetadata)
        if other.rank == self.rank and not other.others and not self.others:
            # one rank's reports (a connector inside vLLM's MultiConnector): concatenated;
            # a clear in the later one comes after everything the earlier one lists
            before = ([], []) if other.cleared else (self.stored, self.dropped)
            return KvzipWorkerMetadata(
                before[0] + other.stored,
                before[1] + other.dropped,
                self.refused + other.refused,
                self.failed_loads + other.failed_loads,
                self.cleared or other.cleared,
                max(self.seq, other.seq),
                self.rank,
            )
        return replace(self, others=[*self.others, *other.by_rank()])

    def empty(self) -> bool:
        return all(
            not (r.stored or r.dropped or r.refused or r.failed_loads or r.cleared)
            for r in self.by_rank()
        )
