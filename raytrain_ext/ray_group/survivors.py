"""Which rank a failure started at, and which processes may join the next group.

When one rank's process dies, its peers' collectives raise too (gloo: "Connection
closed by peer"), often before Ray reports the death itself.  The first error the
controller sees is then an echo, and naming its rank would blame a healthy worker.
Those echoing peers are exactly the processes a re-form in place keeps: their
collectives failed cleanly and their processes are sound.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Dict, List, Optional, Set, Tuple

import ray

from raytrain_ext.elastic.decision import Evidence
from raytrain_ext.errors.text import is_peer_loss
from raytrain_ext.ray_group.death import fates_of


def origin_of(errors: Dict[int, BaseException]) -> Optional[int]:
    """The rank the failure started at: a dead process first, then a rank whose own error
    is not an echo; None while every error seen is an echo (the origin is yet to report)."""
    dead = sorted(r for r, e in errors.items() if isinstance(e, ray.exceptions.RayActorError))
    if dead:
        return dead[0]
    own = sorted(r for r, e in errors.items() if not is_peer_loss(e))
    return own[0] if own else None


def healthy_after(ref: ray.ObjectRef) -> bool:
    """Whether a finished ``fit`` left its process fit to join a new group: it returned, or
    raised a Python error.  Not when the process died, nor after a CUDA error, which can
    leave the device unusable for the process."""
    try:
        ray.get(ref)
    except ray.exceptions.RayActorError:
        return False
    except Exception as e:
        return "CUDA" not in str(e)
    return True


def first_error(
    fit_refs: List[ray.ObjectRef],
    done: List[ray.ObjectRef],
    clock: Callable[[], float],
    echo_wait_s: float = 0.5,
) -> Optional[Tuple[int, BaseException]]:
    """(rank, error) of the failure's origin among the finished ``fit`` calls, if any raised.
    While every error is an echo, wait up to ``echo_wait_s`` for the origin's own report."""
    errors: Dict[int, BaseException] = {}
    finished: Set[int] = set()
    deadline = clock() + echo_wait_s
    while True:
        for ref in done:
            rank = fit_refs.index(ref)
            finished.add(rank)
            try:
                ray.get(ref)
            except Exception as e:
                errors[rank] = e
        origin = origin_of(errors)
        rest = [ref for r, ref in enumerate(fit_refs) if r not in finished]
        if not errors or origin is not None or not rest or clock() >= deadline:
            break
        done, _ = ray.wait(rest, num_returns=1, timeout=max(0.0, deadline - clock()))
    if not errors:
        return None
    rank = origin if origin is not None else min(errors)
    return rank, errors[rank]


def gather_evidence(
    group, fit_refs: List[ray.ObjectRef], hung_ranks: List[int], wait_s: float, evidence_s: float
) -> Evidence:
    """What the broken ``group`` shows (``elastic.decision.Evidence``), for the controller
    to decide on.

    Hung ranks are killed first, so that their peers' collectives fail at once, and the
    others leave their collectives (NCCL: aborted; gloo raises on the closed connection
    or at ``parallel.timeout_s``).  A healthy rank is one whose ``fit`` ended within
    ``wait_s`` and left a sound process.  Each other rank's fate is Ray's verdict
    (``death.fates_of``, waiting up to ``evidence_s`` for it), asked only when some
    process is healthy: without one, nothing would be kept; so is which lost ranks'
    nodes hold a warm idle process (the pool's).
    """
    group.kill(hung_ranks)
    group.abort_collectives([r for r in range(len(fit_refs)) if r not in hung_ranks])
    done, _ = ray.wait(fit_refs, num_returns=len(fit_refs), timeout=wait_s)
    healthy = [
        rank
        for rank, ref in enumerate(fit_refs)
        if ref in done and rank not in hung_ranks and healthy_after(ref)
    ]
    lost = [rank for rank in range(len(fit_refs)) if rank not in healthy]
    evidence = Evidence(len(fit_refs), healthy, spares=group.ready_spare_count())
    if not healthy or not lost:
        return evidence
    actors = [group.actors[r] for r in lost]
    fates = fates_of(actors, [group.infos[r].node_id for r in lost], evidence_s)
    warm_nodes = group.warm_nodes()
    warm = [rank for rank in lost if group.infos[rank].node_id in warm_nodes]
    return replace(evidence, fates=dict(zip(lost, fates, strict=True)), warm=warm)
