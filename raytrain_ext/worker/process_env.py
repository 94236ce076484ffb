"""The environment variables a rank's process starts with, and who gives them to it.

A rank's process must start with ``RAY_worker_niceness`` (``worker.priority``) and
``MALLOC_ARENA_MAX`` (``worker.allocator``): both are read when the process starts.  On a
cluster someone else started, they go into the ranks' runtime environment.  Ray starts a
process with a runtime environment through its ``setup_worker.py``: one more interpreter,
which imports Ray before it execs the worker.

On a private Ray (``ray_session.connect_ray``: the CLI's, ``Trainer.fit`` without a
cluster), the raylet itself starts with these variables, so every process it starts
inherits them, and the ranks need no runtime environment.  Measured here
(``jobs/bench/overhead.py``, 4 alternating runs each): the ``worker_init`` phase of the
start (the raylet's start of rank 0's process to its actor's ``__init__``) took
0.41-0.44 s against 0.74-0.79 s.

Invariant: a rank's process has the same variables either way; only who sets them
differs.  Our other actors (the memory tier's holders, rollout engines) keep theirs in
their runtime environment.  On a private Ray every other process inherits them too: the
Ray Data tasks that read a streamed dataset run at the ranks' niceness there, not at
Ray's 15 (nothing but this run's work runs on a private Ray).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping

from raytrain_ext.worker.allocator import with_one_malloc_arena
from raytrain_ext.worker.priority import with_niceness


def rank_env_vars(niceness: int, job_env_vars: Mapping[str, str]) -> Dict[str, str]:
    """What a rank's process must start with, less what the job's ``env_vars`` or this
    process's environment already set (``with_one_malloc_arena``)."""
    env = with_one_malloc_arena(with_niceness(None, niceness), dict(job_env_vars))
    return dict(env["env_vars"])


def runtime_env_beyond(env_vars: Mapping[str, str], inherited: Mapping[str, str]) -> Dict[str, Any]:
    """The runtime environment that starts a process with ``env_vars`` on a raylet whose
    processes inherit ``inherited``: empty when they inherit every one of them with the
    same value, else all of ``env_vars``."""
    if all(inherited.get(name) == value for name, value in env_vars.items()):
        return {}
    return {"env_vars": dict(env_vars)}
