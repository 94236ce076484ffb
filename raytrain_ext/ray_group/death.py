"""How a lost worker died, from Ray's own evidence: its process, or its whole node.

A controller that re-forms without a cold restart replaces a dead *process* in
place (same node) and shrinks away from a dead *node*.  Telling the two apart must
rest on what Ray states, not on a fixed wait.  Measured on ray 2.60 with health
checks at 500 ms x 3 (tests/cluster/test_death_evidence.py):

* SIGKILL of an actor's process on a live node: within 0.02 s a call raises
  ``ActorDiedError`` and the GCS actor table says ``DEAD`` with death cause
  ``actor_died_error_context.reason == WORKER_DIED`` (``RAY_KILL`` after
  ``ray.kill``); the node stays ``Alive`` in ``ray.nodes()``.
* ``Cluster.remove_node(allow_graceful=False)`` (the raylet is killed first): for
  about 1.2 s the actor's process still *answers* ``__ray_ready__`` (it has not
  noticed its raylet is gone), while anything that needs its raylet (``ray.put``)
  hangs; after 1.2-3 s the GCS marks the node dead (``Alive`` False, death reason
  ``UNEXPECTED_TERMINATION``) and the actor ``DEAD`` with reason ``NODE_DIED``.
  ``ActorUnavailableError`` may come first: it is no proof of anything.

``ActorDiedError`` itself keeps no structured cause (its constructor turns the
``ActorDiedErrorContext`` into text and keeps only ``preempted``), so the verdicts
read the GCS tables: the actor table's ``DeathCause`` proto and the node table.

Invariants: PROCESS_DIED needs Ray's positive statement that the process died
(a process death cause) *and* its node listed alive; NODE_DIED needs the node
dead in the GCS or the actor dead of ``NODE_DIED``; ALIVE needs the actor to
answer a probe that goes through its node's object store (so a process whose
raylet is already dead cannot pass) and its node listed alive.  Everything else
is UNKNOWN at the deadline.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence

import ray
from ray.actor import ActorHandle
from ray.exceptions import ActorUnavailableError, GetTimeoutError

from raytrain_ext.elastic.decision import Fate

# The GCS's causes that say the worker *process* ended while Ray still ran its node.
PROCESS_CAUSES = frozenset(
    {
        "WORKER_DIED",  # the raylet saw the process exit (SIGKILL, crash)
        "RAY_KILL",
        "OWNER_DIED",
        "OUT_OF_SCOPE",
        "REF_DELETED",
        "OOM",  # the raylet's memory monitor killed it
        "CREATION_TASK_FAILED",  # __init__ raised
    }
)
NODE_CAUSE = "NODE_DIED"
# How long a probe may wait on the object store inside the actor (it holds a thread).
PROBE_TIMEOUT_S = 5.0


def verdict(
    actor_state: Optional[str],
    death_cause: Optional[str],
    node_alive: Optional[bool],
    answered: bool,
) -> Optional[Fate]:
    """One actor's fate from the evidence so far; None while there is none.

    ``actor_state``: the GCS actor table's state (``ALIVE``, ``RESTARTING``,
    ``DEAD``...); ``death_cause``: :func:`death_cause_name` of its death cause;
    ``node_alive``: the GCS node table's verdict on the actor's node (None: not
    listed); ``answered``: the object-store probe returned.  Pure.
    """
    if node_alive is False or (actor_state == "DEAD" and death_cause == NODE_CAUSE):
        return Fate.NODE_DIED
    if node_alive is not True:
        return None  # a node the GCS does not list: no ground for the other verdicts
    if actor_state == "DEAD" and death_cause in PROCESS_CAUSES:
        return Fate.PROCESS_DIED
    if answered and actor_state != "DEAD":
        return Fate.ALIVE
    return None


def death_cause_name(cause) -> Optional[str]:
    """The name of an ``ActorDeathCause`` proto's cause (the GCS actor table's
    ``DeathCause``): the ``ActorDiedErrorContext.Reason`` (``NODE_DIED`` also when
    only ``node_death_info`` is set), ``OOM``, ``CREATION_TASK_FAILED``, or the
    context's field name for the rest; None when no cause is recorded."""
    if cause is None:
        return None
    kind = cause.WhichOneof("context")
    if kind == "actor_died_error_context":
        context = cause.actor_died_error_context
        reason = context.Reason.Name(context.reason)
        if reason == "UNSPECIFIED" and context.HasField("node_death_info"):
            return NODE_CAUSE
        return reason
    if kind == "oom_context":
        return "OOM"
    if kind == "creation_task_failure_context":
        return "CREATION_TASK_FAILED"
    return kind


