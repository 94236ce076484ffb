"""A user loop's registered state: ``raytrain_ext.train.register(model=..., optimizer=...)``.

Why: without it, a user loop's re-formed group resumes from its newest committed
checkpoint and redoes every report since.  With it, each rank keeps a copy of the
registered objects' state as of its last report (host memory, the buffers reused from
report to report), and a re-formed group starts at the newest report live processes
hold: they broadcast their copies, every rank loads its part into the objects its
function built again, and ``register`` returns the number of reports already made, where
the loop goes on.  Only the interval in which the failure struck is redone, as a step is
in the built-in loop, and a group can pause to grow at any report, not only at one that
carries a checkpoint.

Invariants: a copy is taken only once every rank agreed on its report, so all copies of
one report and one part of the state (``registered_state.Layout``: the whole for
replicated state, a shard for FSDP/HSDP) are equal and any holder may send it.  A group
starts from copies only when they are at least as new as the newest committed checkpoint
and hold every part of the whole (:func:`live_start`), and only copies of the same run
count.  Copies of FSDP/HSDP shards restore a group of another size too (a node lost, a
node back): each rank cuts its own new part from the old parts as they arrive
(``user_loop.reshard``), so a shrink or a grow redoes no report as long as each part has
a live holder: HSDP's replicas, or under pure FSDP the peer copy ``copy_to_peer`` sends
at each report (the rank after the same local rank's node; without it a pure FSDP
rank's part dies with it, and the checkpoint has it).  A peer copy is offered with its
layout and report, and only where both match the copies a group starts from.
What a copy holds never aliases the live objects: it is copied out at the report and
copied in at the restore.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from raytrain_ext.checkpoint.state import snapshot
from raytrain_ext.parallel.local_shards import local_view
from raytrain_ext.parallel.tree_broadcast import broadcast_tree, exchange_tree
from raytrain_ext.user_loop.checkpoint import Checkpoint
from raytrain_ext.user_loop.registered_files import RegisteredFiles
from raytrain_ext.user_loop.registered_state import (
    Layout,
    check_registrable,
    install,
    layout_of,
    sharded_leaves,
    state_of,
)
from raytrain_ext.user_loop.reshard import PartJoiner
from raytrain_ext.user_loop.staging import Staged

Positions = Dict[str, Tuple[int, int]]  # each dataset shard's (epoch, row)
# (report index of this process's copy or -1, its positions, its part of the whole)
Offer = Tuple[int, Positions, Optional[Layout]]
# (report index, its layout) of the copy of another rank's part this process holds
# (``register(copy_to_peer=True)``), or None
PeerOffer = Optional[Tuple[int, Layout]]


@dataclass
class Snapshot:
    """This process's copy of the registered state at report ``index`` of run ``run``."""

    run: str
    index: int
    positions: Positions
    layout: Layout
    state: Dict[str, Any]  # local shards, on the host
    sharded: Any  # ``state``'s structure, True at each leaf that is a part of a whole tensor
    reusable: bool = True  # its buffers may take the next copy (a broadcast's may not: views)


@dataclass(frozen=True)
class LiveResume:
    """A group's start from live copies: their report index, the rank that sends each
    part (``sources[i]`` sends part i), the dataset positions of that report and the
    copies' layout (``cut``: a group of another layout joins the parts, then takes its
    own; None for replicated copies, which load anywhere)."""

    index: int
    sources: Tuple[int, ...]
    positions: Positions
    cut: Optional[Layout] = None


