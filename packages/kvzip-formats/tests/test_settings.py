"""kvzip's table of settings (kvzip_formats.settings): parsing, refusals, the README block."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvzip_formats import identity, settings
from kvzip_formats.settings import SettingError


def test_rows_are_unique_kvzip_variables_with_their_documentation():
    names = [s.name for s in settings.TABLE]
    assert len(names) == len(set(names))
    for s in settings.TABLE:
        assert s.name.startswith("KVZIP_") and s.name == s.name.upper(), s
        assert s.scope in settings.SCOPES and s.readers and s.doc, s
        assert s.type in (str, int, Path), s
        if s.choices:  # a default, where there is one, is a value the reader takes
            assert s.default is None or s.default in s.choices, s
        if s.default is not None and s.check is not None:
            assert s.check(s.default), s
    keys = [s.key for s in settings.TABLE if s.key]
    assert len(keys) == len(set(keys))


def test_unset_or_empty_is_the_default_and_a_value_is_parsed_to_its_type():
    slot = settings.WINDOW_SLOT_TOKENS
    assert slot.get({}) == 32768 and slot.get({slot.name: "  "}) == 32768
    assert slot.get({slot.name: " 1024 "}) == 1024
    assert settings.TIER_BYTES.get({"KVZIP_TIER_BYTES": "8_000_000_000"}) == 8_000_000_000
    home = settings.CACHE_DIR.get({"KVZIP_CACHE_DIR": "~/k"})
    assert home == Path.home() / "k"
    assert settings.KERNELS_BACKEND.get({"KVZIP_KERNELS_BACKEND": "triton"}) == "triton"


@pytest.mark.parametrize(
    "row, value, why",
    [
        (settings.WINDOW_SLOT_TOKENS, "1000", "supported: a power of two"),
        (settings.WINDOW_SLOT_TOKENS, "0", "supported: a power of two"),
        (settings.WINDOW_SLOT_TOKENS, "32k", "not an integer"),
        (settings.TIER_BYTES, "8G", "not an integer"),
        (settings.TIER_BYTES, "-1", "supported: a positive integer"),
        (settings.KERNELS_BACKEND, "cudnn", "supported: one of auto, cuda, triton"),
        (settings.GPU_SHAPE, "70b", "supported: one of 8b, tiny"),
    ],
)
def test_a_bad_value_is_refused_naming_the_variable_the_value_and_what_is_supported(
    row, value, why
):
    with pytest.raises(SettingError, match=f"^{row.name}={value!r}: .*{why}"):
        row.get({row.name: value})


def test_value_prefers_a_calls_own_argument_then_the_variable_then_the_default():
    row = settings.KERNELS_BACKEND
    assert row.value(None, {}) == "auto"
    assert row.value(None, {row.name: "triton"}) == "triton"
    assert row.value("cuda", {row.name: "triton"}) == "cuda"


def test_the_cache_dir_is_read_through_the_table(tmp_path, monkeypatch):
    monkeypatch.setenv(settings.CACHE_DIR.name, str(tmp_path / "c"))
    assert identity.cache_dir() == tmp_path / "c"
    monkeypatch.setenv(settings.CACHE_DIR.name, "")
    assert identity.cache_dir() == Path.home() / ".cache" / "kvzip"


def test_markdown_has_one_row_per_setting_under_its_scope():
    text = settings.markdown()
    rows = [line for line in text.splitlines() if line.startswith("| `KVZIP_")]
    assert [r.split("`")[1] for r in rows] == [s.name for s in settings.all_settings()]
    user = settings.markdown(("user",))
    assert "KVZIP_KV_FORMAT" in user and "KVZIP_TEST_FORMAT" not in user


def _names(text: str) -> list[str]:
    return [line.split("`")[1] for line in text.splitlines() if line.startswith("| `KVZIP_")]


def test_each_setting_is_in_the_block_of_its_audience_alone():
    """The README's block lists what users set; docs/development.md's the test and benchmark
    variables; between them, every row once."""
    user, dev = settings.block("user"), settings.block("dev")
    assert _names(user) == [s.name for s in settings.all_settings() if s.audience == "user"]
    assert _names(dev) == [s.name for s in settings.all_settings() if s.audience == "dev"]
    assert sorted(_names(user) + _names(dev)) == sorted(s.name for s in settings.all_settings())
    for name in ("KVZIP_GPU_SHAPE", "KVZIP_TREE", "KVZIP_LOAD_GROUP_CHUNKS"):
        assert name in dev and name not in user
    assert "docs/development.md" in user  # the README points at the developer table
    assert user.startswith(settings.BEGIN) and user.endswith(settings.END)
    assert dev.startswith(settings.DEV_BEGIN) and dev.endswith(settings.DEV_END)
    assert set(settings.AUDIENCES) == set(settings.MARKERS) == set(settings.DOCUMENTS)
    assert sorted(sum(settings.AUDIENCES.values(), ())) == sorted(settings.SCOPES)


def test_write_then_check_a_readme(tmp_path, capsys):
    readme = tmp_path / "README.md"
    stale = f"# x\n\n{settings.BEGIN}\n| old |\n{settings.END}\n\nafter\n"
    readme.write_text(stale)
    assert settings.main(["--check", str(readme)]) == 1
    assert "differs" in capsys.readouterr().err
    assert settings.main(["--write", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# x\n\n") and text.endswith("\n\nafter\n")
    assert settings.readme_block(text) == settings.block()
    assert settings.main(["--check", str(readme)]) == 0
    assert not settings.write_readme(readme)  # already up to date


def test_write_then_check_a_document_with_both_blocks(tmp_path, capsys):
    doc = tmp_path / "development.md"
    stale = (
        f"# d\n{settings.DEV_BEGIN}\n| old |\n{settings.DEV_END}\nmiddle\n"
        f"{settings.BEGIN}\n{settings.END}\nend\n"
    )
    doc.write_text(stale)
    assert settings.main(["--check", str(doc)]) == 1
    err = capsys.readouterr().err
    assert "dev settings block differs" in err and "user settings block differs" in err
    assert settings.main(["--write", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# d\n") and "\nmiddle\n" in text and text.endswith("\nend\n")
    assert settings.readme_block(text, "dev") == settings.block("dev")
    assert settings.readme_block(text, "user") == settings.block("user")
    assert settings.main(["--check", str(doc)]) == 0


def test_a_readme_without_the_block_is_refused(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# no block\n")
    with pytest.raises(SystemExit, match="no settings block"):
        settings.main(["--write", str(readme)])
