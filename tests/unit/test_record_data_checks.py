"""Records, prepared directories and evaluation settings refused on the driver, before Ray,
by the same ``preflight`` that ``Trainer.fit`` runs first: each message names the key, the
file and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytrain_ext.config import load_config
from raytrain_ext.errors import InputError
from raytrain_ext.inputs.preflight import preflight
from raytrain_ext.prepare.pipeline import prepare_dataset
from tests.helpers.text_data import (
    build_tokenizer,
    preference_records,
    prompt_response_records,
    text_records,
    write_jsonl,
)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("records")
    build_tokenizer(root / "tok", with_chat_template=False)
    build_tokenizer(root / "tok_chat", with_chat_template=True)  # another sha256
    write_jsonl(root / "text.jsonl", text_records(40, seed=3))
    write_jsonl(root / "chat.jsonl", prompt_response_records(24, seed=4))
    write_jsonl(root / "pref.jsonl", preference_records(6, seed=5))
    prepare_dataset(str(root / "text.jsonl"), str(root / "tok"), root / "text_prepared", "text")
    return root


def _cfg(root: Path, tmp_path: Path, *overrides: str):
    base = [
        f"run.output_dir={tmp_path / 'runs'}",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        "model.seq_len=16",
        "data.global_batch_size=4",
        "data.micro_batch_size=2",
    ]
    return load_config(None, [*base, *overrides])


def _refused(cfg) -> str:
    with pytest.raises(InputError) as caught:
        preflight(cfg)
    return str(caught.value)


def test_missing_text_column_names_the_column_and_the_file(inputs, tmp_path):
    cfg = _cfg(
        inputs,
        tmp_path,
        f"data.path={inputs / 'text.jsonl'}",
        "data.format=text",
        f"data.tokenizer={inputs / 'tok'}",
        "data.text_column=body",
    )
    message = _refused(cfg)
    assert "body" in message and "text.jsonl" in message and "data.text_column" in message


def test_empty_file_and_wrong_format_are_refused(inputs, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    cfg = _cfg(inputs, tmp_path, f"data.path={tmp_path / 'empty.jsonl'}", "data.format=text",
               f"data.tokenizer={inputs / 'tok'}")  # fmt: skip
    assert "no records" in _refused(cfg)
    fake = tmp_path / "data.parquet"
    fake.write_text('{"text": "not parquet"}\n')
    cfg = _cfg(inputs, tmp_path, f"data.path={fake}", "data.format=text",
               f"data.tokenizer={inputs / 'tok'}")  # fmt: skip
    message = _refused(cfg)
    assert "data.path" in message and "data.parquet" in message


def test_a_prepared_directory_refuses_another_tokenizer_and_format(inputs, tmp_path):
    prepared = inputs / "text_prepared"
    other = _cfg(inputs, tmp_path, f"data.path={prepared}", f"data.tokenizer={inputs / 'tok_chat'}")
    message = _refused(other)
    assert "data.tokenizer" in message and "was prepared with the tokenizer" in message
    assert "data prepare" in message
    same = _cfg(inputs, tmp_path, f"data.path={prepared}", f"data.tokenizer={inputs / 'tok'}")
    preflight(same)  # the tokenizer it was prepared with: accepted
    chat = _cfg(inputs, tmp_path, f"data.path={prepared}", "data.format=chat",
                "objective.name=sft")  # fmt: skip
    assert "was prepared as text data" in _refused(chat)
    small = _cfg(inputs, tmp_path, f"data.path={prepared}", "model.vocab_size=8")
    assert "model.vocab_size" in _refused(small)


def test_fewer_records_than_one_global_batch_unless_repeat_is_allowed(inputs, tmp_path):
    overrides = [
        f"data.path={inputs / 'pref.jsonl'}",
        "data.format=preference",
        "objective.name=dpo",
        f"data.tokenizer={inputs / 'tok'}",
        "data.global_batch_size=8",
    ]
    message = _refused(_cfg(inputs, tmp_path, *overrides))
    assert "data.global_batch_size" in message and "6 training samples" in message
    preflight(_cfg(inputs, tmp_path, *overrides, "data.allow_repeat=true"))


def test_raw_records_need_a_tokenizer_and_eval_needs_a_split(inputs, tmp_path):
    cfg = _cfg(inputs, tmp_path, f"data.path={inputs / 'chat.jsonl'}", "data.format=chat",
               "objective.name=sft")  # fmt: skip
    assert "data.tokenizer" in _refused(cfg)
    assert "eval.fraction" in _refused(_cfg(inputs, tmp_path, "eval.every_steps=5"))
    pipeline = _cfg(inputs, tmp_path, "eval.every_steps=5", "eval.fraction=0.1", "parallel.pp=2",
                    "model.n_layers=2", "scaling.num_workers=2")  # fmt: skip
    assert "pipeline" in _refused(pipeline)


def test_token_ids_out_of_range_are_refused(inputs, tmp_path):
    path = tmp_path / "bad.arrow"
    import numpy as np

    from raytrain_ext.data.corpus import write_token_file

    write_token_file(np.array([1, 2, -3] * 200, dtype=np.int64), path)
    assert "ids must be >= 0" in _refused(_cfg(inputs, tmp_path, f"data.path={path}"))
    write_token_file(np.array([1, 2, 300] * 200, dtype=np.int64), path)
    assert "model.vocab_size" in _refused(_cfg(inputs, tmp_path, f"data.path={path}"))


def test_records_prepared_here_are_not_tokenized_again_nor_their_tokenizer_reloaded(
    inputs, tmp_path, monkeypatch
):
    """The run's cache entry is keyed by the local tokenizer's files: a second start reads
    it without loading the tokenizer (2-4 s of transformers' import on the driver), and a
    tokenizer whose files changed gets an entry of its own, prepared with it."""
    from raytrain_ext.prepare import pipeline, tokenizer

    tok = tmp_path / "tok"
    build_tokenizer(tok, with_chat_template=False)
    overrides = [f"data.path={inputs / 'text.jsonl'}", "data.format=text", f"data.tokenizer={tok}"]
    preflight(_cfg(inputs, tmp_path, *overrides))  # prepares the entry
    entries = sorted((tmp_path / "runs").rglob("index.json"))
    loads: list = []

    def counted_load(spec, eos_token=None):
        loads.append(spec)
        return real_load(spec, eos_token)

    real_load = tokenizer.load_tokenizer
    monkeypatch.setattr(tokenizer, "load_tokenizer", counted_load)
    monkeypatch.setattr(pipeline, "load_tokenizer", counted_load)
    preflight(_cfg(inputs, tmp_path, *overrides))
    assert loads == [] and sorted((tmp_path / "runs").rglob("index.json")) == entries

    build_tokenizer(tok, with_chat_template=True)  # other files: another entry, prepared
    preflight(_cfg(inputs, tmp_path, *overrides))
    assert loads == [str(tok)]
    assert len(sorted((tmp_path / "runs").rglob("index.json"))) == len(entries) + 1