def live_start(
    offers: List[Offer], committed: int, world: int, peers: Sequence[PeerOffer] = ()
) -> Optional[LiveResume]:
    """Where a group of ``world`` ranks starts when live processes hold copies: the newest
    report, each part sent by its lowest holder, when it is at least as new as the newest
    committed checkpoint (``committed``, 0 for none) and its copies hold every part of a
    layout that loads into this group or joins into the whole state (``Layout.reshardable``:
    FSDP/HSDP copies restore a group of another size); a part no live rank holds as its
    own may come from a rank that holds a copy of it (``peers``: each rank's
    :data:`PeerOffer`).  None to start from that checkpoint.  Pure, and the same on every
    rank."""
    newest = max((index for index, _, _ in offers), default=-1)
    if newest <= 0 or newest < committed:
        return None
    held = [(rank, layout) for rank, (index, _, layout) in enumerate(offers) if index == newest]
    layouts = [layout for _, layout in held if layout is not None]
    first = layouts[0]
    if not all(first.same_cut(layout) for layout in layouts):
        return None
    if not (first.loads_into(world) or first.reshardable):
        return None
    sources: Dict[int, int] = {}
    for rank, layout in held:
        if layout is not None:
            sources.setdefault(layout.index, rank)
    for rank, peer in enumerate(peers):
        if peer is not None and peer[0] == newest and first.same_cut(peer[1]):
            sources.setdefault(peer[1].index, rank)
    if len(sources) < first.shards:
        return None  # a part died with its only holders: the checkpoint has it
    order = tuple(sources[part] for part in range(first.shards))
    cut = first if first.sharded else None
    return LiveResume(newest, order, dict(offers[held[0][0]][1]), cut)


def peer_ranks(nodes: Sequence[int], rank: int) -> Tuple[int, int]:
    """The rank this rank sends its copy to and the one it receives a copy from, given
    each rank's node (``nodes``; ranks are numbered node by node): a cyclic shift by the
    most ranks one node has, so each copy lands on another node where the nodes' sizes
    allow, by one on a single node.  A shift is a permutation: each rank holds one copy
    of another's part."""
    world = len(nodes)
    shift = max(Counter(nodes).values())
    if shift >= world:
        shift = 1
    return (rank + shift) % world, (rank - shift) % world


def peer_exchange(nodes: Sequence[int], rank: int, group: Any = None) -> Optional[Callable]:
    """The exchange of copies with this rank's peers (:func:`peer_ranks`) over ``group``,
    as ``SnapshotKeeper.take_peer`` calls it; None for a group of one."""
    if len(nodes) < 2:
        return None
    dst, src = peer_ranks(nodes, rank)
    cpu = torch.device("cpu")
    return lambda tree, buffers: exchange_tree(tree, dst, src, cpu, group, buffers)


