"""Prompt records -> what a rollout generates from (``PromptGroup``), TRL's way.

A record holds a ``prompt`` (text) or chat ``messages`` (a list of {role, content}
ending with the turn to answer); every other column passes through to the reward
functions unchanged (an ``answer`` to check against, test cases, a language...).  With a
chat template, the prompt is rendered as the conversation so far plus the generation
prompt (text as one user message), as TRL renders it; without one, text is encoded as
it is (no special tokens) and messages are refused.  What reward functions see as the
prompt is the record's own ``prompt`` or ``messages``, as in TRL.

Invariant: a record that cannot be a prompt is refused naming its global index and the
fix, before anything is generated from it.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping

from raytrain_ext.errors import InputError
from raytrain_ext.rollout.service import PromptGroup

PROMPT_COLUMNS = ("prompt", "messages")


def prompt_group(record: Mapping[str, Any], index: int, tokenizer: Any) -> PromptGroup:
    """The prompt group of record ``index`` (module doc)."""
    present = [c for c in PROMPT_COLUMNS if c in record]
    if len(present) != 1:
        raise InputError(
            f"prompt record {index} has {present or 'neither'} of 'prompt' and 'messages': "
            "give each record exactly one (text, or a chat list of {role, content})"
        )
    (column,) = present
    value = record[column]
    columns = {k: v for k, v in record.items() if k != column}
    ids = _encode(column, value, index, tokenizer)
    if not ids:
        raise InputError(f"prompt record {index} renders to no tokens: nothing to continue")
    return PromptGroup(index, tuple(ids), value, columns)


def _encode(column: str, value: Any, index: int, tokenizer: Any) -> List[int]:
    templated = bool(tokenizer.chat_template)
    if column == "prompt":
        if not isinstance(value, str):
            raise InputError(
                f"prompt record {index}: 'prompt' must be text, not {type(value).__name__}"
            )
        if not templated:
            return list(tokenizer.encode(value, add_special_tokens=False))
        messages: List[Dict[str, str]] = [{"role": "user", "content": value}]
    else:
        messages = _messages(value, index)
        if not templated:
            raise InputError(
                f"prompt record {index} holds chat 'messages' but the tokenizer has no chat "
                "template: use a tokenizer with one (an instruct model's), or 'prompt' text"
            )
    return list(
        tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=False, add_generation_prompt=True
        )
    )


def _messages(value: Any, index: int) -> List[Dict[str, str]]:
    ok = isinstance(value, list) and bool(value)
    ok = ok and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    )
    if not ok:
        raise InputError(
            f"prompt record {index}: 'messages' must be a non-empty list of "
            "{role, content} objects with text content"
        )
    return [{"role": m["role"], "content": m["content"]} for m in value]
