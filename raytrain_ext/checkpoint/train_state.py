"""What a checkpoint saves and a restore installs, named explicitly.

The checkpoint code works on a ``TrainState``, never on the training loop: the loop
builds one once its components exist and hands it to the checkpoint manager.  The
components are the loop's own objects (shared, not copied), so a restore changes the
loop's model, optimizer, scheduler, sampler and ledger in place; ``progress`` is where
training stands (the loop reads and advances it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Optional, Protocol, Set

if TYPE_CHECKING:
    import torch

    from raytrain_ext.data.sampler import GlobalOrder
    from raytrain_ext.parallel.strategy import DistContext, Strategy
    from raytrain_ext.train.ledger import SampleLedger
    from raytrain_ext.train.reference import ReferenceLogps


@dataclass
class Progress:
    """Where training stands; saved with every checkpoint and restored with it.

    ``skip_steps``: batches a rollback decided to skip (they outlive a restore);
    ``nonfinite_steps``: how many non-finite steps the guards have seen so far.
    """

    step: int = 0
    skip_steps: Set[int] = field(default_factory=set)
    nonfinite_steps: int = 0


@dataclass
class TrainState:
    """Everything that must survive a restart, and where this rank sits (``ctx``)."""

    strategy: "Strategy"
    model: "torch.nn.Module"
    optimizer: "torch.optim.Optimizer"
    scheduler: "torch.optim.lr_scheduler.LRScheduler"
    sampler: "GlobalOrder"
    ledger: "SampleLedger"
    ctx: "DistContext"
    config_digest: str
    progress: Progress
    reference: Optional["ReferenceLogps"] = None  # DPO: the reference log-probs
    rollout: Optional["CarriedRollouts"] = None  # GRPO: generations made with older weights


class CarriedRollouts(Protocol):
    """What a GRPO checkpoint carries of the rollouts, as plain values
    (:class:`raytrain_ext.rollout.step_input.RolloutInput`)."""

    def carried(self, step: int, next_only: bool) -> Dict[str, Any]:
        """The results of the generations after ``step`` made with weights older than
        ``step``'s, the same on every rank; ``next_only``: only the one the next step
        trains on."""
        ...

    def load_carried(self, plain: Dict[str, Any]) -> None:
        """Take a restored checkpoint's ``carried`` (empty: none)."""
        ...
