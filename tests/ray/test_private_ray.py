"""The private Ray the CLI and ``Trainer.fit`` start when no cluster is given."""

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, os, socket
from ray._private import worker
from raytrain_ext.ray_session import connect_ray, stop_private_ray
from raytrain_ext.worker.priority import AUXILIARY_AGENT, children_named, threads_of

lingering = socket.socket()  # as the agent of a Ray that ended abruptly holds it
try:
    lingering.bind(("127.0.0.1", 52365))  # the head agent's default port
    lingering.listen()
except OSError:  # another process holds it already: the same case
    pass
assert connect_ray(None)  # started here
node = worker._global_node
with open(os.path.join(node.get_logs_dir_path(), "dashboard_agent.log")) as f:
    agent = {"port": node.dashboard_agent_listen_port, "bind_retries": f.read().count("Failed to bind")}
processes = worker._global_node.all_processes
pids = {t: [p.process.pid for p in processes[t]] for t in processes}
raylet = pids["raylet"][0]
pids["dashboard_agent"] = children_named(raylet, AUXILIARY_AGENT)
pids["runtime_env_agent"] = children_named(raylet, ("ray::RuntimeEnvAgent", "agent/main.py"))
def niceness(pid):  # every thread's: Linux keeps one per thread
    return sorted({os.getpriority(os.PRIO_PROCESS, t) for t in threads_of(pid)})
found = {t: [niceness(p) for p in ps] for t, ps in pids.items()}
stop_private_ray()
print(json.dumps({"niceness": found, "agent": agent}))
"""


def test_a_private_ray_runs_its_auxiliary_daemons_below_the_ranks_and_no_monitor():
    """The log monitor and dashboard agent wait at nice 19 (nothing a step or a recovery
    needs); the GCS, the raylet and the runtime-env agent (which starts our actors'
    environments) keep the ranks' nice 0; neither the dashboard API server, which
    ``ray.init`` would wait for, nor the autoscaler monitor, which Ray's shutdown would
    wait 1 s for, is started; its dashboard agent listens on a free port, so an agent left
    over from an earlier Ray on the default port costs no retries."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    probed = json.loads(done.stdout.strip().splitlines()[-1])
    niceness = probed["niceness"]
    for daemon in ("log_monitor", "dashboard_agent"):
        assert niceness[daemon] == [[19]], (daemon, niceness)
    assert "dashboard" not in niceness, niceness  # the API server
    assert "monitor" not in niceness, niceness  # the autoscaler's
    for core in ("gcs_server", "raylet", "runtime_env_agent"):
        assert niceness[core] == [[0]], (core, niceness)
    agent = probed["agent"]
    assert agent["port"] > 0 and agent["port"] != 52365 and agent["bind_retries"] == 0, agent


def test_the_node_start_is_changed_only_inside_the_block():
    """Ray's own ``Node.start_api_server``, ``Node.__init__`` and ``services.get_node`` are
    back once the private Ray has started, also when the start raised: a later
    ``ray.init`` of the user's (another address, a dashboard, the agent's default port, an
    autoscaler) is Ray's, untouched."""
    from ray._private import node as ray_node
    from ray._private import services

    from raytrain_ext.ray_session import private_node_start

    originals = (ray_node.Node.start_api_server, ray_node.Node.__init__, services.get_node)
    with pytest.raises(RuntimeError, match="the start failed"):
        with private_node_start():
            assert ray_node.Node.start_api_server is not originals[0]
            assert ray_node.Node.__init__ is not originals[1]
            assert services.get_node is not originals[2]
            raise RuntimeError("the start failed")
    assert (ray_node.Node.start_api_server, ray_node.Node.__init__, services.get_node) == originals


def test_the_registration_wait_finds_the_node_and_gives_up_on_one_never_registered(ray_local):
    """The wait that replaces Ray's once-a-second poll answers at once for a registered
    node, and False (Ray's start then raises its own timeout) for one that never registers,
    within its timeout rather than after it."""
    import time

    import ray
    from ray._private import worker

    from raytrain_ext.ray_session import _wait_for_registration

    gcs = worker._global_node.gcs_address
    assert _wait_for_registration(gcs, ray.get_runtime_context().get_node_id(), 5.0, 0.1)
    started = time.monotonic()
    assert not _wait_for_registration(gcs, "ab" * 28, 0.5, 0.1)
    assert time.monotonic() - started < 5.0


@pytest.mark.slow
def test_a_private_rays_ranks_inherit_their_variables_and_the_pool_still_replaces_one(
    monkeypatch,
):
    """A private Ray started with the ranks' variables gives them to every process its
    raylet starts: the first group's ranks run with no runtime environment (no setup
    interpreter) and still with nice 0 and one malloc arena.  The pool's process keeps the
    hook's environment, which the driver names without asking a rank: a rank killed from
    outside is replaced by exactly that process, which has the same variables."""
    import signal

    import psutil
    import ray

    from raytrain_ext.ray_session import connect_ray, stop_private_ray
    from raytrain_ext.worker.form_options import FormOptions
    from raytrain_ext.worker.group import WorkerGroup
    from raytrain_ext.worker.process_env import rank_env_vars, runtime_env_beyond
    from raytrain_ext.worker.process_pool import ProcessPool
    from tests.helpers.leaks import idle_processes_with_torch
    from tests.helpers.runs import wait_until

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    ray.shutdown()  # the tests' own Ray, if one runs: the next test that needs it restarts it
    env_vars = rank_env_vars(0, {})
    assert env_vars == {"RAY_worker_niceness": "0", "MALLOC_ARENA_MAX": "1"}
    assert connect_ray(None, env_vars)
    group = WorkerGroup({"CPU": 1}, process_pool=ProcessPool(keep_alive_s=600, fresh_ray=True))
    form = FormOptions("auto", timeout_s=30, placement_timeout_s=30)

    def started_with(self):
        return (
            ray.get_runtime_context().get_runtime_env_string(),
            os.environ.get("MALLOC_ARENA_MAX"),
            os.getpriority(os.PRIO_PROCESS, 0),
        )

    try:
        before = idle_processes_with_torch()
        group.start(2, form, runtime_env=runtime_env_beyond(env_vars, env_vars))
        ranks = ray.get([a.__ray_call__.remote(started_with) for a in group.actors])
        assert ranks == [("{}", "1", 0)] * 2
        group.replenish(0)
        idle = wait_until(lambda: idle_processes_with_torch() - before, "stocked process", 90)
        os.kill(group.infos[1].pid, signal.SIGKILL)
        wait_until(lambda: not psutil.pid_exists(group.infos[1].pid), "death of rank 1", 90)
        filled = group.reform([0], form, size=2, refill_ranks=[1], deferred_ranks=[])
        assert filled["prestarted"] == 1 and group.infos[1].pid in idle
        hook_env, arena, niceness = ray.get(group.actors[1].__ray_call__.remote(started_with))
        assert "RAY_WORKER_PROCESS_SETUP_HOOK" in hook_env and (arena, niceness) == ("1", 0)
    finally:
        group.shutdown()
        stop_private_ray()
