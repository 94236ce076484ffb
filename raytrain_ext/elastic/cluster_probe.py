"""What the controller asks the cluster: free resources, live nodes, drain notices.

Protocols only: ``ray_group.cluster.RayCluster`` answers them from Ray, the controller's
unit tests from a fake, so the policies and the state machine run without Ray.
"""

from __future__ import annotations

from typing import Dict, Iterable, Protocol, Set


class LiveNodes(Protocol):
    """Which nodes have answered so far (see ``NodeProbe``)."""

    def add(self, nodes: Iterable[str]) -> None: ...

    def answered(self, timeout_s: float) -> Set[str]: ...


class Cluster(Protocol):
    def free_resources(self) -> Dict[str, Dict[str, float]]:
        """Free resources of every node listed, keyed by node id (a dead node may be listed)."""
        ...

    def node_probe(self, nodes: Iterable[str], known_alive: Iterable[str]) -> LiveNodes:
        """Start asking ``nodes`` whether they are alive; ``known_alive`` count at once."""
        ...

    def draining_nodes(self) -> Dict[str, float]:
        """Nodes being drained (spot reclaim, autoscaler): node id -> seconds to the deadline;
        empty when the cluster cannot tell."""
        ...
