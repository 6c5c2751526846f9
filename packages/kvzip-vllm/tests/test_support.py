"""Start-up refusals and the plugin's inertness, without starting vLLM."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from kvzip_vllm import compat, support


def _model(arch="LlamaForCausalLM", dtype=torch.bfloat16, head=64):
    return SimpleNamespace(architectures=[arch], dtype=dtype, get_head_size=lambda: head)


@pytest.mark.parametrize(
    ("version", "platform"),
    [("0.26.0", "cuda"), ("0.32.0", "cpu"), ("0.32.0+cpu", "cpu"), ("0.33.1", "cuda")],
)
def test_supported_vllm_versions(version, platform):
    assert support.check_vllm_version(version, platform) == version


@pytest.mark.parametrize(
    ("version", "platform"),
    [
        ("0.25.1", "cuda"),
        ("0.31.2", "cpu"),
        ("0.34.0", "cuda"),
        ("1.0.0", "cuda"),
        ("0.26.0", "cpu"),  # 0.26 is supported on CUDA only
        ("0.32.0", "cuda"),  # 0.32 on the CPU only
        ("0.33.0", "rocm"),
    ],
)
def test_other_vllm_versions_refused_listing_the_supported(version, platform):
    listed = r"supported: 0\.26\.x on CUDA .*; 0\.32\.x on CPU .*; 0\.33\.x on CUDA"
    with pytest.raises(
        support.UnsupportedConfigError, match=f"vLLM {version} on {platform}.*" + listed
    ):
        support.check_vllm_version(version, platform)


def test_this_vllm_is_in_the_matrix():
    pytest.importorskip("vllm")
    assert compat.check_vllm().minor == compat.minor(__import__("vllm").__version__)


def test_one_architecture_list_for_calibration_eval_and_the_plugin():
    """kvzip calibrate/eval (kvzip_eval.model) and the plugin check the same architectures:
    the list kvzip_formats.calibration defines (Llama-class decoders only)."""
    from kvzip_formats import calibration

    assert support.SUPPORTED_ARCHITECTURES is calibration.SUPPORTED_ARCHITECTURES
    assert calibration.SUPPORTED_ARCHITECTURES == ("LlamaForCausalLM",)
    model = pytest.importorskip("kvzip_eval.model")
    assert tuple(model.SUPPORTED_ARCHITECTURES) == calibration.SUPPORTED_ARCHITECTURES
    for arch in ("MistralForCausalLM", "Qwen2ForCausalLM"):
        with pytest.raises(support.UnsupportedConfigError, match=f"{arch}.*LlamaForCausalLM"):
            support.check_model(
                _model(arch=arch), dtypes=support.SUPPORTED_BACKEND_DTYPES, what="backend"
            )


def test_model_refusals_name_what_is_supported():
    ok = dict(
        dtypes=support.SUPPORTED_BACKEND_DTYPES,
        what="backend",
        head_sizes=support.SUPPORTED_HEAD_SIZES,
    )
    support.check_model(_model(), **ok)
    with pytest.raises(support.UnsupportedConfigError, match="GPT2.*supported: LlamaForCausalLM"):
        support.check_model(_model(arch="GPT2LMHeadModel"), **ok)
    with pytest.raises(support.UnsupportedConfigError, match="float32.*supported: bfloat16"):
        support.check_model(_model(dtype=torch.float32), **ok)
    with pytest.raises(support.UnsupportedConfigError, match="head size 96.*supported: 64, 128"):
        support.check_model(_model(head=96), **ok)
    with pytest.raises(support.UnsupportedConfigError, match="float16.*supported: bfloat16"):
        support.check_model(
            _model(dtype=torch.float16), dtypes=support.SUPPORTED_CONNECTOR_DTYPES, what="connector"
        )


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_parallel_tp_sizes_accepted(tp):
    support.check_parallel(
        SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1), what="connector"
    )


@pytest.mark.parametrize(("tp", "pp"), [(3, 1), (16, 1), (1, 2), (2, 2)])
def test_parallel_refused(tp, pp):
    with pytest.raises(
        support.UnsupportedConfigError,
        match=f"tensor_parallel_size={tp}, pipeline_parallel_size={pp} is not supported; "
        "supported: tensor_parallel_size 1, 2, 4, 8 with pipeline_parallel_size 1",
    ):
        support.check_parallel(
            SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp), what="connector"
        )


@pytest.mark.parametrize(
    ("total", "world", "ranges"),
    [
        (8, 2, [(0, 4), (4, 8)]),
        (8, 8, [(i, i + 1) for i in range(8)]),
        (4, 1, [(0, 4)]),
        (2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]),  # fewer KV heads than ranks: replicated
        (1, 8, [(0, 1)] * 8),
    ],
)
def test_kv_head_range_matches_vllm_partition(total, world, ranges):
    assert [support.kv_head_range(total, r, world) for r in range(world)] == ranges


def test_kv_head_range_refuses_indivisible():
    with pytest.raises(support.UnsupportedConfigError, match="3 KV heads cannot be split"):
        support.kv_head_range(3, 0, 2)
    with pytest.raises(support.UnsupportedConfigError, match="rank 2 of world size 2"):
        support.kv_head_range(4, 2, 2)


def test_plugin_is_inert_without_env(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.v1.attention.backends import registry

    monkeypatch.delenv("KVZIP_KV_FORMAT", raising=False)
    before = dict(registry._ATTN_OVERRIDES)
    importlib.import_module("kvzip_vllm.plugin").register()
    assert registry._ATTN_OVERRIDES == before


def test_plugin_registers_backend_when_enabled(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends import registry

    monkeypatch.setenv("KVZIP_KV_FORMAT", "int4")
    monkeypatch.setattr(registry, "_ATTN_OVERRIDES", dict(registry._ATTN_OVERRIDES))
    importlib.import_module("kvzip_vllm.plugin").register()
    enum = registry.AttentionBackendEnum
    slot = enum.CPU_ATTN if current_platform.is_cpu() else enum.CUSTOM
    assert slot.get_path() == "kvzip_vllm.backend.KvzipAttentionBackend"


def test_backend_spec_uses_format_bytes(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    import kvzip_formats
    from kvzip_vllm.backend import KvzipAttentionBackend

    monkeypatch.setenv("KVZIP_KV_FORMAT", "int4")
    spec = FullAttentionSpec(block_size=32, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)
    custom = compat.layer_spec(KvzipAttentionBackend, spec)
    tbh = kvzip_formats.get_format("int4").token_head_bytes(64)  # 32 codes + 4 scale/zero
    assert custom.page_size_bytes == 32 * 3 * 2 * tbh == 6912
    assert spec.page_size_bytes / custom.page_size_bytes == 256 / 72


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"dtype": torch.float16}, "dtype torch.float16 is not supported; supported: bfloat16"),
        ({"arch": "GPT2LMHeadModel"}, "supported: LlamaForCausalLM"),
        ({"cache_dtype": "fp8"}, "kv_cache_dtype='fp8' is not supported"),
        ({"tp": 3}, "tensor_parallel_size=3"),
    ],
)
def test_connector_refuses_unsupported_setups_at_start(change, match):
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvzip_vllm.connector import KvzipConnector

    cfg = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(get_from_extra_config=lambda k, d: d),
        model_config=_model(
            arch=change.get("arch", "LlamaForCausalLM"), dtype=change.get("dtype", torch.bfloat16)
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=change.get("tp", 1), pipeline_parallel_size=1
        ),
        cache_config=SimpleNamespace(cache_dtype=change.get("cache_dtype", "auto"), block_size=16),
    )
    with pytest.raises(support.UnsupportedConfigError, match=match):
        KvzipConnector(cfg, KVConnectorRole.WORKER, None)


def test_spec_shim_gives_kvzip_layers_the_compact_page(monkeypatch):
    """vLLM 0.26's path (no customize_spec): the plugin's shim makes the attention layer's
    get_kv_cache_spec return a spec whose page is the backend's (sinks included), and the
    backend's get_kv_cache_shape the matching uint8 shape; other layers keep their spec.
    Run here on 0.32's classes with the 0.26 API selected (the H200 test runs it on 0.26)."""
    pytest.importorskip("vllm")
    import vllm.model_executor.layers.attention.attention as attention_mod
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    import kvzip_formats
    from kvzip_kernels.paged import PagedAttention
    from kvzip_vllm import backend

    fmt = kvzip_formats.get_format("int4")
    monkeypatch.setattr(backend, "_active_format", lambda: fmt)
    monkeypatch.setattr(backend, "_active_window", lambda: (0, 32768))
    monkeypatch.setattr(compat, "has_spec_api", lambda: False)

    class Layer:  # the attributes 0.26's Attention.get_kv_cache_spec reads, and its result
        layer_name = "model.layers.0.self_attn.attn"

        def __init__(self, attn_backend):
            self.attn_backend = attn_backend

        def get_kv_cache_spec(self, vllm_config):
            return FullAttentionSpec(
                block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
            )

    monkeypatch.setattr(attention_mod, "Attention", Layer)
    assert compat.install_spec_shim() and compat.install_spec_shim()  # idempotent
    spec = Layer(backend.KvzipAttentionBackend).get_kv_cache_spec(None)
    p = PagedAttention(fmt, num_heads=32, num_kv_heads=8, head_size=128, block_size=16, scale=1)
    assert spec.dtype == torch.uint8
    assert spec.page_size_bytes == p.block_bytes == 16 * 8 * 136
    assert type(spec).merge([spec, spec]).page_size_bytes == p.block_bytes
    base = Layer(object).get_kv_cache_spec(None)
    assert compat.layer_spec(backend.KvzipAttentionBackend, base).page_size_bytes == p.block_bytes
    other = Layer(object).get_kv_cache_spec(None)  # another backend's layer: untouched
    assert type(other) is FullAttentionSpec and other.page_size_bytes == 16 * 8 * 2 * 128 * 2

    class Shaped:
        kvzip_content_bytes = staticmethod(backend.KvzipAttentionBackend.kvzip_content_bytes)

    compat.kv_cache_api(Shaped)
    assert Shaped.get_kv_cache_shape(10, 16, 8, 128, "auto") == (10, 8, 16, 136)
    assert not hasattr(Shaped, "customize_spec")


