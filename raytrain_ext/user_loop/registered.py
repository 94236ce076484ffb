"""A user loop's registered state: ``raytrain_ext.train.register(model=..., optimizer=...)``.

Why: without it, a user loop's re-formed group resumes from its newest committed
checkpoint and redoes every report since.  With it, each rank keeps a copy of the
registered objects' state as of its last report (host memory, the buffers reused from
report to report), and a re-formed group starts at the newest report a live process
holds: that process broadcasts its copy, every rank loads it into the objects its
function built again, and ``register`` returns the number of reports already made, where
the loop goes on.  Only the interval in which the failure struck is redone, as a step is
in the built-in loop, and a group can pause to grow at any report, not only at one that
carries a checkpoint.

Invariants: a copy is taken only once every rank agreed on its report, and registered
state is replicated (DDP, or one rank), so all copies of one report are equal and any
holder may send it.  A group starts from a copy only when it is at least as new as the
newest committed checkpoint (:func:`live_start`), and only copies of the same run count.
What a copy holds never aliases the live objects: it is copied out at the report and
copied in at the restore.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from raytrain_ext.checkpoint.state import snapshot
from raytrain_ext.parallel.tree_broadcast import broadcast_tree, map_leaves

Positions = Dict[str, Tuple[int, int]]  # each dataset shard's (epoch, row)
Offer = Tuple[int, Positions]  # (report index of this process's copy or -1, positions)


@dataclass
class Snapshot:
    """This process's copy of the registered state at report ``index`` of run ``run``."""

    run: str
    index: int
    positions: Positions
    state: Dict[str, Any]


@dataclass(frozen=True)
class LiveResume:
    """A group's start from a live copy: its report index, the rank that sends it and the
    dataset positions of that report."""

    index: int
    holder: int
    positions: Positions


def _unwrapped(obj: Any) -> Any:
    """A DDP-wrapped module's own module: its state has the same keys at any world size
    (``prepare_model`` wraps only when the group has more than one rank)."""
    return obj.module if isinstance(obj, nn.parallel.DistributedDataParallel) else obj


def check_registrable(objects: Dict[str, Any]) -> None:
    """Each value must carry a state: a module, an optimizer, a scheduler (anything with
    ``state_dict``/``load_state_dict``) or a dict of plain values (restored in place)."""
    if not objects:
        raise ValueError(
            "register() needs the objects to keep, by name: register(model=model, "
            "optimizer=optimizer[, lr_scheduler=..., progress={'epoch': 0}])"
        )
    for name, obj in objects.items():
        if not isinstance(obj, (Stateful, dict)):
            raise TypeError(
                f"register({name}=...): a {type(obj).__name__} has no state_dict() and "
                "load_state_dict(); pass a module, an optimizer, a scheduler or a dict of "
                "plain values (numbers, strings, lists) updated in place"
            )


def state_of(objects: Dict[str, Any]) -> Dict[str, Any]:
    """The objects' states (references into the live objects, not copies)."""
    out: Dict[str, Any] = {}
    for name, obj in objects.items():
        out[name] = dict(obj) if isinstance(obj, dict) else _unwrapped(obj).state_dict()
        if any_dtensor(out[name]):
            raise ValueError(
                f"register({name}=...): its state is sharded (DTensor: FSDP or TP); "
                "register keeps replicated state (DDP, or a single rank). Save sharded "
                "state with report(checkpoint=...) and resume it from get_checkpoint()"
            )
    return out


def any_dtensor(value: Any) -> bool:
    found: List[bool] = []
    map_leaves(value, lambda v: found.append(True) if isinstance(v, DTensor) else None)
    return bool(found)


def install(objects: Dict[str, Any], state: Dict[str, Any]) -> None:
    """Load ``state`` (a copy: each tensor is copied again, so the copy stays this
    process's own) into the freshly built objects; the same names must be registered."""
    if set(state) != set(objects):
        raise ValueError(
            f"register(): this group registered {sorted(objects)}, the state it resumes "
            f"holds {sorted(state)}; register the same objects, by the same names, in "
            "every group of the run"
        )
    for name, obj in objects.items():
        value = snapshot(state[name])
        if isinstance(obj, dict):
            obj.clear()
            obj.update(value)
        elif isinstance(_unwrapped(obj), nn.Module):
            with torch.no_grad():
                _unwrapped(obj).load_state_dict(value)
        else:
            obj.load_state_dict(value)


def live_start(offers: List[Offer], committed: int) -> Optional[LiveResume]:
    """Where a group starts when a live process holds a copy: the newest one, sent by its
    lowest rank, when it is at least as new as the newest committed checkpoint
    (``committed``, 0 for none); None to start from that checkpoint.  Pure, and the same
    on every rank."""
    newest = max((index for index, _ in offers), default=-1)
    if newest <= 0 or newest < committed:
        return None
    holder = min(rank for rank, (index, _) in enumerate(offers) if index == newest)
    return LiveResume(newest, holder, dict(offers[holder][1]))


