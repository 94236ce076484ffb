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
With ``copy_to_peer`` each rank keeps two reports' copies, its own and its peer's, and
writes a report's into the buffers of the report before the previous one
(:meth:`SnapshotKeeper.take_with_peer`): every rank finished the previous report's copy
and exchange before any rank agreed on this one, so a failure at any moment of this
report's copy or exchange (the exchange moves the whole part, and takes seconds) leaves
that previous report whole on the survivors, each part with its two holders, and
:func:`live_start` falls back to it when the newest report is not whole.  With one
generation, the copies being overwritten and the exchange not yet done, a lost node's
parts had no holder.  It costs a second copy of the own and the peer part in host memory.
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
# (report index of one of this process's copies, its positions, its part of the whole)
Offer = Tuple[int, Positions, Layout]
# (report index, its layout) of a copy of another rank's part this process holds
# (``register(copy_to_peer=True)``)
PeerOffer = Tuple[int, Layout]


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
    # a received peer copy's flat buffers by dtype (``exchange_tree``), which its tensors view
    flats: Dict[Any, torch.Tensor] = field(default_factory=dict)


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
    offers: Sequence[Sequence[Offer]],
    committed: int,
    world: int,
    peers: Sequence[Sequence[PeerOffer]] = (),
) -> Optional[LiveResume]:
    """Where a group of ``world`` ranks starts when live processes hold copies (``offers``:
    each rank's own copies; ``peers``: each rank's copies of other ranks' parts): the
    newest report at least as new as the newest committed checkpoint (``committed``, 0 for
    none) whose copies hold every part of a layout that loads into this group or joins
    into the whole state (``Layout.reshardable``: FSDP/HSDP copies restore a group of
    another size), each part sent by its lowest holder of its own copy, else by the lowest
    holder of a peer copy.  A rank holds two reports' copies with ``copy_to_peer`` (module
    doc): the older is taken when a failure left the newer without a part.  None to start
    from that checkpoint.  Pure, and the same on every rank."""
    for index in sorted({index for own in offers for index, _, _ in own}, reverse=True):
        if index <= 0 or index < committed:
            break
        start = _whole_at(index, offers, world, peers)
        if start is not None:
            return start
    return None


