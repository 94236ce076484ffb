"""``data prepare``: the user's records to a prepared directory, here or with Ray Data.

The driver opens and checks the source and the tokenizer, claims the output directory
(prepare_shards.py), then writes every shard not already written, either in this process
(``workers`` None or 0) or as ``workers`` Ray Data tasks (one CPU each), each writing a
contiguous run of the pending shards, each shard read from its own record range of the
source.  ``index.json`` is written last, by the driver.

Invariants:
- the directory's bytes depend on the source, the tokenizer, the format, the text column
  and ``records_per_shard`` only: not on the number of workers, nor on how often the
  preparation was interrupted and resumed;
- with Ray, ``out_dir`` must be a path every node can write: a local path on a one-machine
  cluster, a shared filesystem on a cluster of several machines.  The source must be
  readable from every node too (a shared path or ``s3://``); an in-memory table travels
  with the work.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import pyarrow as pa

from raytrain_ext.errors import InputError
from raytrain_ext.prepare.prepared_index import PreparedIndex, ShardInfo, write_index
from raytrain_ext.prepare.shards import (
    PrepareJob,
    claim_out_dir,
    finished_shard,
    write_shard,
)
from raytrain_ext.prepare.text_sources import check_source
from raytrain_ext.prepare.tokenizer import (
    TOKENIZER_KEY,
    has_chat_template,
    load_tokenizer,
    tokenizer_info,
)

log = logging.getLogger(__name__)
DEFAULT_RECORDS_PER_SHARD = 10_000
DEFAULT_LOG_EVERY_S = 30.0


@dataclass
class Preparation:
    """What a preparation did: its index, the shards it wrote and those it found written."""

    index: PreparedIndex
    written: List[int]
    reused: List[int]
    seconds: float


def prepare_dataset(
    source: Union[str, pa.Table],
    tokenizer_spec: str,
    out_dir: Union[str, Path],
    fmt: str = "text",
    **options,
) -> PreparedIndex:
    """Tokenize ``source`` into ``out_dir``; the index.  Options as :func:`run_preparation`."""
    return run_preparation(source, tokenizer_spec, out_dir, fmt, **options).index


def run_preparation(
    source: Union[str, pa.Table],
    tokenizer_spec: str,
    out_dir: Union[str, Path],
    fmt: str = "text",
    *,
    text_column: str = "text",
    records_per_shard: int = DEFAULT_RECORDS_PER_SHARD,
    workers: Optional[int] = None,
    s3_endpoint_url: Optional[str] = None,
    s3_region: Optional[str] = None,
    progress: Optional[bool] = None,
    log_every_s: float = DEFAULT_LOG_EVERY_S,
    eos_token: Optional[str] = None,
) -> Preparation:
    """Prepare ``source`` (a path, an ``s3://`` URI or a ``pyarrow.Table``) as ``fmt``:
    :func:`make_job` then :func:`run_job`."""
    job = make_job(
        source,
        tokenizer_spec,
        out_dir,
        fmt,
        text_column=text_column,
        records_per_shard=records_per_shard,
        s3_endpoint_url=s3_endpoint_url,
        s3_region=s3_region,
        eos_token=eos_token,
    )
    return run_job(job, workers, progress, log_every_s)


def run_job(
    job: PrepareJob,
    workers: Optional[int] = None,
    progress: Optional[bool] = None,
    log_every_s: float = DEFAULT_LOG_EVERY_S,
) -> Preparation:
    """Write every shard ``job.out_dir`` lacks, then the index.

    ``workers``: None or 0 writes in this process; N >= 1 runs up to N Ray Data tasks on the
    Ray this process is connected to (``ray.init`` first).  ``progress``: a tqdm bar
    (True), a log line every ``log_every_s`` seconds (False), or a bar on a terminal
    only (None)."""
    started = time.monotonic()
    check_workers(workers)
    done = claim_out_dir(job)
    if done is not None:
        log.info("data prepare: %s already holds this preparation", job.out_dir)
        return Preparation(done, [], list(range(job.num_shards)), time.monotonic() - started)
    shards = {k: finished_shard(job, k) for k in range(job.num_shards)}
    reused = [k for k, info in shards.items() if info is not None]
    pending = [k for k, info in shards.items() if info is None]
    report = ProgressReport(job.num_shards, len(reused), progress, log_every_s)
    try:
        if workers:
            results = _write_with_ray(job, pending, workers)
        else:
            results = ((k, write_shard(job, k)) for k in pending)
        for shard, info in results:
            shards[shard] = info
            report.update(info)
    finally:
        report.close()
    written = [shard_info for k in range(job.num_shards) if (shard_info := shards[k]) is not None]
    if len(written) != job.num_shards:  # every shard was reused or written above
        raise RuntimeError(f"data prepare: {job.num_shards - len(written)} shard(s) missing")
    index = job.index(written)
    write_index(Path(job.out_dir), index)
    return Preparation(index, pending, reused, time.monotonic() - started)


def check_workers(workers: Optional[int]) -> None:
    if workers is not None and workers < 0:
        raise InputError(f"--workers: {workers} must be 0 (this process) or a worker count.")


def make_job(
    source: Union[str, pa.Table],
    tokenizer_spec: str,
    out_dir: Union[str, Path],
    fmt: str = "text",
    *,
    text_column: str = "text",
    records_per_shard: int = DEFAULT_RECORDS_PER_SHARD,
    s3_endpoint_url: Optional[str] = None,
    s3_region: Optional[str] = None,
    eos_token: Optional[str] = None,
) -> PrepareJob:
    """Load the tokenizer and check the source: everything a shard needs, or InputError
    (before anything is written or Ray is needed)."""
    if records_per_shard < 1:
        raise InputError(f"--records-per-shard: {records_per_shard} must be at least 1.")
    tok = load_tokenizer(tokenizer_spec, eos_token)
    local = Path(tokenizer_spec).expanduser()
    info = tokenizer_info(tok, str(local.resolve()) if local.exists() else tokenizer_spec)
    checked, columns = check_source(
        source,
        fmt,
        text_column,
        s3_endpoint_url=s3_endpoint_url,
        s3_region=s3_region,
        stride=records_per_shard,
    )
    if "messages" in columns and not has_chat_template(tok):
        raise InputError(
            f"{TOKENIZER_KEY}: {tokenizer_spec} has no chat template, and {checked.name} "
            "holds 'messages'. Use a tokenizer with a chat_template, or give the records "
            "as prompt/response columns."
        )
    return PrepareJob(
        source=checked,
        columns=columns,
        tok=tok,
        tokenizer=info,
        fmt=fmt,
        text_column=text_column,
        records_per_shard=records_per_shard,
        out_dir=str(Path(out_dir).expanduser().resolve()),
    )


_worker_tokenizer: Dict[str, Any] = {}  # in a Ray worker process: the last one fetched


def write_shard_row(row: Dict[str, Any], job: PrepareJob, tok_ref: List[Any]) -> Dict[str, Any]:
    """A Ray Data task: shard ``row["shard"]`` written, its ShardInfo as the row.

    The tokenizer travels apart from the job, as the ObjectRef in ``tok_ref``, and is
    fetched and unpickled once per worker process, not once per shard (only it is kept:
    an in-memory source table is not pinned by idle workers).  Bad input is returned as
    the row's ``error`` rather than raised: Ray Data would wrap the InputError in its own
    exceptions (as text), and the driver reports it as itself."""
    import ray

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per task
    key = tok_ref[0].hex()
    if key not in _worker_tokenizer:
        _worker_tokenizer.clear()
        _worker_tokenizer[key] = ray.get(tok_ref[0])
    shard = int(row["shard"])
    try:
        # a retried task finds the shards its first try finished
        info = finished_shard(job, shard) or write_shard(
            replace(job, tok=_worker_tokenizer[key]), shard
        )
        error = ""
    except InputError as e:
        info, error = ShardInfo("", 0, 0, ""), str(e)
    return {"shard": shard, "error": error, **asdict(info)}


def _write_with_ray(
    job: PrepareJob, pending: Sequence[int], workers: int
) -> Iterator[Tuple[int, ShardInfo]]:
    import ray

    if not ray.is_initialized():
        raise RuntimeError(
            f"workers={workers} runs on Ray: connect first (ray.init, or "
            "raytrain_ext.ray_session.connect_ray), or pass workers=0 to prepare in this process"
        )
    if not pending:
        return
    context = ray.data.DataContext.get_current()
    saved = (
        context.enable_progress_bars,
        context.print_on_execution_start,
        context.target_max_block_size,
    )
    context.enable_progress_bars, context.print_on_execution_start = False, False
    # every output row its own block: a task streams each finished shard to the driver
    context.target_max_block_size = 1
    ray_data_log = logging.getLogger("ray.data")
    saved_level = ray_data_log.level
    ray_data_log.setLevel(logging.ERROR)  # this module reports progress
    try:
        cpus = int(ray.cluster_resources().get("CPU", 0))
        if workers > cpus:
            raise InputError(
                f"--workers: {workers} workers need a CPU each; the Ray cluster has {cpus}. "
                f"Use --workers {cpus} or fewer, or a bigger cluster."
            )
        # one task per worker, over a contiguous run of shards, not one per shard: Ray
        # Data notices a finished task only every 0.1 s (its executor's wait), which left
        # each worker idle ~0.12 s per shard here (1 s of a 5.6 s preparation)
        items = [{"shard": k} for k in pending]
        blocks = min(len(items), workers)
        rows = ray.data.from_items(items, override_num_blocks=blocks).map(
            write_shard_row,
            # the ref in a list: Ray leaves it unresolved, the task fetches it once
            fn_kwargs={"job": replace(job, tok=None), "tok_ref": [ray.put(job.tok)]},
            compute=ray.data.TaskPoolStrategy(size=workers),
            num_cpus=1,
        )
        for row in rows.iter_rows():
            if row["error"]:
                raise InputError(row["error"])
            info = ShardInfo(row["file"], row["records"], row["tokens"], row["sha256"])
            yield int(row["shard"]), info
    finally:
        (
            context.enable_progress_bars,
            context.print_on_execution_start,
            context.target_max_block_size,
        ) = saved
        ray_data_log.setLevel(saved_level)


class ProgressReport:
    """A tqdm bar on a terminal; otherwise a log line every ``every_s`` seconds."""

    def __init__(self, total: int, reused: int, bar: Optional[bool], every_s: float):
        self.total, self.done, self.tokens = total, reused, 0
        self.every_s, self.started = every_s, time.monotonic()
        self.last_line = self.started
        use_bar = sys.stderr.isatty() if bar is None else bar
        self.bar = None
        if use_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=reused, unit="shard", desc="data prepare")

    def update(self, info: ShardInfo) -> None:
        self.done += 1
        self.tokens += info.tokens
        now = time.monotonic()
        rate = self.tokens / max(now - self.started, 1e-9)
        if self.bar is not None:
            self.bar.set_postfix_str(f"{rate:,.0f} tokens/s", refresh=False)
            self.bar.update(1)
        elif now - self.last_line >= self.every_s or self.done == self.total:
            self.last_line = now
            log.info("data prepare: %d/%d shards, %.0f tokens/s", self.done, self.total, rate)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
