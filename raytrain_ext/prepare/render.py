"""Records to token rows, per ``data.format`` (the shard columns of prepared_index.py).

- ``text``: each document tokenized without special tokens, then the EOS id: one flat
  int32 stream.
- ``chat``: ``messages`` rendered with the tokenizer's chat template; the response of an
  assistant turn is what the conversation up to and including that turn adds to the
  conversation before it with the generation prompt, so ``loss_mask`` is 1 exactly on
  the tokens the template writes for assistant turns (content and end-of-turn), never on
  the header that announces them.  This needs each rendering to be a prefix of the next
  one's; a template that breaks that is refused.  ``prompt``/``response`` records are one
  user and one assistant message with a chat template, and ``prompt ids + response ids +
  EOS`` (mask 1 on the response and the EOS) without one.
- ``preference``: ``chosen`` and ``rejected`` are each the prompt/response rendering of
  ``(prompt, chosen)`` and ``(prompt, rejected)``, so a preference run sees its examples
  exactly as a chat run on the same tokenizer does.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import pyarrow as pa

from raytrain_ext.errors import InputError
from raytrain_ext.prepare.text_sources import COLUMN_KEY, PATH_KEY, Columns
from raytrain_ext.prepare.tokenizer import TOKENIZER_KEY, encode_documents, has_chat_template

Where = Callable[[int], str]  # global record index -> "FILE record j"
Example = Tuple[List[int], List[int]]  # token ids and their loss mask


@dataclass
class Rendered:
    """One shard's table and its token count (summed over every list column of ids)."""

    table: pa.Table
    tokens: int


def render_records(
    fmt: str, tok, eos_id: int, columns: Columns, first: int, where: Where
) -> Rendered:
    """Render the records ``first, first + 1, ...`` held in ``columns``."""
    if fmt == "text":
        (texts,) = columns.values()
        return render_text(tok, eos_id, texts, first, where)
    if fmt == "chat":
        return render_chat(tok, eos_id, columns, first, where)
    return render_preference(tok, eos_id, columns, first, where)


