"""Rollout engines on nodes of their own (a custom resource), one node lost: its groups
are issued again whole to the engine still alive and generate the same tokens, Ray's
verdict is recorded as node_died, and the replacement lands on the spare node with the
current weights."""

import contextlib
import signal

import pytest

from raytrain_ext.rollout.engine import GroupRequest, HFGenerateEngine, RolloutSettings
from tests.helpers.hf_models import tiny_policy
from tests.helpers.leaks import assert_nothing_left
from tests.helpers.runs import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.chaos]

SETTINGS = RolloutSettings(
    num_generations=3, max_completion_length=8, seed=17, eos_token_id=3, pad_token_id=0
)


def lose(cluster, node) -> None:
    """The node's raylet and every process under it SIGKILLed at once, as a machine dies
    (``remove_node`` alone lets the workers run on for about half a second, long enough
    to finish a small rollout), then the node removed."""
    import psutil

    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    for process in [raylet, *raylet.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGKILL)
    cluster.remove_node(node, allow_graceful=False)


def requests(step: int):
    return [GroupRequest(i, (2 + i, 5, 7 + i), step) for i in range(6)]


def test_a_lost_engine_node_costs_no_group_and_the_replacement_lands_on_a_free_node(
    ray_cluster,
):
    import ray

    from raytrain_ext.rollout.pool import EnginePool
    from raytrain_ext.rollout.weights_wire import to_wire

    nodes = {}
    for _ in range(3):
        node = ray_cluster.add_node(
            num_cpus=1, resources={"rollout": 1}, object_store_memory=80 * 2**20
        )
        nodes[node.node_id] = node
    ray_cluster.wait_for_nodes()
    trained = tiny_policy(seed=6).state_dict()
    reference = HFGenerateEngine(tiny_policy(), SETTINGS)
    reference.load_weights(trained, version=2)
    options = {"num_cpus": 1, "resources": {"rollout": 1}}
    pool = EnginePool(tiny_policy, SETTINGS, engines=2, actor_options=options)
    try:
        pool.load_weights(ray.put(to_wire(trained)), version=2)
        (kept_node, kept_pid), (lost_node, _) = pool.placements()
        assert kept_node != lost_node
        lose(ray_cluster, nodes.pop(lost_node))
        assert pool.generate(requests(step=3)) == reference.generate(requests(step=3))
        (recovery,) = pool.recoveries
        wait_until(lambda: recovery.fate != "pending", "Ray's verdict (asked off the step's path)")
        assert (recovery.engine, recovery.fate, recovery.groups_reissued) == (1, "node_died", 3)
        (node_0, pid_0), (node_1, _) = pool.placements()
        (spare,) = set(nodes) - {kept_node}
        assert (node_0, pid_0) == (kept_node, kept_pid) and node_1 == spare
        again = pool.generate(requests(step=4))  # the replacement takes its share
        assert again == reference.generate(requests(step=4))
        assert {g.weights_version for g in again} == {2}
    finally:
        pool.shutdown()
    assert_nothing_left()