def _send_probe(actor: ActorHandle) -> ray.ObjectRef:
    """Ask ``actor`` for a round trip through its node's object store, which lives in
    the raylet: it does not return once the node's raylet is dead, whereas a plain
    call is still answered for about a second (measured)."""

    # made here, so cloudpickle sends it by value: the actor imports nothing of ours
    def probe(actor_self, timeout_s: float) -> bool:
        import ray

        return ray.get(ray.put(True), timeout=timeout_s)

    return actor.__ray_call__.remote(probe, PROBE_TIMEOUT_S)


def _actor_record(actor: ActorHandle) -> tuple:
    """(state, death cause name) from the GCS actor table; (None, None) when absent."""
    info = ray._private.state.actors(actor_id=actor._actor_id.hex())
    if not info:
        return None, None
    return info.get("State"), death_cause_name(info.get("DeathCause"))


def _node_liveness() -> Dict[str, bool]:
    return {n["NodeID"]: bool(n["Alive"]) for n in ray.nodes()}


def _probe_outcome(ref: ray.ObjectRef) -> Optional[bool]:
    """True: answered; False: failed in a way that proves nothing, worth asking again
    (the actor was unreachable, or its object store did not answer within
    ``PROBE_TIMEOUT_S``: a ``RayTaskError`` of a ``GetTimeoutError`` is one);
    None: failed for good (the actor is dead: the GCS tables carry the verdict)."""
    try:
        return bool(ray.get(ref, timeout=0))
    except (ActorUnavailableError, GetTimeoutError):
        return False
    except Exception:
        return None


def fates_of(
    actors: Sequence[ActorHandle],
    node_ids: Sequence[str],
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
    poll_s: float = 0.05,
) -> List[Fate]:
    """For each lost actor (``node_ids[i]``: the node actor ``i`` ran on), wait (all at
    once, at most ``timeout_s``) for Ray's verdict (see :func:`verdict`); return as
    soon as every actor has one, UNKNOWN for those still without one at the deadline.

    Each actor gets one probe, sent again (at most every ``poll_s``) only when Ray
    said it was unreachable: a probe stuck on a dead raylet occupies one of the
    actor's threads until the process dies, so probes are never piled up.
    The GCS tables are read every ``poll_s`` or when a probe returns.
    """
    assert len(actors) == len(node_ids), "one node id per actor"
    deadline = clock() + timeout_s
    fates: List[Optional[Fate]] = [None] * len(actors)
    probes: Dict[int, ray.ObjectRef] = {i: _send_probe(a) for i, a in enumerate(actors)}
    answered = [False] * len(actors)
    resend_at: Dict[int, float] = {}
    while True:
        _collect_probes(probes, answered, resend_at, clock() + poll_s)
        nodes = _node_liveness()
        for i, actor in enumerate(actors):
            if fates[i] is None:
                state, cause = _actor_record(actor)
                fates[i] = verdict(state, cause, nodes.get(node_ids[i]), answered[i])
        remaining = deadline - clock()
        if all(f is not None for f in fates) or remaining <= 0:
            break
        for i in [i for i, at in resend_at.items() if at <= clock() and fates[i] is None]:
            probes[i] = _send_probe(actors[i])
            del resend_at[i]
        pending = [probes[i] for i in probes if fates[i] is None]
        wait_s = min(poll_s, remaining)
        if pending:
            ray.wait(pending, num_returns=1, timeout=wait_s)
        else:
            time.sleep(wait_s)
    return [f if f is not None else Fate.UNKNOWN for f in fates]


def _collect_probes(
    probes: Dict[int, ray.ObjectRef], answered: List[bool], resend_at: Dict[int, float], at: float
) -> None:
    """Move finished probes out of ``probes``: answered ones into ``answered``,
    unreachable ones into ``resend_at`` (to be sent again at ``at``)."""
    if not probes:
        return
    refs = list(probes.values())
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    done_set = set(done)
    for i in [i for i, ref in probes.items() if ref in done_set]:
        outcome = _probe_outcome(probes.pop(i))
        if outcome is True:
            answered[i] = True
        elif outcome is False:
            resend_at[i] = at
