"""The ``scaling`` and ``elastic`` sections: how many workers and how they are placed,
and how the controller watches and recovers the run; ``check_scaling_section``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

from raytrain_ext.errors import ConfigError
from raytrain_ext.typed_config.choice import Choice
from raytrain_ext.typed_config.fields import at_least, minus_one_or_more, positive, within


class PlacementStrategy(Choice):
    """``scaling.placement_strategy``: Ray placement-group strategies, spelled as Ray does."""

    PACK = "PACK"
    SPREAD = "SPREAD"
    STRICT_PACK = "STRICT_PACK"
    STRICT_SPREAD = "STRICT_SPREAD"


class Replacement(Choice):
    """``elastic.replacement``: how a process lost on a live node is replaced."""

    in_place = "in_place"  # wait for the new process: same size, same numerics
    background = "background"  # go on without it at once; it joins once warm
    auto = "auto"  # in place when a warm process takes the place, else in the background


@dataclass
class ScalingConfig:
    """How many workers, what each one needs, and how they are placed.

    ``min_workers``/``max_workers`` default to ``num_workers``; the elastic
    controller keeps the world size inside that range.
    """

    num_workers: int = positive(2)
    min_workers: Optional[int] = None
    max_workers: Optional[int] = None
    resources_per_worker: Dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    use_gpu: bool = False
    placement_strategy: PlacementStrategy = PlacementStrategy.PACK
    placement_timeout_s: float = positive(60.0)
    ray_address: Optional[str] = None
    # the CPU priority of the ranks, their spares, the memory tier's holders and the rollout
    # engines: Ray's worker processes run at nice 15 below the node's daemons, ours at this
    # (19: lowest; 15: Ray's own, to share nodes with other Ray work on equal terms;
    # worker/priority.py)
    worker_niceness: int = within(0, 19, 0)


@dataclass
class ElasticConfig:
    """How the controller watches and recovers the run.

    After a worker or node failure the group is re-formed with as many workers
    as fit within ``scaling.min_workers..max_workers`` and resumes from the
    newest committed checkpoint, up to ``max_failures`` times (-1: unlimited).
    After a failure the group is re-formed in place instead whenever a process
    survived: surviving processes (their collectives raised when the peer vanished)
    are kept; a lost rank whose node is alive gets a new process in its slot (or a
    warm spare takes its place), one whose node died is left out (the group
    shrinks, within min..max).  A spare waits in a lost node's slot and joins at a
    step boundary once Ray re-places the slot (the group grows back).  With DDP the
    new group takes the survivors' state, with no checkpoint read.
    """

    # how often the controller takes rank 0's records and checks notices; a failed rank is
    # seen at once, whatever this is.  Each poll is a call into a rank: at 0.2 s the
    # driver's polling cost the 2-CPU-rank reference about 1% of its step time
    poll_interval_s: float = positive(1.0)
    # recover by default, a bounded number of times: a crash loop still ends the run
    max_failures: int = minus_one_or_more(3)
    # hung: no step for max(hang_factor x median step, hang_floor_s)
    hang_factor: float = positive(20.0)
    hang_floor_s: float = positive(120.0)
    # below min_workers: wait this long for nodes, then fail
    wait_for_capacity_s: float = at_least(0, 300.0)
    # how often a running group below max_workers looks for capacity
    grow_check_s: float = positive(2.0)
    # extra capacity must be seen this long before growing ...
    grow_stable_s: float = at_least(0, 10.0)
    # ... and this long after the last re-form (hysteresis)
    resize_cooldown_s: float = at_least(0, 60.0)
    # preemptions (SIGTERM, drain) survived by shrinking; -1: unlimited
    max_preemptions: int = minus_one_or_more(-1)
    # after a preemption below min_workers: wait, then stop
    preemption_wait_s: float = at_least(0, 0.0)
    reuse_survivors: bool = True  # after a failure, keep the processes whose collectives failed
    # ... if they return within this long (else: restart them all)
    reuse_wait_s: float = at_least(0, 5.0)
    # wait up to this long for Ray's verdict on a lost process: died on a live node
    # (a new process takes its slot) or its node died (the group goes on without it)
    fate_wait_s: float = at_least(0, 10.0)
    # a replicated layout (DDP) takes the survivors' in-memory state after a re-form in
    # place (no checkpoint read, no step redone); false: restore the newest checkpoint
    state_from_peers: bool = True
    # a process lost on a live node: in_place = wait for its replacement (same size, same
    # numerics); background = go on without it at once, and let the replacement join at a
    # step boundary once warm; auto = in place when a ready spare or the pool's process
    # with its imports done takes the place, else in the background (a cold start costs
    # 2-5 s of every rank's time, a grow-back about one step).  Below min_workers the
    # replacement is always waited for
    replacement: Replacement = Replacement.auto
    # warm standby processes placed with the gang (each holds a slot)
    spare_workers: int = at_least(0, 0)
    # keep one idle worker process per node of the gang in Ray's worker pool, torch
    # imported, for a replacement to take instead of starting one (no slot, CPU or GPU
    # held; about 300 MB of host memory per node)
    prestart_processes: bool = True


def fill_scaling_defaults(s: ScalingConfig) -> None:
    """``min_workers``/``max_workers`` default to ``num_workers``; a GPU run asks one GPU
    per worker unless ``resources_per_worker`` says otherwise."""
    if s.min_workers is None:
        s.min_workers = s.num_workers
    if s.max_workers is None:
        s.max_workers = s.num_workers
    if s.use_gpu and "GPU" not in s.resources_per_worker:
        s.resources_per_worker["GPU"] = 1.0


def check_scaling_section(s: ScalingConfig) -> None:
    """The ``scaling`` section's own consistency (after ``fill_scaling_defaults``)."""
    low = s.num_workers if s.min_workers is None else s.min_workers
    high = s.num_workers if s.max_workers is None else s.max_workers
    if not 1 <= low <= s.num_workers <= high:
        raise ConfigError(
            f"scaling.num_workers: need 1 <= min_workers <= num_workers <= max_workers, got "
            f"{low} <= {s.num_workers} <= {high}. Adjust scaling.min_workers, "
            "scaling.num_workers or scaling.max_workers."
        )
    for name, amount in s.resources_per_worker.items():
        if amount < 0:
            raise ConfigError(f"scaling.resources_per_worker.{name}: must be >= 0, got {amount}.")
    if s.resources_per_worker.get("GPU", 0) > 0 and not s.use_gpu:
        raise ConfigError(
            "scaling.resources_per_worker.GPU: GPUs are requested but "
            "scaling.use_gpu is false. Set scaling.use_gpu=true or drop the GPU entry."
        )
