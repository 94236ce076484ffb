"""Records to token rows, tokenizer identity, and reading/checking user data (no Ray).

The tokenizer is word-level (tests/helpers/text_data.py), so every expected id list is
spelled out word by word from its vocabulary.
"""

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from raytrain_ext.errors import InputError
from raytrain_ext.prepare.render import render_records
from raytrain_ext.prepare.text_sources import check_source, open_source
from raytrain_ext.prepare.tokenizer import encode_documents, load_tokenizer, tokenizer_info
from tests.helpers.text_data import (
    build_tokenizer,
    messages_records,
    preference_records,
    prompt_response_records,
    text_records,
    write_jsonl,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {
        "plain": load_tokenizer(str(build_tokenizer(root / "plain", with_chat_template=False))),
        "chat": load_tokenizer(str(build_tokenizer(root / "chat", with_chat_template=True))),
        "root": root,
    }


def ids(tok, text):
    return tok.convert_tokens_to_ids(text.split())


def where(record):
    return f"data.jsonl record {record}"


def render(fmt, tok, rows, first=0):
    columns = {k: [r[k] for r in rows] for k in rows[0]}
    return render_records(fmt, tok, tokenizer_info(tok, "t").eos_id, columns, first, where)


def test_text_documents_are_packed_each_followed_by_eos(tokenizers):
    tok = tokenizers["plain"]
    eos = tok.convert_tokens_to_ids("</s>")
    out = render("text", tok, [{"text": "the cat"}, {"text": ""}, {"text": "a dog sun"}])
    assert out.table.schema == pa.schema([("tokens", pa.int32())])
    expected = ids(tok, "the cat") + [eos, eos] + ids(tok, "a dog sun") + [eos]
    assert out.table.column("tokens").to_pylist() == expected
    assert out.tokens == len(expected) == 8


def test_encode_documents_gives_the_ids_of_the_transformers_call(tokenizers):
    """The backend called directly, even when it was left truncating and padding."""
    tok = tokenizers["plain"]
    texts = ["the cat </s> a dog", "", "sun sun the a"]
    want = tok(texts, add_special_tokens=False)["input_ids"]
    tok.backend_tokenizer.enable_truncation(2)
    tok.backend_tokenizer.enable_padding(length=9)
    assert encode_documents(tok, texts) == want
    assert tok(texts, add_special_tokens=False)["input_ids"] == want


def test_text_that_is_not_a_string_names_the_column_and_record(tokenizers):
    with pytest.raises(InputError, match=r"data\.text_column .*data\.jsonl record 6 holds int 7"):
        render("text", tokenizers["plain"], [{"text": "the"}, {"text": 7}], first=5)


def test_prompt_response_without_template_masks_response_and_eos(tokenizers):
    tok = tokenizers["plain"]
    eos = tok.convert_tokens_to_ids("</s>")
    out = render("chat", tok, [{"prompt": "the cat is", "response": "a dog"}])
    assert out.table.column("tokens").to_pylist() == [ids(tok, "the cat is a dog") + [eos]]
    assert out.table.column("loss_mask").to_pylist() == [[0, 0, 0, 1, 1, 1]]
    assert out.table.schema.field("tokens").type == pa.list_(pa.int32())
    assert out.table.schema.field("loss_mask").type == pa.list_(pa.int8())


def test_messages_with_template_mask_exactly_the_assistant_turns(tokenizers):
    tok = tokenizers["chat"]
    messages = [
        {"role": "system", "content": "be good"},
        {"role": "user", "content": "the cat"},
        {"role": "assistant", "content": "a dog"},
        {"role": "user", "content": "why"},
        {"role": "assistant", "content": "sun moon tree"},
    ]
    out = render("chat", tok, [{"messages": messages}])
    text = (
        "<|system|> be good <|user|> the cat <|assistant|> a dog </s> "
        "<|user|> why <|assistant|> sun moon tree </s>"
    )
    mask = [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1]
    assert out.table.column("tokens").to_pylist() == [ids(tok, text)]
    assert out.table.column("loss_mask").to_pylist() == [mask]
    assert out.tokens == 17


def test_prompt_response_with_template_is_one_user_and_one_assistant_turn(tokenizers):
    tok = tokenizers["chat"]
    out = render("chat", tok, [{"prompt": "the cat", "response": "a dog"}])
    expected = ids(tok, "<|user|> the cat <|assistant|> a dog </s>")
    assert out.table.column("tokens").to_pylist() == [expected]
    assert out.table.column("loss_mask").to_pylist() == [[0, 0, 0, 0, 1, 1, 1]]


def test_messages_without_a_chat_template_name_the_tokenizer(tokenizers):
    rows = messages_records(1)
    with pytest.raises(InputError, match=r"data\.tokenizer .*no chat template"):
        render("chat", tokenizers["plain"], rows)


def test_a_template_that_breaks_the_prefix_property_is_refused(tokenizers, tmp_path):
    tok = load_tokenizer(str(build_tokenizer(tmp_path / "rev", with_chat_template=True)))
    tok.chat_template = (
        "{% for m in messages|reverse %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|> {% endif %}"
    )
    rows = [{"messages": messages_records(1)[0]["messages"]}]
    with pytest.raises(InputError, match=r"data\.tokenizer .*does not render .*record 0 .*prefix"):
        render("chat", tok, rows)


def test_preference_rows_hold_prompt_then_response_then_eos(tokenizers):
    tok = tokenizers["plain"]
    eos = tok.convert_tokens_to_ids("</s>")
    out = render("preference", tok, [{"prompt": "the cat", "chosen": "yes", "rejected": "no no"}])
    assert out.table.column_names == ["chosen", "rejected", "chosen_mask", "rejected_mask"]
    assert out.table.to_pylist() == [
        {
            "chosen": ids(tok, "the cat yes") + [eos],
            "rejected": ids(tok, "the cat no no") + [eos],
            "chosen_mask": [0, 0, 1, 1],
            "rejected_mask": [0, 0, 1, 1, 1],
        }
    ]
    assert out.tokens == 9
    learnable = preference_records(30, seed=3)
    assert {r["chosen"].split()[0] for r in learnable} == {"yes"}
    assert [len(r["chosen"].split()) for r in learnable] == [
        len(r["prompt"].split()) % 3 + 1 for r in learnable
    ]


def test_tokenizer_sha256_is_stable_and_tells_tokenizers_apart(tokenizers, tmp_path):
    root = tokenizers["root"]
    again = load_tokenizer(str(build_tokenizer(tmp_path / "copy", with_chat_template=True)))
    chat = tokenizer_info(tokenizers["chat"], "a")
    assert tokenizer_info(again, "b").sha256 == chat.sha256
    assert tokenizer_info(load_tokenizer(str(root / "chat")), "c").sha256 == chat.sha256
    assert tokenizer_info(tokenizers["plain"], "d").sha256 != chat.sha256
    assert len(chat.sha256) == 64
    assert (chat.eos_id, chat.pad_id, chat.vocab_size) == (2, 1, len(tokenizers["chat"]))


def test_eos_found_in_the_vocab_or_refused(tokenizers, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    bare = load_tokenizer(str(tokenizers["root"] / "plain" / "tokenizer.json"))
    info = tokenizer_info(bare, "file")
    assert (info.eos_id, info.pad_id) == (2, 2)  # '</s>' by name; pad falls back to EOS
    backend = Tokenizer(models.WordLevel({"<unk>": 0, "cat": 1}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    no_eos = load_tokenizer(str(tmp_path / "tokenizer.json"))
    with pytest.raises(InputError, match=r"data\.tokenizer .*has no EOS token .*Set eos_token"):
        tokenizer_info(no_eos, str(tmp_path / "tokenizer.json"))


def _bare_tokenizer_ending_in(tmp_path, eos: str) -> Path:
    """A tokenizer.json alone (no tokenizer_config.json) whose end-of-text token is ``eos``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, eos: 1, **{w: i + 2 for i, w in enumerate(["a", "cat", "sat"])}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    return tmp_path / "tokenizer.json"


def test_a_bare_tokenizer_json_takes_its_eos_from_data_eos_token(tmp_path, capsys):
    """``[EOS]`` is none of the conventional names: refused naming data.eos_token and
    --eos-token; given by that key, it ends the documents, through the real ``data prepare``
    command too; a token the tokenizer lacks is refused by name."""
    from raytrain_ext.cli import main
    from raytrain_ext.prepare.prepared_index import read_index

    bare = _bare_tokenizer_ending_in(tmp_path, "[EOS]")
    with pytest.raises(InputError, match=r"data\.eos_token=<token> \(data prepare: --eos-token"):
        tokenizer_info(load_tokenizer(str(bare)), str(bare))
    assert tokenizer_info(load_tokenizer(str(bare), "[EOS]"), "bare").eos_id == 1
    with pytest.raises(InputError, match=r"data\.eos_token \(--eos-token\): '\[END\]' is not a"):
        load_tokenizer(str(bare), "[END]")
    source = write_jsonl(tmp_path / "docs.jsonl", [{"text": "a cat sat"}] * 4)
    prepare = ["data", "prepare", str(source), "--tokenizer", str(bare)]
    assert main([*prepare, "--out", str(tmp_path / "refused")]) == 2
    assert "--eos-token <token>" in capsys.readouterr().err
    assert main([*prepare, "--out", str(tmp_path / "out"), "--eos-token", "[EOS]"]) == 0
    assert read_index(tmp_path / "out").tokenizer.eos_id == 1


def test_a_missing_tokenizer_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match=rf"data\.tokenizer \(--tokenizer\): {tmp_path}/no does n"):
        load_tokenizer(str(tmp_path / "no"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match=r"cannot load a tokenizer from directory .*nothing is"):
        load_tokenizer(str(tmp_path / "empty"))
    with pytest.raises(InputError, match=r"cannot load a tokenizer from model id 'no-such/model"):
        load_tokenizer("no-such/model")


def test_every_input_format_reads_the_same_records(tmp_path):
    import datasets

    records = text_records(23, seed=1)
    table = pa.Table.from_pylist(records)
    write_jsonl(tmp_path / "a.jsonl", records[:10])
    (tmp_path / "a.jsonl").write_text((tmp_path / "a.jsonl").read_text().replace("\n", "\n\n", 3))
    write_jsonl(tmp_path / "all.json", records)
    pq.write_table(table, tmp_path / "all.parquet", row_group_size=4)
    feather.write_feather(table, tmp_path / "all.feather", chunksize=5)
    with pa.ipc.new_stream(tmp_path / "all.arrow", table.schema) as writer:
        writer.write_table(table, max_chunksize=6)
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"), num_shards=3)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write_jsonl(mixed / "0.jsonl", records[:10])
    pq.write_table(table.slice(10, 7), mixed / "1.parquet", row_group_size=3)
    (mixed / "sub").mkdir()
    feather.write_feather(table.slice(17), mixed / "sub" / "2.arrow")
    for path in ["all.json", "all.parquet", "all.feather", "all.arrow", "saved", "mixed", table]:
        shown = path if isinstance(path, str) else "table"
        source = open_source(str(tmp_path / path) if shown != "table" else path, stride=3)
        assert source.records == 23, shown
        assert source.read(0, 23, ["text"]) == {"text": [r["text"] for r in records]}, shown
        assert source.read(5, 19, ["text"])["text"] == [r["text"] for r in records[5:19]], shown
        assert source.read(22, 23, ["text"])["text"] == [records[22]["text"]], shown
    assert open_source(str(tmp_path / "a.jsonl"), stride=3).read(4, 9, ["text"]) == {
        "text": [r["text"] for r in records[4:9]]
    }


def test_fingerprint_follows_the_content(tmp_path):
    write_jsonl(tmp_path / "a" / "x.jsonl", text_records(5))
    write_jsonl(tmp_path / "b" / "x.jsonl", text_records(5))
    write_jsonl(tmp_path / "c" / "x.jsonl", text_records(5, seed=9))
    a, b, c = (open_source(str(tmp_path / d)).fingerprint for d in "abc")
    assert a == b != c


def test_check_source_refusals_name_the_key_the_file_and_the_fix(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", text_records(3))
    with pytest.raises(InputError) as missing_column:
        check_source(str(data), "text", "body")
    assert str(missing_column.value) == (
        f"data.text_column (--text-column): {data} has no 'body' column (columns: text). Set "
        "data.text_column (--text-column) to the column that holds the documents."
    )
    half = write_jsonl(tmp_path / "half.jsonl", [{"prompt": "a", "chosen": "b"}])
    with pytest.raises(InputError, match=rf"data\.path: {half} has no 'rejected' column \(col"):
        check_source(str(half), "preference")
    with pytest.raises(InputError, match=r"d\.jsonl has no 'prompt', 'chosen', 'rejected' columns"):
        check_source(str(data), "preference")
    with pytest.raises(InputError, match=r"data\.path: .* neither a 'messages' column nor 'prom"):
        check_source(str(data), "chat")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(InputError, match=r"data\.path: .*empty\.jsonl holds no records \(0 rows\)"):
        check_source(str(tmp_path / "empty.jsonl"), "text")
    fake = tmp_path / "fake.parquet"
    fake.write_text('{"text": "the cat"}\n')
    with pytest.raises(InputError) as not_parquet:
        check_source(str(fake), "text")
    assert str(not_parquet.value).startswith(
        f"data.path: {fake} is named like .parquet data but is neither Parquet nor Arrow (it "
        "starts with b'{\"text\":'). Rename it to match its content (.jsonl/.json)"
    )
    with pytest.raises(InputError, match=rf"data\.path: {tmp_path}/nowhere does not exist\. "):
        check_source(str(tmp_path / "nowhere"), "text")
    (tmp_path / "bad.jsonl").write_text("the cat\n")
    with pytest.raises(InputError, match=r"bad\.jsonl record 0 is not a JSON line"):
        check_source(str(tmp_path / "bad.jsonl"), "text")


def test_check_source_picks_the_chat_columns(tmp_path):
    pairs = write_jsonl(tmp_path / "p.jsonl", prompt_response_records(2))
    chats = write_jsonl(tmp_path / "m.jsonl", messages_records(2))
    assert check_source(str(pairs), "chat")[1] == ("prompt", "response")
    assert check_source(str(chats), "chat")[1] == ("messages",)
    source, columns = check_source(str(chats), "chat")
    assert source.read(1, 2, columns)["messages"] == [messages_records(2)[1]["messages"]]


def test_s3_json_lines_and_parquet_read_like_local_files(s3_endpoint, tmp_path):
    import io
    import json
    import pickle

    import boto3

    records = text_records(30, seed=2)
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket="records")
    body = "".join(json.dumps(r) + "\n" for r in records[:12]).encode()
    s3.put_object(Bucket="records", Key="set/0.jsonl", Body=body)
    parquet = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(records[12:]), parquet, row_group_size=5)
    s3.put_object(Bucket="records", Key="set/1.parquet", Body=parquet.getvalue())
    source, columns = check_source(
        "s3://records/set", "text", s3_endpoint_url=s3_endpoint, stride=4
    )
    assert (source.name, source.records, columns) == ("s3://records/set", 30, ("text",))
    shipped = pickle.loads(pickle.dumps(source))  # as a Ray worker gets it
    assert shipped.read(7, 25, columns)["text"] == [r["text"] for r in records[7:25]]
    with pytest.raises(InputError, match=r"data\.path: bucket 'absent' does not exist at http"):
        check_source("s3://absent/x", "text", s3_endpoint_url=s3_endpoint)


def test_a_table_in_memory_prepares_to_the_shards_of_its_jsonl_file(tokenizers, tmp_path):
    from raytrain_ext.prepare.pipeline import run_preparation

    records = prompt_response_records(25, seed=8)
    data = write_jsonl(tmp_path / "pairs.jsonl", records)
    tok = str(tokenizers["root"] / "chat")
    table = pa.Table.from_pylist(records)
    from_table = run_preparation(table, tok, tmp_path / "t", "chat", records_per_shard=10)
    from_file = run_preparation(str(data), tok, tmp_path / "f", "chat", records_per_shard=10)
    assert from_table.index.shards == from_file.index.shards
    assert len(from_table.index.shards) == 3 and from_table.index.records == 25
    assert from_table.index.source.startswith("pyarrow.Table:")
    for name in ("shard-00000.arrow", "shard-00002.arrow"):
        assert (tmp_path / "t" / name).read_bytes() == (tmp_path / "f" / name).read_bytes()
    reordered = pa.concat_tables([table.slice(0, 5), table.slice(5)])
    again = run_preparation(reordered, tok, tmp_path / "t", "chat", records_per_shard=10)
    assert again.written == [] and again.index == from_table.index  # same content, same prep
