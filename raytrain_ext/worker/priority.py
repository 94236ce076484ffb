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
the ranks, their warm spares and the memory tier's holders.  All of them share one
priority, so none of ours starves another (a spare warming up, a holder taking shards);
a Ray worker of someone else's stays at Ray's 15.  The raylet starts the process at that
niceness, so raising priority this way needs no privilege.  A runtime environment that
sets the key itself keeps it.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

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