def _backend_impl(change, monkeypatch):
    import vllm.config

    from kvzip_vllm.backend import KvzipAttentionImpl

    monkeypatch.setenv("KVZIP_KV_FORMAT", "int4")
    cfg = SimpleNamespace(
        model_config=_model(arch=change.get("arch", "LlamaForCausalLM")),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(block_size=16),
        compilation_config=SimpleNamespace(
            use_inductor_graph_partition=change.get("graph_partition", False)
        ),
        kv_transfer_config=change.get("kv_transfer_config"),
        additional_config={},
    )
    monkeypatch.setattr(vllm.config, "get_current_vllm_config", lambda: cfg)
    return KvzipAttentionImpl(8, 64, 0.125, 2, None, None, "auto")


def test_backend_accepts_a_supported_setup(monkeypatch):
    pytest.importorskip("vllm")
    impl = _backend_impl({}, monkeypatch)
    assert impl.fmt.name == "int4" and impl.block_size == 16


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"kv_transfer_config": SimpleNamespace()}, "a KV connector is not supported"),
        ({"graph_partition": True}, "use_inductor_graph_partition=True is not supported"),
        ({"arch": "Qwen2ForCausalLM"}, "Qwen2ForCausalLM.*supported: LlamaForCausalLM"),
    ],
)
def test_backend_refuses_unsupported_setups_at_start(change, match, monkeypatch):
    pytest.importorskip("vllm")
    with pytest.raises(support.UnsupportedConfigError, match=match):
        _backend_impl(change, monkeypatch)