@dataclass
class SnapshotKeeper:
    """This process's newest copy, kept across its groups (they come and go; the process
    and this keeper stay), and with ``register(copy_to_peer=True)`` the copy of another
    rank's part (``peer``) it received at the same report."""

    latest: Optional[Snapshot] = None
    peer: Optional[Snapshot] = None
    # the flat buffers the peer copy was received into, by dtype (``exchange_tree``)
    peer_buffers: Dict[Any, torch.Tensor] = field(default_factory=dict)

    def peer_offer(self, run: str) -> PeerOffer:
        """(report index, layout) of the peer copy this process holds for ``run``, or None."""
        if self.peer is None or self.peer.run != run:
            return None
        return self.peer.index, self.peer.layout

    def take_peer(self, exchange: Callable[[Any, Dict[Any, torch.Tensor]], Any]) -> int:
        """After :meth:`take`: send this rank's copy to its peer and keep the one its own
        peer sends (``exchange``: the group's permutation, ``tree_broadcast.exchange_tree``);
        returns the bytes received.  No offer of a peer copy while it is replaced (its
        buffers take the next one)."""
        own, self.peer = self.latest, None
        assert own is not None, "take() first"
        sent = {"state": own.state, "sharded": own.sharded, "layout": own.layout}
        got, nbytes = exchange({**sent, "index": own.index}, self.peer_buffers)
        self.peer = Snapshot(
            own.run, got["index"], own.positions, got["layout"], got["state"], got["sharded"], False
        )
        return nbytes

    def _copy_of(self, part: int, index: int) -> Optional[Dict[str, Any]]:
        """This process's copy of ``part`` at report ``index`` (its own or its peer copy)."""
        for copy in (self.latest, self.peer):
            if copy is not None and copy.index == index and copy.layout.index == part:
                return {"state": copy.state, "sharded": copy.sharded}
        return None

    def offer(self, run: str) -> Offer:
        """(report index, positions, layout) of this run's copy; (-1, {}, None) without."""
        if self.latest is None or self.latest.run != run:
            return -1, {}, None
        return self.latest.index, dict(self.latest.positions), self.latest.layout

    def take(
        self, run: str, index: int, positions: Positions, objects: Dict[str, Any], layout: Layout
    ) -> None:
        """Copy the registered objects' state at report ``index`` (its buffers reused);
        ``layout``: the part of the whole they hold (``registered_state.layout_of``)."""
        latest, self.latest = self.latest, None  # no offer while its buffers are rewritten
        self.peer = None  # older than the copy taken now: never a source again
        reuse = None
        if latest is not None and latest.run == run and latest.reusable:
            reuse = latest.state
        live = state_of(objects)
        state = snapshot(local_view(live), reuse)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()  # GPU copies were queued; a restore reads them
        self.latest = Snapshot(run, index, dict(positions), layout, state, sharded_leaves(live))

    def resume(
        self, run: str, start: LiveResume, objects: Dict[str, Any], layout: Layout, group: Any
    ) -> Dict[str, Any]:
        """Every rank of ``group`` together: each part's holder sends its copy, every rank
        loads its own part (``layout``'s) into ``objects`` and keeps it as its copy.  In a
        group of another layout than the copies' (``start.cut``: another size or cut) each
        rank cuts its own part from the copies' parts as they arrive
        (``reshard.PartJoiner``).  Returns the restore record."""
        started = time.perf_counter()
        cut = start.cut
        joins = cut is not None and not (cut.same_cut(layout) and cut.loads_into(layout.world))
        if (cut is not None and joins and not cut.reshardable) or (
            not joins and layout.shards != len(start.sources)
        ):
            raise ValueError(
                f"register(): this group's state is cut in {layout.shards} parts, the copies "
                f"it resumes from in {len(start.sources)}; build the same layout in every "
                "group of the run"
            )
        joiner = PartJoiner(cut, objects) if joins and cut is not None else None
        mine, moved = None, 0
        for part, src in enumerate(start.sources):  # one part at a time: its holders keep it
            held = self._copy_of(part, start.index) if dist.get_rank() == src else None
            tree, nbytes = broadcast_tree(held, src, torch.device("cpu"), group)
            moved += nbytes
            if joiner is not None:  # this rank keeps the part's rows that are its own
                joiner.add(part, tree["state"], tree["sharded"])
            elif part == layout.index:
                mine = tree["state"]
            del tree  # the next part is received without this one held
        sent = time.perf_counter()
        self.peer = None  # another layout's part, or this one's: the next report sends anew
        self.peer_buffers = {}
        if joiner is not None:
            install(objects, joiner.local())
            self.latest = None  # its buffers are another layout's
            self.take(run, start.index, start.positions, objects, layout)
        else:
            assert mine is not None  # sources name every part, this rank's among them
            install(objects, mine)
            sharded = sharded_leaves(state_of(objects))
            self.latest = Snapshot(
                run, start.index, dict(start.positions), layout, mine, sharded, False
            )
        return {
            "step": start.index,
            "tier": "peers",
            # the rank that sent this rank's part; joined, every part's (resharded)
            "source_rank": None if joins else start.sources[layout.index],
            "sources": list(start.sources),
            "resharded": joins,
            "bytes": moved,
            "total_s": time.perf_counter() - started,
            "phases": {"transfer": sent - started, "install": time.perf_counter() - sent},
        }