@dataclass
class SnapshotKeeper:
    """This process's newest copy, kept across its groups (they come and go; the process
    and this keeper stay)."""

    latest: Optional[Snapshot] = None

    def offer(self, run: str) -> Offer:
        """(report index, positions) of this run's copy; (-1, {}) when there is none."""
        if self.latest is None or self.latest.run != run:
            return -1, {}
        return self.latest.index, dict(self.latest.positions)

    def take(self, run: str, index: int, positions: Positions, objects: Dict[str, Any]) -> None:
        """Copy the registered objects' state at report ``index`` (its buffers reused)."""
        reuse = self.latest.state if self.latest is not None and self.latest.run == run else None
        live = state_of(objects)
        state = snapshot(live, reuse)
        if any(t.device.type == "cuda" for t in _tensors(live)):
            torch.cuda.synchronize()  # the copies above were queued; a restore reads them
        self.latest = Snapshot(run, index, dict(positions), state)

    def resume(
        self, run: str, start: LiveResume, objects: Dict[str, Any], group: Any
    ) -> Dict[str, Any]:
        """Every rank of ``group`` together: the holder sends its copy, every rank loads
        it into ``objects`` and keeps it as its own copy.  Returns the restore record."""
        started = time.perf_counter()
        mine = self.latest.state if dist.get_rank() == start.holder and self.latest else None
        state, moved = broadcast_tree(mine, start.holder, torch.device("cpu"), group)
        sent = time.perf_counter()
        install(objects, state)
        self.latest = Snapshot(run, start.index, dict(start.positions), state)
        return {
            "step": start.index,
            "tier": "peers",
            "source_rank": start.holder,
            "bytes": moved,
            "total_s": time.perf_counter() - started,
            "phases": {"transfer": sent - started, "install": time.perf_counter() - sent},
        }


class Registration:
    """One group's side of ``register``: what its function registered, and where it starts
    (``start``: a live copy, or None to start from ``start_index``'s checkpoint).
    ``resume(start, objects)``: the collective that loads the live copy on every rank."""

    def __init__(
        self,
        run: str,
        start_index: int,
        start: Optional[LiveResume],
        keeper: SnapshotKeeper,
        resume: Callable[[LiveResume, Dict[str, Any]], Dict[str, Any]],
    ):
        self.run, self.start_index, self.start = run, start_index, start
        self.keeper, self._resume = keeper, resume
        self.objects: Optional[Dict[str, Any]] = None
        self.restored: Optional[Dict[str, Any]] = None  # the live copy's restore record
        self.copy_s: List[float] = []  # what each report's copy took

    @property
    def registered(self) -> bool:
        return self.objects is not None

    def register(self, objects: Dict[str, Any]) -> int:
        """Keep ``objects`` from now on; load the live copy the group starts from into them
        (every rank calls it at the same point of its function).  Returns the number of
        reports already made."""
        if self.objects is not None:
            raise RuntimeError(
                "register() was called twice in this group; call it once, after building "
                "the model and the optimizer and before the first report"
            )
        check_registrable(objects)
        if self.start is not None:
            self.restored = self._resume(self.start, objects)
        self.objects = dict(objects)
        return self.start_index

    def check_registered(self, what: str) -> None:
        """A group that starts from a live copy needs it loaded before it reports: its
        index counts the copy's reports."""
        if self.start is not None and self.objects is None:
            raise RuntimeError(
                f"{what} before register(): this group resumes at report "
                f"{self.start.index} from the state an earlier group registered; call "
                "raytrain_ext.train.register(...) with the same objects before the first "
                "report, in every group"
            )

    def at_report(self, index: int, positions: Dict[str, List[int]]) -> None:
        """The report was agreed by every rank (``positions``: each dataset's [epoch, row]
        there): keep a copy of the registered state."""
        if self.objects is not None:
            started = time.perf_counter()
            at = {name: (int(epoch), int(row)) for name, (epoch, row) in positions.items()}
            self.keeper.take(self.run, index, at, self.objects)
            self.copy_s.append(time.perf_counter() - started)


def _tensors(value: Any) -> List[torch.Tensor]:
    found: List[torch.Tensor] = []
    map_leaves(value, lambda v: found.append(v) if isinstance(v, torch.Tensor) else None)
    return found


_KEEPER = SnapshotKeeper()


def process_snapshots() -> SnapshotKeeper:
    """The keeper of this process (one per worker process, as ``process_uploader``)."""
    return _KEEPER
