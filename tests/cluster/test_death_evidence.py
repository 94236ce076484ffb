"""How a worker died, from Ray's evidence (raytrain_ext.ray_group.death), on a real
multi-node Cluster: a killed process on a live node, a removed node, a healthy actor.

The actors are small threaded ones (like TrainWorker, max_concurrency 4) that do
not import torch: ``fates_of`` only uses Ray's built-in ``__ray_call__`` and the
GCS tables, and three torch imports would cost this 2-core machine ~10 s.
"""

import os
import signal
import time

import pytest
import ray

from raytrain_ext.ray_group.death import Fate, fates_of

pytestmark = [pytest.mark.slow, pytest.mark.chaos]


@ray.remote(num_cpus=1, max_concurrency=4)
class Worker:
    def where(self):
        return os.getpid(), ray.get_runtime_context().get_node_id()


def test_fates_on_a_cluster(ray_cluster):
    """One actor per one-CPU node: SIGKILL one (PROCESS_DIED within 5 s), remove the
        node of another (NODE_DIED, although its process answers plain calls for about a
        second after its raylet is gone), leave the third alone (ALIVE).  A node id the GCS
    does not list gives UNKNOWN at the deadline."""
    nodes = [ray_cluster.add_node(num_cpus=1, object_store_memory=80 * 2**20) for _ in range(3)]
    ray_cluster.wait_for_nodes()
    actors = [Worker.remote() for _ in range(3)]
    pids, node_ids = zip(*ray.get([a.where.remote() for a in actors], timeout=60), strict=True)
    assert len(set(node_ids)) == 3
    by_id = {n.node_id: n for n in nodes}

    start = time.monotonic()
    assert fates_of(actors, node_ids, timeout_s=10) == [Fate.ALIVE] * 3
    print(f"ALIVE after {time.monotonic() - start:.3f} s")
    assert time.monotonic() - start < 4  # as soon as all answered, not at the deadline

    start = time.monotonic()  # a node id the GCS does not list: no verdict, UNKNOWN on time
    assert fates_of(actors[:1], ["ff" * 28], timeout_s=0.5) == [Fate.UNKNOWN]
    assert 0.5 <= time.monotonic() - start < 2

    start = time.monotonic()
    os.kill(pids[0], signal.SIGKILL)
    assert fates_of(actors[:1], node_ids[:1], timeout_s=10) == [Fate.PROCESS_DIED]
    print(f"PROCESS_DIED after {time.monotonic() - start:.3f} s")
    assert time.monotonic() - start < 5

    start = time.monotonic()
    ray_cluster.remove_node(by_id[node_ids[1]], allow_graceful=False)
    fates = fates_of(actors, node_ids, timeout_s=20)
    elapsed = time.monotonic() - start
    print(f"NODE_DIED after {elapsed:.3f} s")
    assert fates == [Fate.PROCESS_DIED, Fate.NODE_DIED, Fate.ALIVE], f"after {elapsed:.1f} s"
    assert elapsed < 15
    alive = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
    assert alive[node_ids[1]] is False and alive[node_ids[0]] and alive[node_ids[2]]
