"""``Trainer(cfg, dataset=ray.data.Dataset)`` materialised: the dataset written once into the
run directory and read by random access.  Chosen by ``data.ray_dataset=materialise``, or by
``auto`` when the run needs every sample before its first step (DPO's reference log-probs,
``eval.fraction``'s split); otherwise the dataset is streamed
(:mod:`raytrain_ext.data.stream_input`).

Exactly-once under kills and resizes needs random access by sample index (the global
sampler decides the order; any rank may need any sample after a resize), and a Ray
Data stream has no exact mid-epoch resume.  So ``fit`` materialises the dataset once,
on the driver, in the dataset's own order (``preserve_order``), into the run
directory, and trains on that view through the usual sampler:

- a ``tokens`` column of id lists (``data.format: tokens``) is concatenated into one
  token stream; text, chat and preference columns are tokenized and packed exactly as
  ``data prepare`` does;
- the view is named by the SHA-256 of its content.  A later ``fit`` of the same run
  (a resume) whose dataset yields different content is refused: the checkpoints' sample
  order would silently point at other records.

What the dataset must guarantee: it is finite and deterministic (the same rows in the
same order on every execution, e.g. no unseeded ``random_shuffle``), and it fits on
the driver's disk.  The run directory must be reachable by every worker (one machine,
or a shared ``run.output_dir``).
"""

from __future__ import annotations

import copy
import hashlib
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
from omegaconf import DictConfig, OmegaConf

from raytrain_ext.data.config import DataFormat
from raytrain_ext.data.corpus import write_token_file
from raytrain_ext.data.stream_samples import token_id_array
from raytrain_ext.errors import InputError
from raytrain_ext.prepare.prepared_index import read_index

VIEW_DIR = "ray-dataset"
CURRENT = "CURRENT"


def materialise_dataset(cfg: DictConfig, dataset, run_dir: Path) -> DictConfig:
    """Write the dataset's view (once per content) and point ``data.path`` at it."""
    table = dataset_table(dataset)
    if table.num_rows == 0:
        raise InputError("Trainer(dataset=...): the Ray dataset has no rows")
    digest = table_digest(table)
    root = Path(run_dir) / VIEW_DIR
    _check_same_content(root, digest, cfg)
    view = root / digest[:16]
    if cfg.data.format == DataFormat.tokens:
        _write_tokens(table, view)
    elif read_index(view) is None:
        from raytrain_ext.data.open import tokenizer_spec
        from raytrain_ext.prepare.pipeline import prepare_dataset

        spec = tokenizer_spec(cfg)
        if spec is None:
            raise InputError(
                f"data.tokenizer: Trainer(dataset=...) with data.format={cfg.data.format} "
                "needs a tokenizer; set data.tokenizer."
            )
        prepare_dataset(table, spec, view, str(cfg.data.format), text_column=cfg.data.text_column)
    (root / CURRENT).write_text(digest + "\n")
    cfg = copy.deepcopy(cfg)
    OmegaConf.set_readonly(cfg, False)
    cfg.data.path = str(view)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def dataset_table(dataset) -> pa.Table:
    """Every row of the dataset, in its order, as one Arrow table (on the driver)."""
    import ray

    context = ray.data.DataContext.get_current()
    keep = context.execution_options.preserve_order
    context.execution_options.preserve_order = True
    try:
        tables = ray.get(list(dataset.to_arrow_refs()))
    finally:
        context.execution_options.preserve_order = keep
    tables = [t for t in tables if t.num_rows]
    if not tables:
        return pa.table({})
    return pa.concat_tables(tables, promote_options="default").combine_chunks()


def table_digest(table: pa.Table) -> str:
    """SHA-256 of the table's content (schema and rows, as an Arrow IPC stream)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return hashlib.sha256(sink.getvalue()).hexdigest()


def _check_same_content(root: Path, digest: str, cfg) -> None:
    current = root / CURRENT
    if cfg.checkpoint.resume == "never" or not current.is_file():
        return
    previous = current.read_text().strip()
    if previous != digest:
        raise InputError(
            f"Trainer(dataset=...): the dataset's content (sha256 {digest[:16]}) differs from "
            f"the one this run trained on (sha256 {previous[:16]}), so its checkpoints would "
            "resume at other records. Make the dataset deterministic (same rows, same order), "
            "or start a new run.name, or set checkpoint.resume=never."
        )


def _write_tokens(table: pa.Table, view: Path) -> None:
    """A ``tokens`` column of id lists -> one flat token file (what ``data.path`` reads)."""
    column = token_id_array(table)
    path = view / "tokens.arrow"
    if not path.is_file():  # written aside, then renamed: a crash leaves no partial view
        partial = view / ".tokens.arrow.tmp"
        write_token_file(np.asarray(column.to_numpy(zero_copy_only=False)), partial)
        os.replace(partial, path)
