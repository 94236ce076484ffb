"""``data.format: prompts``: the prompt records of a GRPO run, read whole by every rank.

Prompts are small (a dataset of 100k prompts is tens of MB), so each rank reads the
records once (``prepare.text_sources``: JSON lines, Parquet, Arrow, a ``datasets``
save, local or ``s3://``) and tokenizes only the prompts a step asks for
(``rollout.prompts.prompt_group``, TRL's rendering).  Record ``i`` is the same record on
every rank and every run (the source's order), so the global sampler's index names it.

Invariant: a record that cannot be a prompt is refused by its index; the driver checks
every record before Ray starts (:func:`check_prompt_data`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Dict, List

from raytrain_ext.errors import InputError
from raytrain_ext.prepare.text_sources import RecordSource, open_source
from raytrain_ext.rollout.prompts import PROMPT_COLUMNS, PromptGroup, prompt_group


class PromptRecords:
    """Every prompt record of ``data.path``, and a step's prompt groups from them."""

    def __init__(self, source: RecordSource, tokenizer: Any):
        self.source = source
        self.tokenizer = tokenizer
        self.records = _read_all(source)
        self.num_samples = len(self.records)
        self._group = lru_cache(maxsize=65536)(self._render)

    def group(self, index: int) -> PromptGroup:
        """Record ``index`` as a prompt group (tokenized once per rank)."""
        return self._group(int(index))

    def _render(self, index: int) -> PromptGroup:
        return prompt_group(self.records[index], index, self.tokenizer)


def open_prompt_records(cfg) -> PromptRecords:
    """``data.path``'s prompt records with the run's tokenizer (``data.tokenizer``, else the
    model directory's)."""
    from raytrain_ext.data.open import tokenizer_spec
    from raytrain_ext.prepare.tokenizer import load_tokenizer

    spec = tokenizer_spec(cfg)
    if spec is None:
        raise InputError(
            "data.tokenizer: data.format=prompts needs a tokenizer to render the prompts and "
            "decode the completions; set data.tokenizer to a Hugging Face tokenizer directory."
        )
    source = open_source(
        cfg.data.path, s3_endpoint_url=cfg.data.s3_endpoint_url, s3_region=cfg.data.s3_region
    )
    return PromptRecords(source, load_tokenizer(spec, cfg.data.eos_token))


def check_prompt_data(cfg) -> None:
    """Before Ray: the records open, there are enough of them, and every one renders to a
    prompt whose tokens the model's vocabulary holds (the message names the record)."""
    records = open_prompt_records(cfg)
    d = cfg.data
    if records.num_samples < d.global_batch_size and not d.allow_repeat:
        raise InputError(
            f"data.path: {records.source.name} holds {records.num_samples} prompts, fewer than "
            f"one global batch (data.global_batch_size={d.global_batch_size} prompt groups); "
            "add prompts, lower the batch, or set data.allow_repeat=true."
        )
    from raytrain_ext.models.sources import model_source

    positions = model_source(cfg.model).hf_config(cfg.model).max_position_embeddings
    vocab = cfg.model.vocab_size
    completion = cfg.objective.grpo.max_completion_length
    for index in range(records.num_samples):
        ids = records.group(index).prompt_ids
        where = f"prompt record {index} ({records.source.where(index)})"
        if max(ids) >= vocab:
            raise InputError(
                f"data.path: {where} holds token id {max(ids)}, but the model's vocabulary has "
                f"{vocab}; use the model's tokenizer (data.tokenizer)."
            )
        if len(ids) + completion > positions:
            raise InputError(
                f"objective.grpo.max_completion_length: {where} has {len(ids)} tokens, and "
                f"with max_completion_length={completion} its rows would exceed the model's "
                f"max_position_embeddings={positions}; lower max_completion_length or shorten "
                "the prompt."
            )


def _read_all(source: RecordSource) -> List[Dict[str, Any]]:
    columns = _columns(source)
    if not any(c in columns for c in PROMPT_COLUMNS):
        raise InputError(
            f"data.path: {source.name} has no 'prompt' or 'messages' column (it has "
            f"{', '.join(columns) or 'none'}); data.format=prompts reads a prompt per record."
        )
    table = source.read(0, source.records, columns)
    names = list(table)
    return [dict(zip(names, row, strict=True)) for row in zip(*table.values(), strict=True)]


def _columns(source: RecordSource) -> List[str]:
    """The columns every file has (a column some files lack cannot be read from them)."""
    if source.table is not None:
        return list(source.table.column_names)
    files = [f for f in source.files if f.records]
    return [c for c in files[0].columns if all(c in f.columns for f in files)] if files else []
