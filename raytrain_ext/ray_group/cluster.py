"""What the cluster has room for, asked of Ray: free resources, live nodes, drain notices.

The only module that queries the cluster for the controller (``elastic.cluster_probe``
declares what it asks).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, Iterable, Set

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain_ext.elastic.cluster_probe import LiveNodes

log = logging.getLogger(__name__)


class RayCluster:
    """``Cluster`` over the connected Ray cluster."""

    def free_resources(self) -> Dict[str, Dict[str, float]]:
        return {
            node: dict(res)
            for node, res in ray._private.state.state.available_resources_per_node().items()
        }

    def node_probe(self, nodes: Iterable[str], known_alive: Iterable[str]) -> LiveNodes:
        return NodeProbe(nodes, known_alive)

    def draining_nodes(self) -> Dict[str, float]:
        try:
            draining = ray._private.worker.global_worker.gcs_client.get_draining_nodes(timeout=5)
        except Exception as e:  # an older Ray or a GCS hiccup: SIGTERM still works
            log.debug("cannot read draining nodes: %s", e)
            return {}
        now = time.time()  # Ray gives each deadline as a wall-clock time in ms
        return {node: deadline_ms / 1000.0 - now for node, deadline_ms in draining.items()}


class NodeProbe:
    """Which nodes answer a ping: a zero-CPU task pinned to each node.

    Ray keeps listing a node that died abruptly until its health checks fail
    (seconds to tens of seconds), so recovery must not count a dead node's CPUs.
    A live node under load may need seconds to start a worker for the ping, so
    answers are collected as they come (``answered``) instead of after one
    fixed timeout: a slow node joins late, a dead one never does.
    """

    def __init__(self, nodes: Iterable[str] = (), known_alive: Iterable[str] = ()):
        """``known_alive``: nodes just proven alive another way (a worker on them answered),
        counted without a ping, which on a loaded node first has to start a worker process."""
        self._pending: Dict[Any, str] = {}
        self._alive: Set[str] = set(known_alive)
        self._probed: Set[str] = set(self._alive)
        self.add(nodes)

    def add(self, nodes: Iterable[str]) -> None:
        """Ping the nodes not pinged yet (nodes that joined since)."""
        ping = ray.remote(num_cpus=0)(_pong)
        for node in set(nodes) - self._probed:
            self._probed.add(node)
            self._pending[
                ping.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                ).remote()
            ] = node

    def answered(self, timeout_s: float) -> Set[str]:
        if self._pending:
            ready, _ = ray.wait(
                list(self._pending), num_returns=len(self._pending), timeout=timeout_s
            )
            for ref in ready:
                node = self._pending.pop(ref)
                try:
                    ray.get(ref)
                except ray.exceptions.RayError:  # Ray failed the ping: the node is gone
                    continue
                self._alive.add(node)
        return set(self._alive)


def _pong() -> bool:
    return True
