"""The ranks' C allocator: one malloc arena, as a process that trains on its main thread has.

Why: a Ray actor runs its methods on a thread of its own, and glibc gives a thread that
allocates beside the main one an arena of its own.  Such an arena grows in heaps of at
most 64 MB that glibc shrinks as soon as their top is free, so a step's activations,
freed at its end, go back to the kernel and are faulted in again at the next step.
Measured here (``jobs/bench/hf_models.py``'s 20m Llama, 2 ranks on 2 cores): a rank took
21-23k page faults a second with its own arena, 13.6k with one arena, and torchrun's rank,
which trains on its main thread, 18.4k; steps were 1.5-2% shorter with one arena
(510 and 517 ms against 522 and 526, alternating runs).

``MALLOC_ARENA_MAX`` is read when the process starts, so it is set in the runtime
environment that the raylet starts the ranks (and the stocked processes of
``worker.process_pool``, which take that same environment) with.  A value the user set
(in the job's ``env_vars`` or, for a Ray this process starts, in its environment) is
kept.  Other C libraries' allocators (jemalloc, tcmalloc through ``LD_PRELOAD``) do not
read it, so a job that brings one is unaffected.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

ARENA_ENV_VAR = "MALLOC_ARENA_MAX"
ONE_ARENA = "1"


def with_one_malloc_arena(
    runtime_env: Optional[Dict[str, Any]], job_env_vars: Optional[Dict[str, str]] = None
) -> Dict[str, Any]:
    """``runtime_env`` (not modified) with ``MALLOC_ARENA_MAX=1``, unless it, the job's
    ``env_vars`` or this process's environment already set it."""
    env = dict(runtime_env or {})
    env_vars = dict(env.get("env_vars") or {})
    if ARENA_ENV_VAR not in (job_env_vars or {}) and ARENA_ENV_VAR not in os.environ:
        env_vars.setdefault(ARENA_ENV_VAR, ONE_ARENA)
    env["env_vars"] = env_vars
    return env
