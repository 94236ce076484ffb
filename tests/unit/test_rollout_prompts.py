"""Prompt records (raytrain_ext.rollout.prompts): text or chat messages rendered as TRL
renders them (the chat template with the generation prompt), other columns passed
through to the rewards, and a record that cannot be a prompt refused by its index."""

import pytest

from raytrain_ext.errors import InputError
from raytrain_ext.rollout.prompts import prompt_group
from tests.helpers.text_data import build_tokenizer


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("tokenizers")
    return {
        templated: AutoTokenizer.from_pretrained(
            str(build_tokenizer(root / str(templated), templated))
        )
        for templated in (True, False)
    }


def words(tok, ids):
    return tok.convert_ids_to_tokens(list(ids))


def test_text_is_tokenized_as_is_and_a_conversation_with_the_generation_prompt(tokenizers):
    tok = tokenizers[True]
    text = prompt_group({"prompt": "the cat", "answer": "dog", "level": 2}, 7, tok)
    assert words(tok, text.prompt_ids) == ["the", "cat"]  # TRL's standard format: no template
    assert (text.index, text.prompt, text.columns) == (7, "the cat", {"answer": "dog", "level": 2})
    messages = [
        {"role": "system", "content": "the sun"},
        {"role": "user", "content": "a tree"},
    ]
    expected = ["<|system|>", "the", "sun", "<|user|>", "a", "tree", "<|assistant|>"]
    for column in ("prompt", "messages"):  # TRL's conversational format, or chat messages
        chat = prompt_group({column: messages, "answer": "x"}, 8, tok)
        assert words(tok, chat.prompt_ids) == expected
        assert chat.prompt == messages and chat.columns == {"answer": "x"}


@pytest.mark.parametrize(
    "record, templated, text",
    [
        ({"answer": 1}, True, "record 3 has neither of 'prompt' and 'messages'"),
        ({"prompt": "a", "messages": []}, True, r"record 3 has \['prompt', 'messages'\]"),
        ({"prompt": 5}, True, "record 3: 'prompt' must be text or a list of"),
        ({"messages": [{"role": "user"}]}, True, "record 3: 'messages' must be a non-empty list"),
        ({"messages": [{"role": "user", "content": "a"}]}, False, "is a conversation but the"),
        ({"prompt": ""}, False, "record 3 renders to no tokens"),
    ],
    ids=["neither", "both", "not-text", "bad-messages", "no-template", "empty"],
)
def test_a_record_that_is_no_prompt_is_refused_by_its_index(tokenizers, record, templated, text):
    with pytest.raises(InputError, match=text):
        prompt_group(record, 3, tokenizers[templated])
