"""The driver's cache of checked Hugging Face configs (``models.hf_shape_cache``): a second
load of the same values reads the shape without building the ``transformers`` config, any
change of a value builds it again, a refused config is never kept, and a damaged, missing
or unwritable cache changes no outcome."""

from __future__ import annotations

import json

import pytest

from raytrain_ext.config import ConfigError, load_config
from raytrain_ext.models import hf_shape_cache
from raytrain_ext.models.hf_shape_cache import CACHE_ENV
from tests.helpers.hf_models import hf_overrides, save_tiny

pytest.importorskip("transformers")

INLINE = (
    "{model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
    "num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 512, "
    "max_position_embeddings: 128}"
)


def inline_overrides(inline: str = INLINE) -> list:
    return ["model.source=hf", f"model.hf.config={inline}", "model.seq_len=64"]


def shape_of(cfg) -> tuple:
    m = cfg.model
    return (m.n_layers, m.d_model, m.n_heads, m.vocab_size, m.mlp_ratio)


def entries(cache) -> list:
    return sorted((cache / "hf_shapes").glob("*.json")) if (cache / "hf_shapes").exists() else []


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def refuse_to_build(monkeypatch) -> list:
    """Make building the transformers config fail loudly; the list records each attempt."""
    builds: list = []

    def build(family, values):
        builds.append(family)
        raise AssertionError("the transformers config was built")

    monkeypatch.setattr(hf_shape_cache, "build_config", build)
    return builds


def test_a_second_load_reads_the_shape_without_building_the_config(cache, monkeypatch):
    first = load_config(None, inline_overrides())
    assert len(entries(cache)) == 1
    builds = refuse_to_build(monkeypatch)
    second = load_config(None, inline_overrides())
    assert builds == []
    assert shape_of(second) == shape_of(first) == (2, 64, 4, 512, 2)


def test_a_model_directory_is_keyed_by_its_config_json(cache, tmp_path, monkeypatch):
    directory = save_tiny(tmp_path / "llama")
    first = load_config(None, hf_overrides(directory))
    config = json.loads((directory / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (directory / "config.json").write_text(json.dumps(config))
    changed = load_config(None, hf_overrides(directory))
    assert (first.model.n_layers, changed.model.n_layers) == (2, 3)
    assert len(entries(cache)) == 2


@pytest.mark.parametrize(
    "changed",
    [INLINE.replace("hidden_size: 64", "hidden_size: 128"), INLINE[:-1] + ", rope_theta: 500.0}"],
)
def test_any_changed_value_builds_the_config_again(cache, monkeypatch, changed):
    load_config(None, inline_overrides())
    builds = refuse_to_build(monkeypatch)
    with pytest.raises(AssertionError, match="was built"):
        load_config(None, inline_overrides(changed))
    assert builds == ["llama"]


def test_another_transformers_version_builds_the_config_again(cache, monkeypatch):
    load_config(None, inline_overrides())
    monkeypatch.setattr(hf_shape_cache.metadata, "version", lambda name: "0.0.1")
    builds = refuse_to_build(monkeypatch)
    with pytest.raises(AssertionError, match="was built"):
        load_config(None, inline_overrides())
    assert builds == ["llama"]


def test_a_refused_config_is_never_kept_and_fails_every_time(cache):
    bad = INLINE.replace("hidden_size: 64", "hidden_size: 66")
    for _ in range(2):
        with pytest.raises(ConfigError, match=r"model.hf.config: .*hidden size \(66\) is not a"):
            load_config(None, inline_overrides(bad))
    assert entries(cache) == []


def test_a_wrongly_typed_value_is_a_config_error_naming_the_key(cache):
    bad = INLINE.replace("hidden_size: 64", "hidden_size: wide")
    with pytest.raises(ConfigError, match=r"model.hf.config: .*'hidden_size' expected int"):
        load_config(None, inline_overrides(bad))


def test_a_damaged_entry_is_a_miss_and_is_written_again(cache):
    expected = shape_of(load_config(None, inline_overrides()))
    (entry,) = entries(cache)
    entry.write_text('{"num_hidden_layers": 2, "hidd')
    assert shape_of(load_config(None, inline_overrides())) == expected
    assert json.loads(entry.read_text())["hidden_size"] == 64


def test_an_empty_setting_turns_the_cache_off(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    load_config(None, inline_overrides())
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_cache_changes_nothing(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "cache"))  # under a file: cannot be made
    assert shape_of(load_config(None, inline_overrides())) == (2, 64, 4, 512, 2)
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]
