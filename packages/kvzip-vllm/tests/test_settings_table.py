"""The repository against kvzip's table of settings (kvzip_formats.settings): every ``KVZIP_*``
variable it reads or documents is declared, the sources read them through the table, and the
generated settings tables (the README's user settings, docs/development.md's test and benchmark
variables) are the generated ones. Here because kvzip-vllm's environment holds
every package."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from kvzip_formats import settings

ROOT = Path(__file__).resolve().parents[3]
NAME = re.compile(r"\bKVZIP_[A-Z0-9_]*[A-Z0-9]\b")
#: what may read or mention a variable: sources, tests, benchmark scripts, documentation
SUFFIXES = {".py", ".sh", ".md", ".toml"}


def _files():
    for p in [ROOT / "README.md", ROOT / "noxfile.py", ROOT / "conftest.py", ROOT / ".ci" / "run"]:
        if p.exists():
            yield p
    for top in ("packages", "docs"):
        for p in (ROOT / top).rglob("*"):
            if p.suffix in SUFFIXES and p.is_file() and ".venv" not in p.parts:
                yield p


def test_every_kvzip_variable_in_the_repository_is_declared():
    declared = {s.name for s in settings.all_settings()}
    missing = {}
    for p in _files():
        for name in set(NAME.findall(p.read_text(errors="replace"))):
            if name not in declared and name not in settings.NOT_SETTINGS:
                missing.setdefault(name, []).append(str(p.relative_to(ROOT)))
    assert not missing, f"KVZIP_* variables not in kvzip_formats.settings: {missing}"


def test_every_declared_variable_is_read_somewhere_and_its_readers_exist():
    for s in settings.all_settings():
        for reader in s.readers:
            if "/" in reader:  # a test or benchmark file: it names the variable itself
                path = ROOT / "packages" / reader
                assert path.exists(), (s.name, reader)
                if path.is_file():
                    assert s.name in path.read_text(), (s.name, reader)
                continue
            module, _, attr = reader.partition(".settings.")
            mod = importlib.import_module(module + (".settings" if attr else ""))
            assert not attr or hasattr(mod, attr), (s.name, reader)


def test_the_sources_read_kvzip_variables_through_the_table_only():
    by_name = re.compile(r"""(environ(\.get)?\s*[\[(]|getenv\s*\()\s*f?["']KVZIP_""")
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "packages").glob("*/src/**/*.py")
        if by_name.search(p.read_text())
    ]
    assert not offenders, f"read a KVZIP_* variable by name, not through the table: {offenders}"


def test_the_readme_settings_section_is_the_generated_one():
    """The root README lists the user settings; docs/development.md the test and benchmark
    variables; each block is the generated one (every declared row in one of them)."""
    for audience, doc in settings.DOCUMENTS.items():
        text = (ROOT / doc).read_text()
        assert settings.readme_block(text, audience) == settings.block(audience), (
            f"{doc}'s {audience} settings table differs from kvzip_formats.settings: run "
            f"python -m kvzip_formats.settings --write {doc}"
        )


def test_the_connector_readme_tables_name_the_tables_variables():
    """kvzip-vllm's README lists the tier's keys beside their variables: the same pairs."""
    text = (ROOT / "packages" / "kvzip-vllm" / "README.md").read_text()
    pairs = re.findall(r"^\| `(\w+)` \| `(KVZIP_\w+)` \|", text, re.M)
    assert pairs
    env = settings.connector_env()
    for key, name in pairs:
        assert env.get(key) == name, (key, name)
    assert {k for k, _ in pairs} == set(env)  # each variable documented beside its key


def test_the_connector_reads_its_variables_from_the_table():
    from kvzip_vllm.settings import CONNECTOR_ENV, connector_settings

    assert CONNECTOR_ENV == settings.connector_env()
    s = connector_settings({}, {"KVZIP_TIER_BYTES": "1000", "KVZIP_TIER_CHUNK_TOKENS": " 512 "})
    assert s.budget_bytes == 1000 and s.chunk_tokens == 512
    assert connector_settings({}, {}).budget_bytes == settings.TIER_BYTES.default


def test_lossless_rows_join_the_table_in_its_shape():
    """kvzip-lossless declares its rows itself (it installs without kvzip-formats), with the
    field names of kvzip_formats.settings.Setting; all_settings() adds them."""
    from dataclasses import fields

    from kvzip_lossless import settings as lossless

    own = {f.name for f in fields(lossless.Setting)}
    assert own <= {f.name for f in fields(settings.Setting)}
    rows = settings.lossless_rows()
    assert [r.name for r in rows] == [r.name for r in lossless.SETTINGS]
    assert all(isinstance(r, settings.Setting) and r.package == "kvzip-lossless" for r in rows)
    assert set(rows) <= set(settings.all_settings())
    assert settings.find("KVZIP_LOSSLESS_DECODER").choices == lossless.DECODER.choices
