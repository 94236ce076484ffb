"""Prompt records -> what a rollout generates from (``PromptGroup``), as TRL's
``GRPOTrainer`` reads them.

A record holds a ``prompt``: text (TRL's standard format), or a conversation, a list of
{role, content} ending with the turn to answer (TRL's conversational format); chat
``messages`` are taken as a conversational prompt too.  Every other column passes through
to the reward functions unchanged (an ``answer`` to check against, test cases...).  Text
is tokenized as TRL tokenizes it (the tokenizer's call, its special tokens included, no
chat template); a conversation is rendered with the chat template and the generation
prompt.  What reward functions see as the prompt is the record's own value.

Invariant: a record that cannot be a prompt is refused naming its global index and the
fix, before anything is generated from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Tuple

from raytrain_ext.errors import InputError
from raytrain_ext.prepare.render import chat_messages, template_ids

PROMPT_COLUMNS = ("prompt", "messages")


@dataclass(frozen=True)
class PromptGroup:
    """What a rank asks to be generated for one prompt: its global index, token ids, the
    text (or messages) the reward functions see, and the record's other columns."""

    index: int
    prompt_ids: Tuple[int, ...]
    prompt: Any
    columns: Dict[str, Any] = field(default_factory=dict)


def prompt_group(record: Mapping[str, Any], index: int, tokenizer: Any) -> PromptGroup:
    """The prompt group of record ``index`` (module doc)."""
    present = [c for c in PROMPT_COLUMNS if record.get(c) is not None]
    if len(present) != 1:
        raise InputError(
            f"prompt record {index} has {present or 'neither'} of 'prompt' and 'messages': "
            "give each record exactly one (text, or a chat list of {role, content})"
        )
    (column,) = present
    value = record[column]
    columns = {k: v for k, v in record.items() if k not in PROMPT_COLUMNS}
    ids = _encode(column, value, index, tokenizer)
    if not ids:
        raise InputError(f"prompt record {index} renders to no tokens: nothing to continue")
    return PromptGroup(index, tuple(ids), value, columns)


def _encode(column: str, value: Any, index: int, tokenizer: Any) -> List[int]:
    if column == "prompt" and isinstance(value, str):
        return list(tokenizer(value)["input_ids"])
    if column == "prompt" and not isinstance(value, list):
        raise InputError(
            f"prompt record {index}: 'prompt' must be text or a list of {{role, content}} "
            f"messages, not {type(value).__name__}"
        )
    messages = _messages(value, index, column)
    if not tokenizer.chat_template:
        raise InputError(
            f"prompt record {index} is a conversation but the tokenizer has no chat "
            "template: use a tokenizer with one (an instruct model's), or 'prompt' text"
        )
    return template_ids(tokenizer, messages, generation_prompt=True)


def _messages(value: Any, index: int, column: str) -> List[Dict[str, str]]:
    messages = chat_messages(value)
    if messages is None:
        raise InputError(
            f"prompt record {index}: {column!r} must be a non-empty list of "
            "{role, content} objects with text content"
        )
    return messages
