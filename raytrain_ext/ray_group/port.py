"""``GroupPort`` over ``worker.group.WorkerGroup``: the controller's Ray futures live here.

Each method resolves its own futures with a timeout and leaves out a rank that
does not answer (a dead rank's ``fit`` future reports its error instead), so the
controller sees only data.  The ``fit`` futures of the current group are held
here from ``start_fit`` until the next ``start`` or ``reform``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set

import ray
from omegaconf import DictConfig

from raytrain_ext.elastic.decision import Evidence
from raytrain_ext.elastic.group_port import FitStatus
from raytrain_ext.elastic.in_place import InPlacePlan
from raytrain_ext.messages import FitResult, Heartbeat, PollReply, RankInfo
from raytrain_ext.ray_group.diagnostics import dump_worker_stacks
from raytrain_ext.ray_group.survivors import first_error, gather_evidence
from raytrain_ext.user_code import UserCode
from raytrain_ext.worker.form_options import FormOptions
from raytrain_ext.worker.group import WorkerGroup
from raytrain_ext.worker.process_env import rank_env_vars, runtime_env_beyond
from raytrain_ext.worker.process_pool import ProcessPool

NO_ANSWER = (ray.exceptions.RayError, ray.exceptions.GetTimeoutError)


class RayGroup:
    def __init__(
        self,
        group: WorkerGroup,
        clock: Callable[[], float] = time.time,
        user: UserCode = UserCode(),
        runtime_env: Optional[Dict[str, Any]] = None,
    ):
        self._group = group
        self._user = user  # what was given from Python, shipped with every fit
        self._runtime_env = runtime_env  # the ranks' and spares' (worker/priority.py)
        self._clock = clock
        self._fit_refs: List[ray.ObjectRef] = []
        self._pending: List[ray.ObjectRef] = []

    @classmethod
    def for_config(
        cls, cfg, user: UserCode = UserCode(), inherited_env: Optional[Mapping[str, str]] = None
    ) -> RayGroup:
        """``inherited_env``: what every process of a private Ray this driver started
        inherits from its raylet (``ray_session.connect_ray``); none on a cluster."""
        s = cfg.scaling
        fresh_ray = bool(inherited_env)
        pool = ProcessPool(fresh_ray=fresh_ray) if cfg.elastic.prestart_processes else None
        group = WorkerGroup(dict(s.resources_per_worker), s.placement_strategy, process_pool=pool)
        job_env_vars = ray.get_runtime_context().runtime_env.get("env_vars") or {}
        env_vars = rank_env_vars(s.worker_niceness, job_env_vars)
        return cls(group, user=user, runtime_env=runtime_env_beyond(env_vars, inherited_env or {}))

    @property
    def avoid_nodes(self) -> Set[str]:
        return self._group.avoid_nodes

    @property
    def backend(self) -> Optional[str]:
        return self._group.backend

    @property
    def infos(self) -> List[RankInfo]:
        return self._group.infos

    @property
    def world_size(self) -> int:
        return self._group.world_size

    @property
    def start_marks(self) -> Dict[str, float]:
        return self._group.start_marks

    def start(self, num_workers: int, form: FormOptions, *, spares: int) -> None:
        self._fit_refs, self._pending = [], []  # a group that fails to form ran nothing
        self._group.start(num_workers, form, runtime_env=self._runtime_env, spares=spares)

    def reform(self, plan: InPlacePlan, form: FormOptions) -> Dict[str, int]:
        self._fit_refs, self._pending = [], []
        return self._group.reform(
            plan.keep,
            form,
            size=plan.size,
            refill_ranks=plan.refill,
            deferred_ranks=plan.deferred,
        )

    def start_fit(self, cfg: DictConfig, attempt: int) -> None:
        self._fit_refs = self._group.call_async("fit", cfg, attempt, self._user)
        self._pending = list(self._fit_refs)

    def wait_fit(self, timeout_s: float) -> FitStatus:
        """Returns as soon as any ``fit`` call ends (a failure is seen at once, whatever
        the poll interval), with every other one that has ended by then."""
        done: List[ray.ObjectRef] = []
        if self._pending:
            done, self._pending = ray.wait(self._pending, num_returns=1, timeout=timeout_s)
        if done and self._pending:
            also, self._pending = ray.wait(self._pending, num_returns=len(self._pending), timeout=0)
            done += also
        failed = first_error(self._fit_refs, done, self._clock)
        lost = failed is not None and isinstance(failed[1], ray.exceptions.RayActorError)
        returned = self._returned() if lost else {}
        return FitStatus(finished=not self._pending, error=failed, returned=returned)

    def _returned(self) -> Dict[int, FitResult]:
        """The results of the ranks whose ``fit`` has returned (not raised)."""
        results = {}
        for rank, ref in enumerate(self._fit_refs):
            if ref in self._pending:
                continue
            try:
                results[rank] = ray.get(ref, timeout=0)
            except Exception:
                continue
        return results

    def fit_results(self) -> List[FitResult]:
        return ray.get(self._fit_refs)

    def heartbeats(self, timeout_s: float) -> Dict[int, Heartbeat]:
        return self._ask(range(self.world_size), lambda a: a.heartbeat.remote(), timeout_s)

    def poll(self, ranks: Sequence[int], timeout_s: float) -> Dict[int, PollReply]:
        return self._ask(ranks, lambda a: a.poll.remote(), timeout_s)

    def _ask(
        self, ranks: Sequence[int], call: Callable[[Any], ray.ObjectRef], timeout_s: float
    ) -> Dict[int, Any]:
        """``call`` every rank of ``ranks`` at once, then collect each answer within
        ``timeout_s`` (a rank the group no longer has is left out, like a dead one)."""
        actors = self._group.actors
        refs = {r: call(actors[r]) for r in ranks if r < len(actors)}
        answers = {}
        for rank, ref in refs.items():
            try:
                answers[rank] = ray.get(ref, timeout=timeout_s)
            except NO_ANSWER:
                continue  # a dead rank: its fit() future reports it
        return answers

    def preempt(self, ranks: Sequence[int], grace_s: float) -> None:
        for rank in ranks:
            self._group.actors[rank].preempt.remote(grace_s)

    def request_checkpoint(self) -> None:
        if self._group.actors:
            self._group.actors[0].request_checkpoint.remote()

    def gather_evidence(
        self, hung_ranks: List[int], wait_s: float, evidence_s: float
    ) -> Optional[Evidence]:
        if not self._fit_refs:
            return None  # nothing ran: no survivor to keep
        return gather_evidence(self._group, self._fit_refs, hung_ranks, wait_s, evidence_s)

    def ready_spare_count(self) -> int:
        return self._group.ready_spare_count()

    def pause(self) -> None:
        self._group.pause()

    def replenish(self, spares: int) -> None:
        self._group.replenish(spares)

    def dump_stacks(self, out: Path, attempt: int) -> None:
        dump_worker_stacks(self._group.actors, self._group.infos, out, attempt)

    def shutdown(self) -> None:
        self._group.shutdown()
