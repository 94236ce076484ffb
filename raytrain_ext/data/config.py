"""The ``data`` section: where the samples come from, their format, and the global batch;
its own check (``check_data_section``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from raytrain_ext.errors import ConfigError
from raytrain_ext.storage.s3_errors import endpoint_problem
from raytrain_ext.typed_config.choice import Choice
from raytrain_ext.typed_config.fields import at_least, positive


class DataFormat(Choice):
    """``data.format``: pre-tokenized ids (a ``tokens`` column), plain text documents packed into
    ``seq_len`` windows, chat or prompt/response examples (loss on responses only), or (prompt,
    chosen, rejected) preference records, or prompts to generate completions from (GRPO: a
    ``prompt`` or chat ``messages`` column, every other column passed to the rewards)."""

    tokens = "tokens"
    text = "text"
    chat = "chat"
    preference = "preference"
    prompts = "prompts"


class RayDatasetInput(Choice):
    """``data.ray_dataset``: how ``Trainer(cfg, dataset=ray.data.Dataset)`` reads it.
    ``stream``: a reader actor streams each step's global batch to the ranks (nothing written,
    no shared filesystem, memory bounded; :mod:`raytrain_ext.data.stream_input`).
    ``materialise``: the whole dataset written once into the run directory and read by
    random access (every worker must see that directory).  ``auto``: stream, unless the run
    needs every sample up front (DPO's reference log-probs, ``eval.fraction``'s split)."""

    auto = "auto"
    stream = "stream"
    materialise = "materialise"


@dataclass
class DataConfig:
    """Token source and the global batch.

    ``path`` is ``builtin:corpus`` (ships with the package), a local Arrow IPC
    or Parquet file or directory, or an ``s3://bucket/prefix`` URI.  Each step
    consumes exactly ``global_batch_size`` samples of the global order whatever
    the world size; ``micro_batch_size`` is what one rank runs per forward.
    """

    path: str = "builtin:corpus"
    global_batch_size: int = positive(16)
    micro_batch_size: int = positive(4)
    shuffle: bool = True
    seed: int = at_least(0, "${run.seed}")
    s3_endpoint_url: Optional[str] = None
    s3_region: Optional[str] = None
    # a dataset of fewer samples than one global batch is refused unless this is true
    # (each batch would then hold some samples more than once)
    allow_repeat: bool = False
    # tokens: ids in a ``tokens`` column (or a prepared directory); text/chat/preference:
    # raw records (tokenized at start, cached in the run directory) or a prepared directory
    format: DataFormat = DataFormat.tokens
    # a Hugging Face tokenizer directory or a tokenizer.json; null: the model directory's
    # (model.source=hf) or, for a prepared directory, the one recorded in its index
    tokenizer: Optional[str] = None
    # the tokenizer's end-of-text token, when it names none (a bare tokenizer.json) or
    # another one should end documents; null: its own EOS, else </s>, <|endoftext|>, <eos>
    eos_token: Optional[str] = None
    text_column: str = "text"  # format text: the column holding each document
    # format text: attention and loss never cross a document boundary (the EOS separators)
    document_mask: bool = False
    # an evaluation split: a path like data.path (same format), or null with eval.fraction
    eval_path: Optional[str] = None
    # assemble the next micro-batches on a background thread while the current one runs
    # (the same batches either way: it only hides the reading time)
    prefetch: bool = True
    # Trainer(dataset=ray.data.Dataset): stream it (auto: unless DPO or eval.fraction needs
    # every sample up front) or materialise it into the run directory
    ray_dataset: RayDatasetInput = RayDatasetInput.auto
    # a streamed dataset, with data.shuffle: samples pass a seeded shuffle buffer this long
    # (the order is still world-size independent; memory grows with it)
    stream_shuffle_window: int = at_least(0, 1024)
    # a streamed dataset: how long a rank waits for a step from the reader (a lost reader
    # is restarted by Ray and reads the dataset again up to the position within it)
    stream_timeout_s: float = positive(600.0)
    # a streamed dataset: steps a rank fetches from the reader at once (one round trip),
    # and so what the reader holds ahead of the ranks
    stream_ahead_steps: int = positive(16)


def check_data_section(d: DataConfig) -> None:
    """The ``data`` section's own settings (the batch's arithmetic spans sections: validate)."""
    problem = endpoint_problem(d.s3_endpoint_url, "data.s3_endpoint_url")
    if problem:
        raise ConfigError(problem)
