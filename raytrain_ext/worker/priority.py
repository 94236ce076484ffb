"""The CPU priority our Ray actors run at: ``scaling.worker_niceness``, 0 by default.

Why: Ray starts every worker process at nice 15 (its ``worker_niceness``), below the
raylet, the GCS, the driver and every other process on the node, which run at 0.  A
training rank is the node's main work, and under load it lost to all of them: measured
here (2 cores, 2 CPU ranks, the reference GPT), a rank at nice 15 stepped 3-4% slower
than the same rank at nice 0, and the process pool's ``SCHED_IDLE`` import (weight 3)
took about 8% of a nice-15 rank's core (weight 36) for the 20 s it ran, against 0.3% of
a nice-0 one's (weight 1024).  torchrun's ranks run at nice 0.

How: Ray reads ``RAY_worker_niceness`` from the environment a worker process starts with
(its job supervisor uses the same key to start the driver at 0), so the value goes into
the runtime environment of every actor this package starts on a node beside the ranks:
the ranks, their warm spares, the memory tier's holders and GRPO's rollout engines (with
``rollout.overlap``, an engine at nice 15 beside a rank at 0 took 131-147 ms to generate a
step against 121-122 ms at 0, and the step 147-158 ms against 139-140 ms, measured
here).  All of them share one priority, so none of ours starves another (a spare warming
up, a holder taking shards); a Ray worker of someone else's stays at Ray's 15.  The
raylet starts the process at that niceness, so raising priority this way needs no
privilege.  A runtime environment given to :func:`with_niceness` that sets the key keeps
it; a job's own (``ray.init(runtime_env=...)``) does not reach our actors' key, which
Ray's merge takes from the actor's environment: ``scaling.worker_niceness`` is the knob.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

log = logging.getLogger(__name__)

NICENESS_ENV_VAR = "RAY_worker_niceness"
RAY_DEFAULT_NICENESS = 15


def with_niceness(runtime_env: Optional[Dict[str, Any]], niceness: int) -> Dict[str, Any]:
    """``runtime_env`` (not modified) with ``RAY_worker_niceness`` set to ``niceness``,
    unless its ``env_vars`` already set it."""
    env = dict(runtime_env or {})
    env_vars = dict(env.get("env_vars") or {})
    env_vars.setdefault(NICENESS_ENV_VAR, str(niceness))
    env["env_vars"] = env_vars
    return env


# A private Ray's daemons that no step, rendezvous, recovery or runtime environment waits
# for: the log monitor (worker output to the driver), the dashboard agent (metrics export),
# and, where they run (``ray_session.private_node_start`` starts neither), the autoscaler's
# monitor and the dashboard's API server.  The GCS, the raylet and the runtime-env agent
# (which starts our actors' environments) keep their priority.
AUXILIARY_PROCESS_TYPES = ("monitor", "log_monitor", "dashboard")
# the dashboard agent, by its process title or, before it sets one, by its script
AUXILIARY_AGENT = ("ray::DashboardAgent", "dashboard/agent.py")
AUXILIARY_NICENESS = 19


def yield_auxiliary_daemons() -> List[int]:
    """Run the auxiliary daemons of the Ray this process started at nice 19; their pids.

    Why: in their first seconds they import what they serve (2.7 CPU-seconds measured here
    in the first 8 s, the runtime-env agent included), on the cores where the ranks import
    torch, and in steady state they wake to poll (about 1% of a core together).  Raising
    a process's niceness needs no privilege.  Best effort: Ray's node handle is private API,
    so another Ray version costs one debug line and nothing else."""
    try:
        from ray._private import worker as ray_worker

        processes = ray_worker._global_node.all_processes
        pids = [p.process.pid for t in AUXILIARY_PROCESS_TYPES for p in processes.get(t, [])]
        pids += children_named(processes["raylet"][0].process.pid, AUXILIARY_AGENT)
    except (AttributeError, KeyError, IndexError, OSError) as e:
        log.debug("Ray's auxiliary daemons keep their priority: %s", e)
        return []
    for pid in pids:
        for thread in threads_of(pid):  # Linux keeps a niceness per thread
            try:
                os.setpriority(os.PRIO_PROCESS, thread, AUXILIARY_NICENESS)
            except OSError as e:  # gone already, or not ours
                log.debug("daemon %d keeps its priority: %s", pid, e)
    return pids


def threads_of(pid: int) -> List[int]:
    """The thread ids of ``pid`` (the process alone where /proc cannot list them)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def children_named(parent: int, names: Tuple[str, ...]) -> List[int]:
    """Pids of ``parent``'s children whose command line holds one of ``names`` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue  # ended meanwhile
        named = any(name.encode() in cmdline for name in names)
        if named and int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            found.append(int(entry))
    return found