def test_backend_refuses_every_connector_and_the_bench_fill_is_let_through_only_in_its_run(
    monkeypatch,
):
    """The shipped backend has no switch for connectors (the old placeholder flag is refused
    too); ``kvzip bench serving``'s fill connector is let through only where the benchmark's
    engine process calls ``allow_fill_connector``, and any other is still refused."""
    pytest.importorskip("vllm")
    from kvzip_eval.bench import fill
    from kvzip_vllm import backend

    for kt in (
        SimpleNamespace(kv_connector="KvzipBenchFill", kv_connector_extra_config={}),
        SimpleNamespace(kv_connector="X", kv_connector_extra_config={"kvzip_placeholder_kv": True}),
    ):
        with pytest.raises(support.UnsupportedConfigError, match="a KV connector"):
            _backend_impl({"kv_transfer_config": kt}, monkeypatch)
    # undone after the test: monkeypatch records the attributes the benchmark replaces
    monkeypatch.setattr(backend, "_connector_refused", backend._connector_refused)
    monkeypatch.setattr(backend, "_shipped_connector_refused", None, raising=False)
    monkeypatch.delattr(backend, "_shipped_connector_refused")
    monkeypatch.setenv("KVZIP_KV_FORMAT", "int4")
    fill.allow_fill_connector(backend)
    fill.allow_fill_connector(backend)  # idempotent
    ok = SimpleNamespace(kv_connector=fill.CONNECTOR, kv_connector_extra_config={})
    assert _backend_impl({"kv_transfer_config": ok}, monkeypatch).fmt.name == "int4"
    assert _backend_impl({}, monkeypatch).fmt.name == "int4"
    for name in ("LMCacheConnectorV1", "kvzipbenchfill"):
        kt = SimpleNamespace(kv_connector=name, kv_connector_extra_config={})
        with pytest.raises(support.UnsupportedConfigError, match="a KV connector"):
            _backend_impl({"kv_transfer_config": kt}, monkeypatch)