def _whole_at(
    index: int,
    offers: Sequence[Sequence[Offer]],
    world: int,
    peers: Sequence[Sequence[PeerOffer]],
) -> Optional[LiveResume]:
    """:func:`live_start` from report ``index``'s copies; None when they make no whole."""
    held = [
        (rank, at, layout) for rank, own in enumerate(offers) for i, at, layout in own if i == index
    ]
    first = held[0][2]
    if not all(first.same_cut(layout) for _, _, layout in held):
        return None
    if not (first.loads_into(world) or first.reshardable):
        return None
    sources: Dict[int, int] = {}
    for rank, _, layout in held:
        sources.setdefault(layout.index, rank)
    for rank, copies in enumerate(peers):
        for i, layout in copies:
            if i == index and first.same_cut(layout):
                sources.setdefault(layout.index, rank)
    if len(sources) < first.shards:
        return None  # a part died with its only holders: an older report or the checkpoint
    order = tuple(sources[part] for part in range(first.shards))
    return LiveResume(index, order, dict(held[0][1]), first if first.sharded else None)


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
    as ``SnapshotKeeper.take_with_peer`` calls it; None for a group of one."""
    if len(nodes) < 2:
        return None
    dst, src = peer_ranks(nodes, rank)
    cpu = torch.device("cpu")
    return lambda tree, buffers: exchange_tree(tree, dst, src, cpu, group, buffers)


@dataclass
class SnapshotKeeper:
    """This process's copies, kept across its groups (they come and go; the process and
    this keeper stay): its own copy of the newest report (``latest``), and with
    ``register(copy_to_peer=True)`` its own copy of the report before (``earlier``) and the
    copies of another rank's part it received at those two reports (``peer``,
    ``peer_before``; module doc)."""

    latest: Optional[Snapshot] = None
    earlier: Optional[Snapshot] = None
    peer: Optional[Snapshot] = None
    peer_before: Optional[Snapshot] = None

    def offers(self, run: str) -> Tuple[Offer, ...]:
        """(report index, positions, layout) of each own copy of ``run``, newest first."""
        own = (self.latest, self.earlier)
        return tuple((c.index, dict(c.positions), c.layout) for c in own if c and c.run == run)

    def peer_offers(self, run: str) -> Tuple[PeerOffer, ...]:
        """(report index, layout) of each peer copy of ``run`` this process holds."""
        peer = (self.peer, self.peer_before)
        return tuple((c.index, c.layout) for c in peer if c is not None and c.run == run)

    def drop_peer_copies(self) -> None:
        """Keep the newest own copy alone (a group that sends no peer copies)."""
        self.earlier = self.peer = self.peer_before = None

    def take(
        self, run: str, index: int, positions: Positions, objects: Dict[str, Any], layout: Layout
    ) -> None:
        """Copy the registered objects' state at report ``index`` (the buffers of the copy
        it replaces reused); ``layout``: the part of the whole they hold
        (``registered_state.layout_of``).  Every other copy is older: never a source again."""
        self.drop_peer_copies()
        spare, self.latest = self.latest, None  # no offer while its buffers are rewritten
        self.latest = self._copied(spare, run, index, positions, objects, layout)

    def take_with_peer(
        self,
        run: str,
        index: int,
        positions: Positions,
        objects: Dict[str, Any],
        layout: Layout,
        exchange: Callable[[Any, Dict[Any, torch.Tensor]], Tuple[Any, int]],
    ) -> int:
        """:meth:`take`, keeping the previous report's copies: this report's own copy goes
        into the buffers of ``earlier``, then it goes to this rank's peer while the copy its
        own peer sends comes into those of ``peer_before`` (``exchange``: the group's
        permutation, ``tree_broadcast.exchange_tree``); returns the bytes received.  No copy
        is offered while its buffers are written, and the previous report's are never
        touched (module doc)."""
        spare, self.earlier = self.earlier, None
        own = self._copied(spare, run, index, positions, objects, layout)
        self.earlier, self.latest = self.latest, own
        spare_peer, self.peer_before = self.peer_before, None
        flats = {} if spare_peer is None else spare_peer.flats
        sent = {"state": own.state, "sharded": own.sharded, "layout": layout, "index": index}
        got, nbytes = exchange(sent, flats)
        received = Snapshot(
            run, got["index"], own.positions, got["layout"], got["state"], got["sharded"],
            reusable=False, flats=flats,
        )  # fmt: skip
        self.peer_before, self.peer = self.peer, received
        return nbytes

    def _copy_of(self, part: int, index: int) -> Optional[Dict[str, Any]]:
        """This process's copy of ``part`` at report ``index`` (its own or a peer copy)."""
        for copy in (self.latest, self.earlier, self.peer, self.peer_before):
            if copy is not None and copy.index == index and copy.layout.index == part:
                return {"state": copy.state, "sharded": copy.sharded}
        return None

    @staticmethod
    def _copied(
        spare: Optional[Snapshot],
        run: str,
        index: int,
        positions: Positions,
        objects: Dict[str, Any],
        layout: Layout,
    ) -> Snapshot:
        """The objects' state at report ``index``, copied into ``spare``'s buffers where
        they may take it (the same run's, not a broadcast's views)."""
        reuse = spare.state if spare is not None and spare.run == run and spare.reusable else None
        live = state_of(objects)
        state = snapshot(local_view(live), reuse)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()  # GPU copies were queued; a restore reads them
        return Snapshot(run, index, dict(positions), layout, state, sharded_leaves(live))

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
        self.drop_peer_copies()  # another layout's, or this one's: the next report sends anew
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
    ``register(copy_to_peer=True)`` (``SnapshotKeeper.take_with_peer``), None for one rank;
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
            self.keeper.drop_peer_copies()
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
            copy = (self.run, index, at, self.objects, self.layout)
            if self.copy_to_peer and self._exchange is not None:
                self.keeper.take_with_peer(*copy, self._exchange)
            else:
                self.keeper.take(*copy)
            self.copy_s.append(time.perf_counter() - started)


_KEEPER = SnapshotKeeper()


def process_snapshots() -> SnapshotKeeper:
    """The keeper of this process (one per worker process, as ``process_uploader``)."""
    return _KEEPER
