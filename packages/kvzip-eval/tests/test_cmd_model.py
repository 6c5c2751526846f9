"""``kvzip model path``: the embedded model's local Hugging Face folder, and nothing else, on
standard output (so ``vllm serve "$(kvzip model path)"`` works), converted once on first use
with progress on standard error. Run as a user runs it: the installed ``kvzip`` command in a
process of its own, so that anything the conversion's libraries print is seen."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvzip_eval.model import hf_folder

KVZIP = Path(sys.executable).parent / "kvzip"


def _kvzip(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    assert KVZIP.is_file(), f"no `kvzip` command beside {sys.executable}"
    return subprocess.run(
        [str(KVZIP), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


def _one_folder(res: subprocess.CompletedProcess) -> Path:
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert len(lines) == 1 and res.stdout == lines[0] + "\n", repr(res.stdout[-2000:])
    folder = Path(lines[0])
    assert folder.is_absolute() and folder.is_dir(), folder
    assert (folder / "config.json").is_file()
    assert list(folder.glob("*.safetensors")), sorted(p.name for p in folder.iterdir())
    assert (folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file()
    return folder


def test_model_path_prints_the_cached_folder_alone():
    cached = hf_folder()  # converted by now (the conversion is tested below)
    res = _kvzip("model", "path")
    assert _one_folder(res) == cached.resolve()
    assert "converting" not in res.stderr  # already converted: nothing to do


@pytest.mark.slow
def test_model_path_converts_the_embedded_gguf_once_with_progress_on_stderr(tmp_path):
    env = {"KVZIP_CACHE_DIR": str(tmp_path / "cache")}
    first = _kvzip("model", "path", env=env)
    folder = _one_folder(first)
    assert folder.parent == tmp_path / "cache" / "models"
    assert "converting SmolLM2-135M-Instruct.Q4_1.gguf" in first.stderr
    assert "converted in" in first.stderr
    again = _kvzip("model", "path", env=env)
    assert _one_folder(again) == folder and "converting" not in again.stderr


def test_model_path_of_a_users_folder_is_that_folder():
    cached = hf_folder()
    res = _kvzip("model", "path", "--model", str(cached))
    assert _one_folder(res) == cached.resolve()


def test_model_path_of_a_missing_folder_fails_on_stderr(tmp_path):
    res = _kvzip("model", "path", "--model", str(tmp_path / "nothing"))
    assert res.returncode == 1 and res.stdout == ""
    assert "does not exist" in res.stderr


def test_model_help_says_what_it_prints():
    res = _kvzip("model", "path", "--help")
    assert res.returncode == 0
    assert 'vllm serve "$(kvzip model path)"' in " ".join(res.stdout.split())
