"""``Trainer(cfg, dataset=ray.data.Dataset)`` streamed: the reader actor, started by ``fit``.

``fit`` starts one :class:`StreamReaderActor` per run (named after the run, no CPU of its
own, restarted by Ray wherever it can be when it or its node is lost) and points
``data.path`` at it (``ray-stream://<name>``); the ranks ask it for each step's global
batch by number (:mod:`raytrain_ext.data.stream_client`).  Nothing of the dataset is
written anywhere (no shared filesystem is needed for it; a ``data.eval_path`` of raw records
is still prepared into each node's run directory), and no process holds more than a few
steps of it (:mod:`raytrain_ext.data.stream_reader`).

A restarted reader holds nothing: asked for step ``s``, it reads the dataset again from the
start to ``s``, hashing what it passes, so the rank's fingerprint of the position still
detects a dataset that changed.  It re-reads rather than skipping files or blocks because
a Ray Data pipeline gives no way to start mid-dataset that keeps the order exact (its
operators may merge or split blocks); the bench measures what that costs.

Ray Data's read and map tasks run where Ray puts them and need their CPUs: a cluster whose
CPUs the trainers hold entirely starves them (give the dataset's reads ``num_cpus=0`` or
leave a CPU free).
"""

from __future__ import annotations

import copy
import logging
import threading
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pyarrow as pa
from omegaconf import DictConfig, OmegaConf

from raytrain_ext.data.config import DataFormat, RayDatasetInput
from raytrain_ext.data.reader_actor import start_reader
from raytrain_ext.data.stream_reader import StepBatch, StreamReader
from raytrain_ext.data.stream_samples import SamplePacker, Tokenizing
from raytrain_ext.errors import ConfigError, InputError

SCHEME = "ray-stream://"


def is_stream(path: Optional[str]) -> bool:
    return bool(path) and str(path).startswith(SCHEME)


def reader_name(path: str) -> str:
    return path[len(SCHEME) :]


def streams(cfg) -> bool:
    """Whether ``fit`` streams its Ray dataset (``data.ray_dataset``); ConfigError for a
    stream the run cannot read (it needs every sample up front)."""
    needs_all = _needs_every_sample(cfg)
    if cfg.data.ray_dataset == RayDatasetInput.auto:  # a run materialised before stays so
        return needs_all is None and not _materialised_before(cfg)
    if cfg.data.ray_dataset == RayDatasetInput.stream and needs_all is not None:
        raise ConfigError(
            f"data.ray_dataset=stream: {needs_all} needs every sample before the first step, "
            "which a stream does not have. Set data.ray_dataset=materialise (or auto)."
        )
    return cfg.data.ray_dataset == RayDatasetInput.stream


def _materialised_before(cfg) -> bool:
    from pathlib import Path

    from raytrain_ext.data.ray_input import CURRENT, VIEW_DIR

    view = Path(cfg.run.output_dir) / cfg.run.name / VIEW_DIR / CURRENT
    return cfg.checkpoint.resume != "never" and view.is_file()


def _needs_every_sample(cfg) -> Optional[str]:
    if str(cfg.objective.name) == "dpo":
        return "objective.name=dpo (its reference log-probs of every sample)"
    if cfg.eval.fraction > 0 and not cfg.data.eval_path:
        return "eval.fraction (a held-out split of the last samples)"
    return None


@dataclass(frozen=True)
class StreamSpec:
    """What the reader needs from the config (picklable, no OmegaConf)."""

    fmt: str
    seq_len: int
    global_batch_size: int
    vocab_size: int
    seed: int
    shuffle_window: int
    tokenizer: Optional[str]
    eos_token: Optional[str]
    text_column: str
    document_mask: bool
    allow_repeat: bool

    @classmethod
    def of(cls, cfg) -> "StreamSpec":
        from raytrain_ext.data.open import tokenizer_spec

        d = cfg.data
        fmt = DataFormat(d.format)
        return cls(
            fmt=str(fmt),
            seq_len=int(cfg.model.seq_len),
            global_batch_size=int(d.global_batch_size),
            vocab_size=int(cfg.model.vocab_size),
            seed=int(d.seed),
            shuffle_window=int(d.stream_shuffle_window) if d.shuffle else 0,
            tokenizer=None if fmt == DataFormat.tokens else tokenizer_spec(cfg),
            eos_token=d.eos_token,
            text_column=d.text_column,
            document_mask=bool(d.document_mask) and fmt == DataFormat.text,
            allow_repeat=bool(d.allow_repeat),
        )


