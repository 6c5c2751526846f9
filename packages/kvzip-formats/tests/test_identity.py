"""Model identity by content (kvzip_formats.identity)."""

from __future__ import annotations

from kvzip_formats import identity


def _folder(root, name: str, weights: bytes):
    d = root / name
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(weights)
    (d / "notes.txt").write_text("not a weight file")
    return d


def test_same_names_and_sizes_different_bytes_differ(tmp_path, monkeypatch):
    monkeypatch.setenv("KVZIP_CACHE_DIR", str(tmp_path / "cache"))
    a = _folder(tmp_path, "a", b"\x00" * 4096)
    b = _folder(tmp_path, "b", b"\x00" * 4095 + b"\x01")  # one byte apart, same size
    c = _folder(tmp_path, "c", b"\x00" * 4096)  # a's bytes elsewhere
    ids = [identity.file_identity(identity.weight_files(d), "cfg") for d in (a, b, c)]
    assert ids[0] != ids[1] and ids[0] == ids[2]
    assert [p.name for p in identity.weight_files(a)] == ["model.safetensors"]
    # the extra part (the config) is in the identity too
    assert identity.file_identity(identity.weight_files(a), "other") != ids[0]


def test_not_a_folder_has_no_weight_files(tmp_path):
    assert identity.weight_files(tmp_path / "missing") == []
    assert identity.weight_files("meta-llama/Llama-3.1-8B") == []
