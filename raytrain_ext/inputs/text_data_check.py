"""Records and prepared directories, checked on the driver before Ray starts.

For ``data.format`` text, chat or preference (or any prepared directory) the driver
checks the source (:func:`raytrain_ext.prepare.text_sources.check_source`: the path, the
file's real format, the columns, no records), tokenizes raw records into the run's
cache (:func:`raytrain_ext.data.open.prepare_cached`, which the workers then reuse),
and refuses a prepared directory whose format, tokenizer or vocabulary does not fit
the run, or that holds fewer training samples than one global batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from raytrain_ext.data.config import DataFormat
from raytrain_ext.data.eval_split import held_out_samples
from raytrain_ext.data.open import (
    open_prepared,
    prepared_directory,
    tokenizer_files_in_key,
    tokenizer_spec,
)
from raytrain_ext.errors import InputError
from raytrain_ext.models.sources import model_source
from raytrain_ext.prepare.prepared_index import PreparedIndex, read_index, require_index


def uses_records(cfg) -> bool:
    """True when ``data.path`` is read as records or a prepared directory, not token files."""
    d = cfg.data
    if d.format != DataFormat.tokens:
        return True
    local = d.path != "builtin:corpus" and not d.path.startswith("s3://")
    return local and read_index(Path(d.path)) is not None


def check_record_data(cfg) -> None:
    """Raise :class:`InputError` naming the key, the file and the fix."""
    for key in ("data.path", "data.eval_path"):
        path = cfg.data.path if key == "data.path" else cfg.data.eval_path
        if path is None:
            continue
        directory = _prepared(cfg, key, path)
        index = require_index(directory)
        _check_format(cfg, key, path, index)
        if not _prepared_here_with_these_files(cfg, path, directory):
            _check_tokenizer(cfg, key, path, index)
        _check_vocabulary(cfg, key, path, index)
        if key == "data.path":
            _check_samples(cfg, directory)


def _prepared(cfg, key: str, path: str) -> Path:
    local = not path.startswith("s3://")
    if not (local and read_index(Path(path)) is not None):
        from raytrain_ext.prepare.text_sources import check_source

        check_source(
            path,
            str(cfg.data.format),
            cfg.data.text_column,
            s3_endpoint_url=cfg.data.s3_endpoint_url,
            s3_region=cfg.data.s3_region,
        )
    directory = prepared_directory(cfg, path)
    if directory is None:
        raise InputError(f"{key}: {path} is neither records nor a prepared directory.")
    return directory


def _check_format(cfg, key: str, path: str, index: PreparedIndex) -> None:
    wanted = cfg.data.format
    if index.format == wanted or (index.format == DataFormat.text and wanted == DataFormat.tokens):
        return
    raise InputError(
        f"data.format: {key} {path} was prepared as {index.format} data, but "
        f"data.format={wanted}. Set data.format={index.format}, or prepare the records again "
        f"with --format {wanted}."
    )


def _prepared_here_with_these_files(cfg, path: str, directory: Path) -> bool:
    """Whether ``path``'s records were prepared into the run's cache (``directory``, which
    ``prepared_directory`` gave) under a key that covers the tokenizer's files
    (``data.open.tokenizer_files_in_key``): that entry was tokenized by this very tokenizer,
    so loading it again to compare its sha256 (2-4 s on the driver, most of it importing
    ``transformers`` and torch) would only repeat what the key says."""
    if directory == Path(path):
        return False  # a directory prepared elsewhere: its tokenizer is compared
    spec = tokenizer_spec(cfg)
    return spec is not None and tokenizer_files_in_key(spec)


def _check_tokenizer(cfg, key: str, path: str, index: PreparedIndex) -> None:
    from raytrain_ext.prepare.tokenizer import load_tokenizer, tokenizer_sha256

    spec: Optional[str] = tokenizer_spec(cfg)
    if spec is not None:
        sha = tokenizer_sha256(load_tokenizer(spec, cfg.data.eos_token))
        if sha != index.tokenizer.sha256:
            raise InputError(
                f"data.tokenizer: {key} {path} was prepared with the tokenizer "
                f"{index.tokenizer.source} (sha256 {index.tokenizer.sha256[:12]}), but this run "
                f"uses {spec} (sha256 {sha[:12]}); its ids would mean other tokens. Train with "
                "the tokenizer the data was prepared with, or prepare the data again with "
                f"`raytrain-ext data prepare SRC --tokenizer {spec}`."
            )


def _check_vocabulary(cfg, key: str, path: str, index: PreparedIndex) -> None:
    if index.tokenizer.vocab_size > cfg.model.vocab_size:
        raise InputError(
            f"model.vocab_size: {key} {path} was tokenized with a vocabulary of "
            f"{index.tokenizer.vocab_size} ids, but model.vocab_size={cfg.model.vocab_size}. "
            f"Set model.vocab_size >= {index.tokenizer.vocab_size}."
        )


def _check_samples(cfg, directory: Path) -> None:
    d, e = cfg.data, cfg.eval
    samples = open_prepared(directory, cfg.model.seq_len).num_samples
    samples -= held_out_samples(cfg, samples)
    if samples < 1:
        raise InputError(
            f"data.path: {d.path} leaves no training sample (model.seq_len={cfg.model.seq_len}, "
            f"eval.fraction={e.fraction}). Use more data or a smaller eval.fraction."
        )
    if samples < d.global_batch_size and not d.allow_repeat:
        raise InputError(
            f"data.global_batch_size: {d.global_batch_size} is more than the {samples} training "
            f"samples of data.path {d.path}, so every step would repeat samples within its "
            "batch. Use more data, lower data.global_batch_size, or set data.allow_repeat=true "
            "if that is intended."
        )


def check_document_mask(cfg) -> None:
    """``data.document_mask`` needs documents (text data with EOS separators), a model that
    can keep attention within them, and the loop's own forward (not a pipeline's)."""
    d = cfg.data
    if not d.document_mask:
        return
    if d.format != DataFormat.text:
        raise InputError(
            f"data.document_mask: needs data.format=text (documents separated by the "
            f"tokenizer's EOS), not {d.format}; chat and preference examples are already "
            "kept apart by their loss weights."
        )
    source = model_source(cfg.model)
    if not source.per_document_attention:
        raise InputError(
            f"data.document_mask: {source.label} has no per-document attention "
            f"(model.source={source.name}); use "
            "model.source=hf (positions restart per document, attention stays within it) or "
            "a python ModelSpec with document_logits, or set data.document_mask=false."
        )
    if cfg.parallel.pp > 1 or cfg.parallel.sequence_parallel:
        raise InputError(
            f"data.document_mask: not supported with pipeline or sequence parallelism yet "
            f"(parallel.pp={cfg.parallel.pp}, parallel.sequence_parallel="
            f"{cfg.parallel.sequence_parallel}). Set data.document_mask=false, or parallel.pp=1 "
            "and parallel.sequence_parallel=false."
        )


def check_eval_split(cfg) -> None:
    """``eval.every_steps`` needs something to evaluate on, and a model whose forward the
    loop runs whole (not a pipeline's stages)."""
    if cfg.eval.every_steps is None:
        return
    if cfg.parallel.pp > 1:
        raise InputError(
            f"eval.every_steps: evaluation is not supported with pipeline parallelism yet "
            f"(parallel.pp={cfg.parallel.pp}). Set eval.every_steps=null or parallel.pp=1."
        )
    if not cfg.data.eval_path and cfg.eval.fraction == 0:
        raise InputError(
            f"eval.every_steps: set to {cfg.eval.every_steps} but there is nothing to evaluate "
            "on. Set data.eval_path (a path like data.path) or eval.fraction (e.g. 0.05: the "
            "last 5% of the samples are held out of training)."
        )