class Registration:
    """One group's side of ``register``: what its function registered, and where it starts
    (``start``: a live copy, or None to start from ``start_index``'s checkpoint,
    ``start_checkpoint``, whose registered state ``files`` loads when it holds one).
    ``resume(start, objects, layout)``: the collective that loads the live copies on every
    rank; ``world``: the group's size; ``exchange``: the group's peer permutation for
    ``register(copy_to_peer=True)`` (``SnapshotKeeper.take_peer``), None for one rank;
    ``files``: the registered state's DCP files in the group's checkpoints
    (``registered_files``), None to write and load none."""

    def __init__(
        self,
        run: str,
        start_index: int,
        start: Optional[LiveResume],
        keeper: SnapshotKeeper,
        resume: Callable[[LiveResume, Dict[str, Any], Layout], Dict[str, Any]],
        world: int,
        exchange: Optional[Callable[[Any, Dict[Any, torch.Tensor]], Tuple[Any, int]]] = None,
        files: Optional[RegisteredFiles] = None,
        start_checkpoint: Optional[Checkpoint] = None,
    ):
        self.run, self.start_index, self.start = run, start_index, start
        self.keeper, self._resume, self.world = keeper, resume, world
        self._exchange, self._files, self._start_checkpoint = exchange, files, start_checkpoint
        self.copy_to_peer = False  # each report's copy also sent to the peer rank
        self.objects: Optional[Dict[str, Any]] = None
        self.layout: Optional[Layout] = None  # the part of the whole the objects hold
        self.restored: Optional[Dict[str, Any]] = None  # the live copy's restore record
        self.loaded: Optional[Dict[str, Any]] = None  # what the start checkpoint's files gave
        self.copy_s: List[float] = []  # what each report's copy took

    @property
    def registered(self) -> bool:
        return self.objects is not None

    @property
    def resizable(self) -> bool:
        """Registered state that loads at any world size: replicated, or sharded into
        parts that join into the whole (FSDP/HSDP: ``Layout.reshardable``)."""
        return self.layout is not None and self.layout.reshardable

    def register(self, objects: Dict[str, Any], copy_to_peer: bool = False) -> int:
        """Keep ``objects`` from now on; load the live copy the group starts from into them
        (every rank calls it at the same point of its function, with the same
        ``copy_to_peer``: sharded state's copy is also sent to a peer rank at each report,
        so a part outlives its rank).  Returns the number of reports already made."""
        if self.objects is not None:
            raise RuntimeError(
                "register() was called twice in this group; call it once, after building "
                "the model and the optimizer and before the first report"
            )
        check_registrable(objects)
        layout = layout_of(state_of(objects), self.world)  # refuses several meshes at once
        if self.start is not None:
            self.restored = self._resume(self.start, objects, layout)
        elif self._files is not None and self._start_checkpoint is not None:
            self.loaded = self._files.load(objects, self._start_checkpoint)
        self.objects, self.layout = dict(objects), layout
        # a part with no other holder: pure FSDP (HSDP's replicas hold each part already)
        alone = layout.sharded and layout.shards == layout.world
        self.copy_to_peer = copy_to_peer and alone and self._exchange is not None
        if not self.copy_to_peer:  # this group sends none: nothing kept for it
            self.keeper.peer, self.keeper.peer_buffers = None, {}
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

    def write_files(self, staged: Optional[Staged], run_name: str) -> Staged:
        """Every rank together, at a report that carries a checkpoint: ``staged`` with this
        rank's part of the registered state in it (``RegisteredFiles.add_to``)."""
        assert self._files is not None and self.objects is not None, "register() first"
        return self._files.add_to(staged, self.objects, run_name)

    @property
    def writes_files(self) -> bool:
        """Whether a report with a checkpoint also writes the registered state into it."""
        return self._files is not None and self.objects is not None

    def at_report(self, index: int, positions: Dict[str, List[int]]) -> None:
        """The report was agreed by every rank (``positions``: each dataset's [epoch, row]
        there): keep a copy of the registered state."""
        if self.objects is not None and self.layout is not None:
            started = time.perf_counter()
            at = {name: (int(epoch), int(row)) for name, (epoch, row) in positions.items()}
            self.keeper.take(self.run, index, at, self.objects, self.layout)
            if self.copy_to_peer and self._exchange is not None:
                self.keeper.take_peer(self._exchange)
            self.copy_s.append(time.perf_counter() - started)


_KEEPER = SnapshotKeeper()


def process_snapshots() -> SnapshotKeeper:
    """The keeper of this process (one per worker process, as ``process_uploader``)."""
    return _KEEPER