class StreamReaderActor:
    """The run's reader, as a Ray actor (threaded: ranks ask concurrently)."""

    def __init__(self, dataset: Any, spec: StreamSpec):
        """A constructor that raised would leave a dead actor (Ray restarts only a lost one)
        and ranks waiting for it: its error is kept and raised to every ask instead."""
        logging.getLogger("ray.data").setLevel(logging.ERROR)
        self.error: Optional[InputError] = None
        try:
            self.reader = self._reader(dataset, spec)
        except Exception as e:
            self.error = (
                e
                if isinstance(e, InputError)
                else InputError(
                    f"Trainer(dataset=...): the stream reader cannot start: {type(e).__name__}: {e}"
                )
            )
            return
        # read the first step while the ranks start (an error waits for their first ask)
        threading.Thread(target=self._warm, daemon=True, name="stream-warm").start()

    @staticmethod
    def _reader(dataset: Any, spec: StreamSpec) -> StreamReader:
        tokenizing = _tokenizing(spec)
        eos = tokenizing.eos_id if tokenizing is not None and spec.document_mask else None
        fmt = DataFormat(spec.fmt)

        def make_packer() -> SamplePacker:
            return SamplePacker(fmt, spec.seq_len, tokenizing, spec.text_column, eos)

        return StreamReader(
            ray_epoch_batches(dataset),
            make_packer,
            spec.global_batch_size,
            spec.vocab_size,
            spec.seed,
            spec.shuffle_window,
            eos,
            spec.allow_repeat,
        )

    def _warm(self) -> None:
        try:
            self.reader.warm()
        except Exception:
            pass  # raised again to the ranks' first ask

    def take(
        self, first: int, count: int = 1, part: Optional[Tuple[int, int]] = None
    ) -> List[StepBatch]:
        if self.error is not None:
            raise self.error
        return self.reader.take(first, count, part)

    def stats(self) -> Dict[str, Any]:
        """What it did, and where it runs (a test kills it there)."""
        import os

        import ray

        if self.error is not None:
            raise self.error
        return {
            **asdict(self.reader.stats),
            "held_steps": self.reader.held_steps(),
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
        }


def _tokenizing(spec: StreamSpec) -> Optional[Tokenizing]:
    if spec.tokenizer is None:
        return None
    from raytrain_ext.prepare.tokenizer import load_tokenizer, tokenizer_info

    tok = load_tokenizer(spec.tokenizer, spec.eos_token)
    info = tokenizer_info(tok, spec.tokenizer)
    return Tokenizing(tok, info.eos_id, info.pad_id)


def ray_epoch_batches(dataset: Any):
    """Epoch ``e``'s record batches: the dataset's blocks in its own order, executed again
    for every epoch (Ray Data streams them; ``preserve_order`` keeps the order exact)."""
    import ray

    def batches(epoch: int) -> Iterator[pa.Table]:
        for context in (dataset.context, ray.data.DataContext.get_current()):
            context.execution_options.preserve_order = True
            context.enable_progress_bars = False
            context.print_on_execution_start = False
        yield from dataset.iter_batches(batch_size=None, batch_format="pyarrow")

    return batches


def start_stream_reader(cfg, dataset: Any) -> Tuple[Any, Any]:
    """Start the run's reader (``data.path`` names it): (its handle, for ``fit`` to kill;
    the dataset's reference, which ``fit`` holds until then; ``reader_actor``)."""
    return start_reader(StreamReaderActor, reader_name(cfg.data.path), dataset, StreamSpec.of(cfg))


def stream_config(cfg: DictConfig) -> DictConfig:
    """``cfg`` with ``data.path`` naming the run's reader; InputError for records that need
    a tokenizer the config does not name."""
    spec = StreamSpec.of(cfg)
    if spec.fmt != DataFormat.tokens and spec.tokenizer is None:
        raise InputError(
            f"data.tokenizer: Trainer(dataset=...) with data.format={spec.fmt} needs a "
            "tokenizer; set data.tokenizer."
        )
    cfg = copy.deepcopy(cfg)
    OmegaConf.set_readonly(cfg, False)
    cfg.data.path = f"{SCHEME}raytrain_ext.stream.{cfg.run.name}"
    OmegaConf.set_readonly(cfg, True)
    return cfg
