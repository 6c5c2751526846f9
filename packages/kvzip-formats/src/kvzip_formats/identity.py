"""Model identity by content: what keys a calibration (``kvzip calibrate``) and the lossless
tier's stored blocks (kvzip-vllm), so that two models that differ in any weight byte, such as
two fine-tunes of one base, never share either.

A file's SHA-256 is streamed once and cached by (path, size, mtime_ns) in
``<cache_dir()>/file_sha256.json``, so a model's weights are read once, not at every start; a
file rewritten in place (new size or mtime) is hashed again.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from kvzip_formats.settings import CACHE_DIR

#: Bump when what goes into a model identity changes (v2: file contents, not sizes).
IDENTITY_VERSION = 2
#: Weight files of a Hugging Face model folder.
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def cache_dir() -> Path:
    """kvzip's cache root: ``$KVZIP_CACHE_DIR`` or ``~/.cache/kvzip``."""
    return CACHE_DIR.get() or Path.home() / ".cache" / "kvzip"


def _hash_cache_path() -> Path:
    return cache_dir() / "file_sha256.json"


def _read_hash_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()  # streams the file


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file's bytes, streamed; cached by (path, size, mtime_ns)."""
    p = Path(path).resolve()
    st = p.stat()
    key = str(p)
    cache_file = _hash_cache_path()
    entry = _read_hash_cache(cache_file).get(key)
    if (
        isinstance(entry, dict)
        and entry.get("size") == st.st_size
        and entry.get("mtime_ns") == st.st_mtime_ns
        and isinstance(entry.get("sha256"), str)
    ):
        return entry["sha256"]
    digest = _sha256_of(p)
    # Re-read before writing: another process may have added entries meanwhile.
    cache = _read_hash_cache(cache_file)
    cache[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".file_sha256.", dir=cache_file.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(cache, f, indent=1, sort_keys=True)
        os.replace(tmp, cache_file)
    except OSError:
        pass  # a read-only cache only costs a re-hash next time
    return digest


def file_identity(paths: Iterable[Path], extra: str = "") -> str:
    """Hash of ``extra`` and the files' names and contents (``file_sha256``): two models of
    one architecture whose weights differ in any byte get different identities."""
    h = hashlib.sha256(f"kvzip-model-identity-v{IDENTITY_VERSION};{extra}".encode())
    for p in sorted(paths, key=lambda q: q.name):
        h.update(f"{p.name}:{file_sha256(p)};".encode())
    return h.hexdigest()[:16]


def weight_files(folder: str | Path) -> list[Path]:
    """The weight files of a model folder (none for a folder that is not a local path)."""
    d = Path(folder)
    if not d.is_dir():
        return []
    return sorted(f for f in d.iterdir() if f.suffix in WEIGHT_SUFFIXES)
