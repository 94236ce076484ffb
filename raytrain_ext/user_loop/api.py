"""The functions a ``train_loop_per_worker`` calls (Ray Train's names and semantics)."""

from __future__ import annotations

from typing import Any, Dict, Optional

from raytrain_ext.user_loop.checkpoint import Checkpoint
from raytrain_ext.user_loop.session import TrainContext, current_session


def report(
    metrics: Dict[str, Any],
    checkpoint: Optional[Checkpoint] = None,
    checkpoint_dir_name: Optional[str] = None,
) -> None:
    """Report ``metrics`` (every rank, the same number of times; rank 0's are recorded),
    with this rank's ``checkpoint`` directory if it has one.  Returns once the directory
    is staged (hard links); it is persisted to storage in the background.  ``checkpoint_dir_name`` is
    refused: checkpoints are named ``checkpoint_<report index>``."""
    if checkpoint_dir_name is not None:
        raise ValueError(
            "report(checkpoint_dir_name=...) is not supported by raytrain_ext.train: "
            "checkpoints are named checkpoint_<report index>; put your own name in metrics"
        )
    current_session("report").report(metrics, checkpoint)


def get_checkpoint() -> Optional[Checkpoint]:
    """The checkpoint to resume from: the newest committed one when this group started
    (after a failure, a resize or a rerun), else ``resume_from_checkpoint``, else None."""
    return current_session("get_checkpoint").get_checkpoint()


def register(*, copy_to_peer: bool = False, **objects: Any) -> int:
    """Hand the loop's state to the framework (not in Ray Train): ``register(model=model,
    optimizer=optimizer, lr_scheduler=..., progress={"epoch": 0, ...})``, every value a
    module (DDP-wrapped or not), anything with ``state_dict``/``load_state_dict``, or a dict
    of plain values that the loop updates before each report.  Call it on every rank once
    per group, after building them and before the first report; returns the number of
    reports already made, where the loop goes on.

    Each rank then keeps a copy of their state at every report, and a group re-formed after
    a failure or a resize loads the newest copy a live process holds into them (nothing
    redone but the interval the failure struck in) instead of resuming from the newest
    checkpoint.  Replicated state (DDP, one rank) loads at any world size; state sharded
    by FSDP or HSDP (one mesh) loads into a group of any size when a live process holds
    every shard (HSDP: another replica's rank; with ``copy_to_peer=True``, which sends each
    rank's copy to a rank on another node at every report, also pure FSDP's, and keeps the
    previous report's copies too, so a failure during a report's exchange costs one report),
    else the group resumes from the checkpoint.  Every report that carries a checkpoint (on any rank)
    also holds their state as DCP files, which ``register`` loads, resharded to this
    group's layout, when the group starts from that checkpoint instead of live copies (a
    run restarted from storage, ``resume_from_checkpoint``, a part whose every holder was
    lost): the loop needs no save or load code of its own for what it registered."""
    return current_session("register").register(objects, copy_to_peer)


def get_context() -> TrainContext:
    return current_session("get_context").context


def get_dataset_shard(name: str) -> Any:
    """This rank's shard of ``TorchTrainer(datasets={name: ...})``, with Ray Data's
    ``DataIterator`` methods (``iter_batches``, ``iter_torch_batches``, ``iter_rows``) and
    the rows per rank of Ray Train's ``streaming_split(equal=True)``; unlike it, a re-formed
    group or a restarted run resumes each dataset where the checkpoint it resumes from left
    it (``user_loop.dataset_shard``)."""
    return current_session("get_dataset_shard").get_dataset_shard(name)
