"""A gang of worker actors in one placement group, forming one process group.

Lifecycle: ``start`` reserves the gang (all bundles or nothing, with a
timeout), creates one actor per bundle, ranks them node by node, lets rank 0
publish a free port on its node, and has every worker join the process group.
``reform`` re-forms the same gang in place after a failure or to grow:
surviving processes are kept, dead ranks are taken over by warm spares (extra
bundles of the gang, ``elastic.spare_workers``) or by fresh actors in their
freed bundles, or left out (the group shrinks).  A bundle whose node died is
re-placed by Ray when a node has room (the placement group reschedules it); a
spare is started in it then and warms up while the group trains, so growing
back costs a pause at a step boundary, not a process start.  With a
``ProcessPool``, each node of the gang keeps one idle worker process with torch
imported in Ray's own pool, which a fresh actor there takes instead of starting
one (``worker.process_pool``).  ``shutdown`` kills
the actors and spares and removes the placement group; it is safe to call more
than once and after a partial start, so nothing is left behind.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import ray
from ray.runtime_env import RuntimeEnv
from ray.util.placement_group import (
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raytrain_ext.messages import RankInfo
from raytrain_ext.worker.actor import remote_worker_class
from raytrain_ext.worker.form_options import FormOptions
from raytrain_ext.worker.process_pool import ProcessPool
from raytrain_ext.worker.rendezvous import WorkerEnv, assign_ranks

log = logging.getLogger(__name__)


class PlacementTimeout(RuntimeError):
    """The cluster could not host the whole gang in time."""


@dataclass
class Spare:
    """A warm standby actor in its own bundle of the gang; ``ready`` resolves to its node info."""

    actor: Any
    bundle: int
    ready: ray.ObjectRef


class WorkerGroup:
    """The gang (module doc); ``worker_class`` makes the remote actor class, a
    :class:`TrainWorker` or a subclass of it (the doctor's bandwidth workers)."""

    def __init__(
        self,
        resources_per_worker: Dict[str, float],
        placement_strategy: str = "PACK",
        worker_class: Callable[[], Any] = remote_worker_class,
        process_pool: Optional[ProcessPool] = None,
    ):
        self.resources = {k: float(v) for k, v in resources_per_worker.items() if v}
        self.placement_strategy = placement_strategy
        self.worker_class = worker_class
        self.process_pool = process_pool
        self.pg: Any = None  # the gang's placement group, once placed
        self.actors: List[Any] = []  # in rank order once started
        self.bundles: List[int] = []  # each rank's bundle in ``pg``
        self.envs: List[WorkerEnv] = []
        self.infos: List[RankInfo] = []
        self.spares: List[Spare] = []
        self.vacant: List[int] = []  # bundles freed by a re-form in place, not yet refilled
        self.unplaced: Dict[int, str] = {}  # bundle -> its lost node, until Ray re-places it
        self.backend: Optional[str] = None
        self._placed_at: Optional[float] = None  # when start() had its gang placed
        self._formed_at: Optional[float] = None  # when the last start or reform formed
        self.avoid_nodes: set = set()  # node ids the next start() must not use
        self._runtime_env: Optional[dict] = None  # the caller's, a spare's
        self._rank_env: Optional[dict] = None  # a rank's: the pool's setup hook added
        # the ranks' runtime env as their raylets match it (the pool stocks processes with it)
        self._runtime_env_string: Optional[str] = None

    @property
    def world_size(self) -> int:
        return len(self.actors)

    @property
    def start_marks(self) -> Dict[str, float]:
        """When the gang was placed and the group formed (this driver's clock), and rank 0's
        own moments (``TrainWorker.node_info``: its node's clock); None-valued ones left out."""
        own = {"placed_at": self._placed_at, "formed_at": self._formed_at}
        rank0 = self.infos[0].marks if self.infos else {}
        return {**{k: v for k, v in own.items() if v is not None}, **rank0}

    def start(
        self,
        num_workers: int,
        form: FormOptions,
        *,
        runtime_env: Optional[dict] = None,
        spares: int = 0,
    ) -> None:
        """Place ``num_workers`` actors (plus ``spares`` warm standbys) as one gang and form
        the process group."""
        total = num_workers + spares
        selector = None
        if self.avoid_nodes:  # preempted or evicted nodes; Ray labels every node with its id
            selector = [{"ray.io/node-id": f"!in({','.join(sorted(self.avoid_nodes))})"}] * total
        self.pg = placement_group(
            [dict(self.resources)] * total,
            strategy=self.placement_strategy,
            bundle_label_selector=selector,
        )
        ready, _ = ray.wait([self.pg.ready()], timeout=form.placement_timeout_s)
        if not ready:
            raise PlacementTimeout(
                f"could not place {total} workers with {self.resources} each "
                f"({self.placement_strategy}) within {form.placement_timeout_s:.0f} s; cluster "
                f"resources: {ray.cluster_resources()}. Lower scaling.num_workers, "
                "scaling.resources_per_worker or elastic.spare_workers, or add nodes."
            )
        self._placed_at = time.time()
        self._runtime_env = runtime_env
        pool = self.process_pool
        self._rank_env = pool.runtime_env(runtime_env) if pool else runtime_env
        first_env = pool.first_group_env(runtime_env) if pool else runtime_env
        actors = [self._create(i, first_env) for i in range(num_workers)]
        self.spares = [self._create_spare(i) for i in range(num_workers, total)]
        self.vacant, self.unplaced = [], {}
        infos = ray.get([a.node_info.remote() for a in actors])
        self._form(list(zip(actors, range(num_workers), infos, strict=True)), form)
        self._runtime_env_string = None
        if pool is not None and pool.fresh_ray:  # its job has no environment for Ray to merge in
            self._runtime_env_string = RuntimeEnv(**(self._rank_env or {})).serialize()
        elif pool is not None:  # asked of a rank, started with exactly that environment
            ref = self.actors[0].serialized_runtime_env.remote()
            self._runtime_env_string = ray.get(ref, timeout=30)

    def reform(
        self,
        keep_ranks: List[int],
        form: FormOptions,
        *,
        size: int,
        refill_ranks: List[int],
        deferred_ranks: List[int],
    ) -> Dict[str, int]:
        """Re-form with ``size`` ranks keeping the ``keep_ranks`` processes (their
        collectives failed cleanly, or they paused); the other ranks are killed.  The
        places left are taken by ready spares first, then by fresh actors (on an idle
        process the pool kept, where there is one) in the bundles of ``refill_ranks``
        (lost processes whose node is alive).  The bundles of the other lost ranks (their
        node died) wait in ``unplaced`` until Ray re-places them on a node with room;
        ``replenish`` then starts a spare there, which warms up while the group trains and
        joins it at a step boundary.  The bundles of ``deferred_ranks`` (node alive,
        replaced in the background) are vacant at once, to be filled the same way.  A
        refill bundle left over stays vacant until ``replenish`` (once training has
        resumed: a starting process would compete with the recovery for CPU).  Returns
        how each place was filled (``prestarted``: new actors that took an idle process).

        Members are ranked in the order of the places they take: a kept rank its own, a
        new process on a lost rank's node (a refill) that rank's, so a same-size refill
        keeps every rank where it was, rank 0 included: each rank's samples and the order
        its gradients are summed in stay as they were, and the run stays bit-identical
        whichever rank was lost.  A spare (another node) ranks after them: rank 0 stays on
        a node whose local checkpoint tier it plans the restore from (``Restorer``)."""
        keep, refill = set(keep_ranks), set(refill_ranks)
        places = {r: (self.actors[r], self.bundles[r], self.infos[r]) for r in sorted(keep)}
        lost = [r for r in range(self.world_size) if r not in keep]
        for rank in lost:
            _kill(self.actors[rank])
        need = size - len(places)
        ready = self._ready_spares(need)
        refilled = [r for r in lost if r in refill][: need - len(ready)]
        asked_at = time.time()
        fresh = [self._create(self.bundles[r], self._rank_env) for r in refilled]
        later = [self.bundles[r] for r in deferred_ranks]
        unplaced = [r for r in lost if r not in refill and r not in deferred_ranks]
        self.unplaced.update({self.bundles[r]: self.infos[r].node_id for r in unplaced})
        infos = ray.get(
            [a.node_info.remote() for a in fresh],  # a process start, in a
            timeout=min(form.placement_timeout_s, 30.0),
        )  # bundle the gang holds
        for rank, actor, info in zip(refilled, fresh, infos, strict=True):
            places[rank] = (actor, self.bundles[rank], info)
        # spares rank after the others: see the docstring
        places.update(zip(range(self.world_size, self.world_size + len(ready)), ready, strict=True))
        prestarted = self._taken_from_pool(infos, asked_at)
        self.vacant += [self.bundles[r] for r in lost if r in refill and r not in refilled]
        self.vacant += later
        self._form([places[r] for r in sorted(places)], form)
        return {
            "kept": len(keep),
            "spares_used": len(ready),
            "started": len(fresh),
            "prestarted": prestarted,
            "left_out": len(keep) + len(lost) - size,
        }

    def _taken_from_pool(self, infos: List[RankInfo], asked_at: float) -> int:
        """How many of these new actors' processes had started before they were asked
        for (stocked by the pool, whose nodes then need another).  Each process's age is
        read on its own node's clock, so no two machines' clocks are compared: a process
        started for the actor is at most as old as the time since it was asked for."""
        elapsed = time.time() - asked_at
        taken = [i for i in infos if i.process_age_s > elapsed + 0.1]
        if self.process_pool is not None and self._runtime_env_string is not None:
            for info in taken:
                self.process_pool.taken(info.node_id, self._runtime_env_string)
        return len(taken)

    def replenish(self, spares: int) -> None:
        """Refill what a recovery used up, once training runs again: a spare in each lost
        node's bundle Ray has re-placed, new spares in vacant bundles up to ``spares`` in
        all (they warm up meanwhile), and an idle process in the pool on each node of the
        group that has none."""
        self._stock_pool()
        self._start_spares_where_replaced()
        while self.vacant and len(self.spares) < spares:
            self.spares.append(self._create_spare(self.vacant.pop()))

    def _stock_pool(self) -> None:
        """Ask the pool for an idle process on each node of the group without one."""
        if self.process_pool is None or self._runtime_env_string is None:
            return
        self.process_pool.stock({i.node_id for i in self.infos}, self._runtime_env_string)

    def _start_spares_where_replaced(self) -> None:
        """A spare for each bundle of ``unplaced`` that Ray has placed on another node.

        Not before: an actor created in a bundle still waiting for a node was seen here to
        stay pending long after the bundle got one (120 s, 1 try in 2), whereas one created
        once the bundle is placed starts at once."""
        if not self.unplaced:
            return
        placed = placement_group_table(self.pg).get("bundles_to_node_id", {})
        for bundle, lost_node in list(self.unplaced.items()):
            if placed.get(bundle) not in (None, "", lost_node):
                del self.unplaced[bundle]
                self.spares.append(self._create_spare(bundle))

    def warm_nodes(self) -> Set[str]:
        """Nodes where the pool's process waits with its imports done (none without a pool)."""
        return self.process_pool.warm_nodes() if self.process_pool is not None else set()

    def ready_spare_count(self) -> int:
        return len(self._warm_spares())

    def _warm_spares(self) -> List[Spare]:
        """The spares done warming and alive, in order; one that died while standing by
        (its node was lost) is dropped, its bundle left vacant."""
        if not self.spares:
            return []
        done, _ = ray.wait([s.ready for s in self.spares], num_returns=len(self.spares), timeout=0)
        warm = []
        for spare in [s for s in self.spares if s.ready in done]:
            try:
                ray.get(spare.ready)
            except ray.exceptions.RayError:
                _kill(spare.actor)
                self.spares.remove(spare)
                self.vacant.append(spare.bundle)
                continue
            warm.append(spare)
        return warm

    def _ready_spares(self, wanted: int) -> List[Tuple[Any, int, RankInfo]]:
        """Up to ``wanted`` warm spares, taken out of the pool (a spare still starting stays)."""
        taken = self._warm_spares()[:wanted]
        for spare in taken:
            self.spares.remove(spare)
        return [(s.actor, s.bundle, ray.get(s.ready)) for s in taken]

    def _create(self, bundle: int, runtime_env: Optional[dict]):
        gpus = self.resources.get("GPU", 0.0)
        custom = {k: v for k, v in self.resources.items() if k not in ("CPU", "GPU")}
        return (
            self.worker_class()
            .options(
                num_cpus=self.resources.get("CPU", 0.0),
                num_gpus=gpus,
                resources=custom or None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=bundle
                ),
                runtime_env=runtime_env,
            )
            .remote()
        )

    def _create_spare(self, bundle: int) -> Spare:
        # the caller's environment, not a rank's: a spare warms up by itself, and must not
        # take the pool's idle process (the pool could not tell it was taken)
        actor = self._create(bundle, self._runtime_env)
        return Spare(actor, bundle, actor.warm.remote())

    def _form(self, members: List[Tuple[Any, int, RankInfo]], form: FormOptions) -> None:
        """Rank ``members`` (actor, bundle, node info) node by node and join them in one group."""
        envs = assign_ranks(
            [i.node_id for _, _, i in members],
            [i.gpu_ids for _, _, i in members],
            [i.node_ip for _, _, i in members],
            port=0,
        )
        order = sorted(range(len(members)), key=lambda i: envs[i].rank)
        self.actors = [members[i][0] for i in order]
        self.bundles = [members[i][1] for i in order]
        self.infos = [members[i][2] for i in order]
        port = ray.get(self.actors[0].host_rendezvous.remote(form.timeout_s))
        self.envs = [WorkerEnv(**{**envs[i].to_dict(), "master_port": port}) for i in order]
        backends = ray.get(
            [
                a.setup.remote(e.to_dict(), form.backend, form.timeout_s)
                for a, e in zip(self.actors, self.envs, strict=True)
            ],
            timeout=form.timeout_s + 30,
        )
        self.backend = backends[0]
        self._formed_at = time.time()
        log.info(
            "worker group formed: %d workers, backend %s, master %s:%d",
            len(members),
            self.backend,
            self.envs[0].master_addr,
            port,
        )

    def call_async(self, method: str, *args) -> List[ray.ObjectRef]:
        """Call ``method`` on every worker; refs are in rank order."""
        return [getattr(a, method).remote(*args) for a in self.actors]

    def pause(self) -> None:
        """Ask every rank to stop at the next step boundary, keeping its state."""
        for actor in self.actors:
            actor.pause.remote()

    def abort_collectives(self, ranks: List[int]) -> None:
        """Ask ``ranks`` to leave the collectives of the current group (NCCL: abort them),
        so that survivors of a lost peer return from ``fit``; not waited for."""
        for rank in ranks:
            self.actors[rank].abort_collectives.remote(self.envs[rank].master_port)

    def kill(self, ranks: List[int]) -> None:
        """Kill these ranks' processes now (hung or stuck ones, before a re-form in place)."""
        for rank in ranks:
            _kill(self.actors[rank])

    def shutdown(self) -> None:
        for actor in self.actors + [s.actor for s in self.spares]:
            _kill(actor)
        self.actors, self.spares, self.vacant, self.unplaced = [], [], [], {}
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None


def _kill(actor) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already dead; nothing left to release
        pass
