"""The shared tier inside the connector, without starting vLLM: two workers (two instances) on
one real ``redis-server``, the scheduler counting blocks the shared store holds, the server
killed or holding damaged values (a load error: vLLM recomputes), the settings' rules."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import redis
import torch
from redis_server import INSTALL_HINT, RedisServer, redis_server_binary
from tier_steps import finish_loads  # noqa: E402

from kvzip_vllm import support
from kvzip_vllm.settings import ConnectorSettingsError, connector_settings

# every test under both load designs (conftest.load_mode)
pytestmark = pytest.mark.usefixtures("load_mode")

vllm = pytest.importorskip("vllm", reason="the connector needs vLLM")

BS, HEADS, HEAD, LAYERS, NBLOCKS = 16, 2, 8, 2, 12
SLACK_S = 1.0  # two cores shared by several jobs


@pytest.fixture
def server():
    if redis_server_binary() is None:
        pytest.fail(INSTALL_HINT)
    srv = RedisServer().start()
    yield srv
    srv.close()


def _cfg():
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}),
        model_config=SimpleNamespace(
            architectures=["LlamaForCausalLM"],
            dtype=torch.bfloat16,
            get_head_size=lambda: HEAD,
            model="m",
            revision=None,
            hf_config=None,
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=BS),
    )


def _settings(url, **kw):
    extra = {
        "fit_tokens": 0,
        "chunk_tokens": BS,
        "shared_url": url,
        "shared_budget_bytes": 32 << 20,
    }
    extra.update(kw)
    from kvzip_vllm import settings

    return settings.connector_settings(extra, environ={})


def _worker(url, **kw):
    from kvzip_vllm.tier.worker import KvzipWorker

    return KvzipWorker(_cfg(), _settings(url, **kw))


def _caches(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(
            NBLOCKS, HEADS, BS, 2 * HEAD, generator=g
        ).to(torch.bfloat16)
        for i in range(LAYERS)
    }


def _step(w, *, loads=(), stores=(), req_blocks=None, seen=0):
    from kvzip_vllm.tier.metadata import KvzipConnectorMetadata

    meta = KvzipConnectorMetadata(
        loads=list(loads), stores=list(stores), req_blocks=req_blocks or {}, seen_report=seen
    )
    w.start_load_kv(meta)
    finish_loads(w)  # (asynchronous: vLLM schedules the request once get_finished says so)
    w.wait_for_save(meta)
    assert w._background.drain(60)  # stores coded in the background: reported this step
    return w.get_block_ids_with_load_errors(), w.build_connector_worker_meta()


KEYS = [bytes([i + 1]) * 32 for i in range(8)]


def _filled(server):
    """Instance A: blocks 0-3 of its cache stored under KEYS[0:4], in the shared store too."""
    from kvzip_vllm.tier.metadata import Store

    a = _worker(server.url)
    ca = _caches(0)
    a.register_kv_caches(ca)
    _, rep = _step(a, stores=[Store("a", KEYS[i], i, i) for i in range(4)])
    assert rep.stored == KEYS[:4]
    assert a.flush_shared(10.0)
    return a, ca


# ---------------------------------------------------------------------------- worker
def test_a_block_stored_by_one_instance_is_restored_bit_exact_by_another(server):
    from kvzip_vllm.tier.metadata import Load

    a, ca = _filled(server)
    sa = a.stats()
    assert sa["shared_stored"] == 4 and sa["shared_puts"] == 4 and sa["shared_put_dropped"] == 0
    assert sa["shared_bytes_written"] > 0
    b = _worker(server.url)  # another instance: its local store is empty
    cb = _caches(1)
    b.register_kv_caches(cb)
    loads = [Load("r", KEYS[i], 6 + i, i) for i in range(4)]
    errors, rep = _step(b, loads=loads)
    assert errors == set() and rep.stored == KEYS[:4]  # now held locally: reported
    for name in ca:
        for i in range(4):
            assert torch.equal(cb[name][6 + i], ca[name][i]), (name, i)
    s = b.stats()
    assert s["shared_hits"] == 4 and s["shared_blocks_fetched"] == 4 and s["load_errors"] == 0
    assert s["blocks_restored"] == 4 and all(k in b.store for k in KEYS[:4])
    # a second load is a local hit: no more calls to the server
    _step(b, loads=[Load("r2", KEYS[0], 10, 0)])
    assert b.stats()["shared_gets"] == 4
    for w in (a, b):
        w.shutdown()


def test_a_server_killed_mid_run_is_a_load_error_within_the_timeout(server):
    from kvzip_vllm.tier.metadata import Load, Store

    a, _ = _filled(server)
    b = _worker(server.url, shared_timeout_s=0.3)
    b.register_kv_caches(_caches(1))
    server.kill()
    t0 = time.perf_counter()
    errors, rep = _step(b, loads=[Load("r", KEYS[i], 6 + i, i) for i in range(4)])
    took = time.perf_counter() - t0
    assert errors == {6, 7, 8, 9} and rep.failed_loads == [("r", i) for i in range(4)]
    assert took < 0.3 + SLACK_S, took
    s = b.stats()
    assert s["load_errors"] == 4 and s["shared_hits"] == 0 and s["shared_errors"] >= 1
    assert s["shared_misses"] == 4 and not s["shared_up"]
    # storing goes on locally; the shared puts fail fast (counted), the step never waits
    t0 = time.perf_counter()
    _, rep = _step(b, stores=[Store("b", KEYS[5], 0, 0)])
    assert rep.stored == [KEYS[5]] and time.perf_counter() - t0 < 0.3 + SLACK_S
    assert b.flush_shared(5.0) and b.stats()["shared_stored"] == 0
    for w in (a, b):
        w.shutdown()


def test_a_damaged_shared_value_is_a_load_error_and_deleted(server):
    from kvzip_vllm.tier.metadata import Load

    a, _ = _filled(server)
    raw = redis.Redis.from_url(server.url, protocol=2)
    rkey = a.shared.redis_key(KEYS[1])
    value = bytearray(raw.get(rkey))
    value[len(value) // 2] ^= 0xFF
    raw.set(rkey, bytes(value))
    b = _worker(server.url)
    cb = _caches(1)
    before = {n: c.clone() for n, c in cb.items()}
    b.register_kv_caches(cb)
    errors, rep = _step(b, loads=[Load("r", KEYS[i], 6 + i, i) for i in range(3)])
    assert errors == {7} and rep.failed_loads == [("r", 1)]
    s = b.stats()
    assert s["shared_corrupt"] == 1 and s["shared_hits"] == 2 and s["load_errors"] == 1
    assert raw.exists(rkey) == 0  # deleted: the next store of the block writes it anew
    for n in cb:  # the damaged block never reached the cache
        assert torch.equal(cb[n][7], before[n][7])
    raw.close()
    for w in (a, b):
        w.shutdown()


def test_blobs_coded_with_another_table_set_are_never_read(server, tmp_path):
    """Namespaces name the table set: an instance with other tables sees none of the blocks."""
    import kvzip_lossless
    from kvzip_vllm.tier.shared import shared_namespace

    g = torch.Generator().manual_seed(3)
    blocks = [[(torch.randn(64, 2, 8, generator=g).to(torch.bfloat16),) * 2] for _ in range(2)]
    paths = []
    for i, blk in enumerate(blocks):
        p = tmp_path / f"t{i}.kvzt"
        kvzip_lossless.build_kv_tables([blk]).save(str(p))
        paths.append(str(p))
    ns = [shared_namespace(_settings(server.url, tables_path=p, fit_tokens=1024)) for p in paths]
    assert ns[0] != ns[1] and ns[0].startswith("kvzip-tables-")
    assert shared_namespace(_settings(server.url)) == "kvzip-embedded"
    assert ns[0] == shared_namespace(_settings(server.url, tables_path=paths[0]))


# ---------------------------------------------------------------------------- scheduler
def _sched(url):
    from kvzip_vllm.tier.scheduler import KvzipScheduler
    from kvzip_vllm.tier.shared import open_shared

    shared = open_shared(_settings(url, shared_timeout_s=0.3)) if url else None
    return KvzipScheduler(_cfg(), None, b"ns", shared=shared)


def test_the_scheduler_counts_blocks_the_shared_store_holds(server):
    from kvzip_vllm.core.store import block_key
    from kvzip_vllm.tier.metadata import KvzipWorkerMetadata

    sched = _sched(server.url)
    req = SimpleNamespace(
        request_id="r", block_hashes=[bytes([i]) * 8 for i in range(6)], num_tokens=6 * BS + 1
    )
    keys = [block_key(b"ns", h) for h in req.block_hashes]
    for k in keys[1:4]:  # another instance stored blocks 1-3 in the shared store
        assert sched.shared.put(k, [b"x" * 10], raw_bytes=10)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # block 0 nowhere
    # block 0 held locally: 0 local + 1-3 shared; block 4 nowhere
    report = KvzipWorkerMetadata(stored=[keys[0]], seq=1)
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=report))
    assert sched.get_num_new_matched_tokens(req, 0) == (4 * BS, True)
    # vLLM's own prefix cache covers blocks 0-1: the rest from the shared store
    assert sched.get_num_new_matched_tokens(req, 2 * BS) == (2 * BS, True)
    # the server gone: only the local block counts, within the timeout
    server.kill()
    t0 = time.perf_counter()
    assert sched.get_num_new_matched_tokens(req, 0) == (BS, True)
    assert time.perf_counter() - t0 < 0.3 + SLACK_S
    assert sched.shared.stats["shared_errors"] >= 1
    sched.shared.close()


def test_with_tensor_parallelism_a_block_counts_once_every_rank_shard_is_shared(server):
    from kvzip_vllm.core.store import block_key, shard_key

    sched = _sched(server.url)
    sched.world = 2  # the scheduler of a TP = 2 engine
    req = SimpleNamespace(
        request_id="r", block_hashes=[bytes([i]) * 8 for i in range(3)], num_tokens=3 * BS + 1
    )
    keys = [block_key(b"ns", h) for h in req.block_hashes]
    for k in keys:  # rank 0 stored its shard of every block, rank 1 of blocks 0 and 1 only
        assert sched.shared.put(shard_key(k, 0, 2), [b"x"], raw_bytes=1)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    for k in keys[:2]:
        assert sched.shared.put(shard_key(k, 1, 2), [b"x"], raw_bytes=1)
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * BS, True)
    sched.shared.close()


# ---------------------------------------------------------------------------- settings
def test_shared_settings_and_their_rules():
    s = connector_settings(
        {"shared_url": "redis://127.0.0.1:1/0", "shared_budget_bytes": 5, "fit_tokens": 0},
        environ={},
    )
    assert (s.shared_url, s.shared_budget_bytes, s.shared_timeout_s) == (
        "redis://127.0.0.1:1/0",
        5,
        None,
    )
    env = {"KVZIP_SHARED_URL": "redis://h:2/0", "KVZIP_SHARED_BYTES": "7", "KVZIP_TIER_TABLES": "t"}
    s = connector_settings({}, environ=env)
    assert (s.shared_url, s.shared_budget_bytes, s.tables_path) == ("redis://h:2/0", 7, "t")
    assert connector_settings({}, environ={}).shared_url is None  # off by default
    bad = [
        ({"shared_url": "redis://h/0", "fit_tokens": 0}, "needs shared_budget_bytes"),
        ({"shared_url": "redis://h/0", "shared_budget_bytes": 9}, "needs tables_path .* or "),
        ({"shared_budget_bytes": 9}, "shared_budget_bytes given without shared_url"),
        ({"shared_timeout_s": 0}, "shared_timeout_s=0 .*greater than 0"),
    ]
    for extra, match in bad:
        with pytest.raises(ConnectorSettingsError, match=match):
            connector_settings(extra, environ={})


def test_a_bad_shared_url_is_refused_at_start():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvzip_vllm.connector import KvzipConnector

    cfg = _cfg()
    cfg.kv_transfer_config.kv_connector_extra_config = {
        "shared_url": "http://127.0.0.1:1/",
        "shared_budget_bytes": 1 << 20,
        "fit_tokens": 0,
    }
    cfg.kv_transfer_config.kv_load_failure_policy = "recompute"
    with pytest.raises(support.UnsupportedConfigError, match="scheme 'http' is not supported"):
        KvzipConnector(cfg, KVConnectorRole.SCHEDULER, None)
