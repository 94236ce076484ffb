"""A gang of worker actors in one placement group, forming one process group.

Lifecycle: ``start`` reserves the gang (all bundles or nothing, with a
timeout), creates one actor per bundle, ranks them node by node, lets rank 0
publish a free port on its node, and has every worker join the process group.
``shutdown`` kills the actors and removes the placement group; it is safe to
call more than once and after a partial start, so nothing is left behind.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raytrain_ext.worker.actor import remote_worker_class
from raytrain_ext.worker.dist_env import WorkerEnv, assign_ranks

log = logging.getLogger(__name__)


class PlacementTimeout(RuntimeError):
    """The cluster could not host the whole gang in time."""


class WorkerGroup:
    def __init__(self, resources_per_worker: Dict[str, float], placement_strategy: str = "PACK"):
        self.resources = {k: float(v) for k, v in resources_per_worker.items() if v}
        self.placement_strategy = placement_strategy
        self.pg = None
        self.actors: List[Any] = []  # in rank order once started
        self.envs: List[WorkerEnv] = []
        self.infos: List[Dict[str, Any]] = []
        self.backend: Optional[str] = None
        self.avoid_nodes: set = set()  # node ids the next start() must not use

    @property
    def world_size(self) -> int:
        return len(self.actors)

    def start(self, num_workers: int, *, backend: str, timeout_s: float,
              placement_timeout_s: float, runtime_env: Optional[dict] = None) -> None:
        """Place ``num_workers`` actors as a gang and form the process group."""
        selector = None
        if self.avoid_nodes:  # preempted or evicted nodes; Ray labels every node with its id
            selector = [{"ray.io/node-id": f"!in({','.join(sorted(self.avoid_nodes))})"}] * num_workers
        self.pg = placement_group([dict(self.resources)] * num_workers,
                                  strategy=self.placement_strategy, bundle_label_selector=selector)
        ready, _ = ray.wait([self.pg.ready()], timeout=placement_timeout_s)
        if not ready:
            raise PlacementTimeout(
                f"could not place {num_workers} workers with {self.resources} each "
                f"({self.placement_strategy}) within {placement_timeout_s:.0f} s; cluster "
                f"resources: {ray.cluster_resources()}. Lower scaling.num_workers or "
                "scaling.resources_per_worker, or add nodes.")
        worker_cls = remote_worker_class()
        gpus = self.resources.get("GPU", 0.0)
        custom = {k: v for k, v in self.resources.items() if k not in ("CPU", "GPU")}
        actors = [worker_cls.options(
            num_cpus=self.resources.get("CPU", 0.0), num_gpus=gpus, resources=custom or None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=i),
            runtime_env=runtime_env,
        ).remote() for i in range(num_workers)]
        infos = ray.get([a.node_info.remote() for a in actors])
        envs = assign_ranks([i["node_id"] for i in infos], [i["gpu_ids"] for i in infos],
                            [i["node_ip"] for i in infos], port=0)
        order = sorted(range(num_workers), key=lambda i: envs[i].rank)
        self.actors = [actors[i] for i in order]
        self.infos = [infos[i] for i in order]
        port = ray.get(self.actors[0].free_port.remote())
        self.envs = [WorkerEnv(**{**envs[i].to_dict(), "master_port": port}) for i in order]
        backends = ray.get([a.setup.remote(e.to_dict(), backend, timeout_s)
                            for a, e in zip(self.actors, self.envs)], timeout=timeout_s + 30)
        self.backend = backends[0]
        log.info("worker group formed: %d workers, backend %s, master %s:%d", num_workers,
                 self.backend, self.envs[0].master_addr, port)

    def call_async(self, method: str, *args) -> List[ray.ObjectRef]:
        """Call ``method`` on every worker; refs are in rank order."""
        return [getattr(a, method).remote(*args) for a in self.actors]

    def shutdown(self) -> None:
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead; nothing left to release
                pass
        self.actors = []
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None
