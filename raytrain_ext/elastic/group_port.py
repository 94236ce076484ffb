"""The worker group as the controller drives it: an interface without Ray in it.

The controller never handles a Ray future: starting ``fit`` on every rank,
waiting on it, polling heartbeats and per-step records, and asking ranks to
checkpoint all go through ``GroupPort``.  ``ray_group.port.RayGroup`` implements it
over ``worker.group.WorkerGroup``; the controller's unit tests step the state
machine with a fake.  Ranks are the group's current ranks: every ``start`` and
``reform`` renumbers them, and ``infos[rank]`` names each rank's node and process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Protocol, Sequence, Set, Tuple

from omegaconf import DictConfig

from raytrain_ext.elastic.decision import Evidence
from raytrain_ext.elastic.in_place import InPlacePlan
from raytrain_ext.messages import FitResult, Heartbeat, PollReply, RankInfo
from raytrain_ext.worker.form_options import FormOptions


@dataclass(frozen=True)
class FitStatus:
    """One wait on the ranks' ``fit`` calls.  ``error``: (rank, error) where a failure
    started, when a rank raised; ``finished``: every rank has returned; ``returned``
    (given when the failed rank's process or node was lost): the results of the ranks
    whose ``fit`` had returned, by rank."""

    finished: bool
    error: Optional[Tuple[int, BaseException]] = None
    returned: Dict[int, FitResult] = field(default_factory=dict)


class GroupPort(Protocol):
    @property
    def avoid_nodes(self) -> Set[str]:
        """Node ids the next ``start`` must not use (the controller adds to this set)."""
        ...

    @property
    def backend(self) -> Optional[str]:
        """The formed process group's backend (gloo, nccl)."""
        ...

    @property
    def infos(self) -> List[RankInfo]:
        """Per rank: where its process runs."""
        ...

    @property
    def world_size(self) -> int: ...

    @property
    def start_marks(self) -> Dict[str, float]:
        """When the group now formed was placed and formed, and when rank 0's process
        started, began its actor and finished its imports (``metrics.start_phases``)."""
        ...

    def start(self, num_workers: int, form: FormOptions, *, spares: int) -> None:
        """Place and form a new group (raises when it cannot be placed or formed)."""
        ...

    def reform(self, plan: InPlacePlan, form: FormOptions) -> Dict[str, int]:
        """Re-form with ``plan.size`` ranks keeping ``plan.keep``'s processes, lost ranks'
        places taken by ready spares, then by new processes in ``plan.refill``'s slots (the
        rest left out; ``plan.deferred``'s slots get spares that join later); how the
        places were filled."""
        ...

    def start_fit(self, cfg: DictConfig, attempt: int) -> None:
        """Start ``fit`` on every rank with the run's read-only ``cfg``; ``attempt`` counts
        re-forms."""
        ...

    def wait_fit(self, timeout_s: float) -> FitStatus:
        """Wait up to ``timeout_s`` for the ``fit`` calls not finished yet."""
        ...

    def fit_results(self) -> List[FitResult]:
        """Every rank's ``fit`` result, in rank order, once all have finished."""
        ...

    def heartbeats(self, timeout_s: float) -> Dict[int, Heartbeat]:
        """rank -> its last step and phase; a rank that does not answer is left out."""
        ...

    def poll(self, ranks: Sequence[int], timeout_s: float) -> Dict[int, PollReply]:
        """rank -> its last step and the reports not taken yet; one that does not answer
        (or no longer exists) is left out."""
        ...

    def preempt(self, ranks: Sequence[int], grace_s: float) -> None:
        """Ask ``ranks`` to checkpoint within ``grace_s`` and stop (``fit`` then returns)."""
        ...

    def request_checkpoint(self) -> None: ...

    def gather_evidence(
        self, hung_ranks: List[int], wait_s: float, evidence_s: float
    ) -> Optional[Evidence]:
        """After a failure: kill ``hung_ranks``, take the others out of their collectives,
        and report which processes came out healthy and Ray's verdict on the rest (the
        controller decides, ``decision.decide_recovery``); None when nothing ran."""
        ...

    def ready_spare_count(self) -> int:
        """Warm spares ready to take a place now."""
        ...

    def pause(self) -> None:
        """Ask every rank to stop at the next step boundary, keeping its state in memory."""
        ...

    def replenish(self, spares: int) -> None:
        """Refill what a recovery used up, off its path: spares up to ``spares``, and the
        idle warmed processes a new rank would take."""
        ...

    def dump_stacks(self, out: Path, attempt: int) -> None:
        """Every rank's Python stacks into files under ``out``."""
        ...

    def shutdown(self) -> None:
        """Stop every process of the group; safe to call more than once."""
        ...