def render_text(tok, eos_id: int, texts: List[Any], first: int, where: Where) -> Rendered:
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise InputError(
                f"{COLUMN_KEY}: {where(first + i)} holds {type(text).__name__} "
                f"{_short(text)}, not text. Clean the data or set data.text_column to the "
                "column of documents."
            )
    ids = encode_documents(tok, texts)
    for doc in ids:
        doc.append(eos_id)
    total = sum(map(len, ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=total)
    return Rendered(pa.table({"tokens": pa.array(flat, pa.int32())}), total)


def render_chat(tok, eos_id: int, columns: Columns, first: int, where: Where) -> Rendered:
    if "messages" in columns:
        if not has_chat_template(tok):
            raise InputError(
                f"{TOKENIZER_KEY}: {where(first)} holds 'messages', but the tokenizer has no "
                "chat template. Use a tokenizer with one (chat_template in its "
                "tokenizer_config.json), or give prompt/response columns instead."
            )
        examples = [
            render_messages(tok, _messages(m, first + i, where), first + i, where)
            for i, m in enumerate(columns["messages"])
        ]
    else:
        examples = render_prompt_response(
            tok, eos_id, columns["prompt"], columns["response"], first, where
        )
    table = pa.table(
        {"tokens": _lists(examples, 0, pa.int32()), "loss_mask": _lists(examples, 1, pa.int8())}
    )
    return Rendered(table, sum(len(ids) for ids, _ in examples))


def render_preference(tok, eos_id: int, columns: Columns, first: int, where: Where) -> Rendered:
    prompts = columns["prompt"]
    chosen = render_prompt_response(tok, eos_id, prompts, columns["chosen"], first, where)
    rejected = render_prompt_response(tok, eos_id, prompts, columns["rejected"], first, where)
    table = pa.table(
        {
            "chosen": _lists(chosen, 0, pa.int32()),
            "rejected": _lists(rejected, 0, pa.int32()),
            "chosen_mask": _lists(chosen, 1, pa.int8()),
            "rejected_mask": _lists(rejected, 1, pa.int8()),
        }
    )
    tokens = sum(len(ids) for ids, _ in chosen) + sum(len(ids) for ids, _ in rejected)
    return Rendered(table, tokens)


def render_prompt_response(
    tok, eos_id: int, prompts: List[Any], responses: List[Any], first: int, where: Where
) -> List[Example]:
    """One example per (prompt, response): the chat template's, or plain ids then EOS."""
    for column, values in (("prompt", prompts), ("response", responses)):
        for i, value in enumerate(values):
            if not isinstance(value, str):
                raise InputError(
                    f"{PATH_KEY}: {where(first + i)} has {type(value).__name__} "
                    f"{_short(value)} where text is expected ({column}). Clean the data."
                )
    if has_chat_template(tok):
        return [
            render_messages(tok, _pair(p, r), first + i, where)
            for i, (p, r) in enumerate(zip(prompts, responses, strict=True))
        ]
    batch = dict(add_special_tokens=False, return_attention_mask=False)
    prompt_ids = tok(prompts, **batch)["input_ids"]
    response_ids = tok(responses, **batch)["input_ids"]
    return [
        (p + r + [eos_id], [0] * len(p) + [1] * (len(r) + 1))
        for p, r in zip(prompt_ids, response_ids, strict=True)
    ]


def render_messages(tok, messages: List[Dict[str, str]], record: int, where: Where) -> Example:
    """Ids of the whole conversation, mask 1 on what each assistant turn adds."""
    full = template_ids(tok, messages, False)
    mask = [0] * len(full)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if turn == 0:
            raise InputError(
                f"{PATH_KEY}: {where(record)} starts with an assistant message; a chat "
                "example needs the turn it answers first."
            )
        before = template_ids(tok, messages[:turn], True)
        last = turn == len(messages) - 1
        upto = full if last else template_ids(tok, messages[: turn + 1], False)
        if upto[: len(before)] != before or full[: len(upto)] != upto:
            raise InputError(
                f"{TOKENIZER_KEY}: its chat template does not render {where(record)} so that "
                f"the conversation before assistant turn {turn} (with the generation prompt) "
                "is a prefix of the conversation up to it, and that a prefix of the whole, so "
                "the response tokens cannot be found. Use a template whose rendering of the "
                "first turns of a conversation begins the rendering of the whole."
            )
        mask[len(before) : len(upto)] = [1] * (len(upto) - len(before))
    if not any(mask):
        raise InputError(
            f"{PATH_KEY}: {where(record)} has no assistant message, so nothing to learn. "
            "Every chat record needs at least one message with role 'assistant'."
        )
    return full, mask


def template_ids(tok, messages: List[Dict[str, str]], generation_prompt: bool) -> List[int]:
    """``messages`` rendered with the tokenizer's chat template, as token ids."""
    return list(
        tok.apply_chat_template(
            messages, tokenize=True, return_dict=False, add_generation_prompt=generation_prompt
        )
    )


def _pair(prompt: str, response: str) -> List[Dict[str, str]]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


def chat_messages(value: Any) -> Optional[List[Dict[str, str]]]:
    """``value`` as a chat conversation (a non-empty list of {role, content} with text
    content, reduced to those two keys); None when it is not one."""
    ok = (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in value
        )
    )
    return [{"role": m["role"], "content": m["content"]} for m in value] if ok else None


def _messages(value: Any, record: int, where: Where) -> List[Dict[str, str]]:
    messages = chat_messages(value)
    if messages is None:
        raise InputError(
            f"{PATH_KEY}: {where(record)}: 'messages' must be a non-empty list of "
            f"{{role, content}} objects with text content, not {_short(value)}."
        )
    return messages


def _lists(examples: List[Example], part: int, dtype: pa.DataType) -> pa.Array:
    """A list<dtype> column built from flat values and offsets (one copy)."""
    lengths = np.fromiter((len(e[part]) for e in examples), dtype=np.int64, count=len(examples))
    offsets: np.ndarray = np.zeros(len(examples) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter(
        (v for e in examples for v in e[part]),
        dtype=dtype.to_pandas_dtype(),
        count=int(offsets[-1]),
    )
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, dtype))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
