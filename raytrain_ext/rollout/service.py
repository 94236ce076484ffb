"""The run's rollout service: one Ray actor, started by the driver and living as long as
the run, that owns the rollout engines (``EnginePool``) and turns a step's prompt groups
into scored completions with their advantages.

Why an actor of its own, not rank 0's: Ray ends an actor with the process that created
it.  Engines that rank 0 created would die with rank 0, and a trainer's loss would cost
every engine its process and weights.  Owned by this service (itself the driver's),
they keep both through any re-form of the trainers.

How a step goes: every rank asks ``rollout(step, prompts)`` with the same prompt groups
(they all read the same global sampler).  The first request generates (the engines), then
scores (the reward functions, in Ray tasks: a slow reward holds no trainer) and computes
the group advantages; every request for that step gets the same result, and the last
few steps' results are kept, so a trainer group re-formed mid-step takes what was already
generated instead of generating it again.  ``load_weights`` at each push point of the
schedule and at each trainer group's start gives the service the new policy;
``rollout(step)`` generates only once the weights the schedule names are in
(``rollout.schedule``: with ``sync_every=1``, those of ``step - 1``, on-policy).

Invariants:
- One generation per step, whatever the number of ranks or re-forms asking for it.
- A step's result has every prompt group whole, each completion scored by every reward
  function (or the step fails naming the function and the prompt).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence, Tuple, Union

import ray
import torch

from raytrain_ext.objectives.grpo import ScaleRewards, combined_rewards, group_advantages
from raytrain_ext.rollout.engine import GroupCompletions, GroupRequest, RolloutSettings
from raytrain_ext.rollout.pool import EngineBuilder, EnginePool, ModelFactory
from raytrain_ext.rollout.prompts import PromptGroup
from raytrain_ext.rollout.rewards import (
    RewardFn,
    ScoredGroup,
    function_name,
    load_reward_fn,
    score_groups,
)
from raytrain_ext.rollout.schedule import WeightsSchedule
from raytrain_ext.rollout.weights_wire import WireState

KEEP_STEPS = 4  # results kept for re-formed trainers asking again
KEEP_VERSIONS = 3  # pushed weights kept: the next generations need one of the newest two
# The weights' loads and the service's reports run on threads of their own: every rank
# may be waiting in ``rollout`` for the very weights ``load_weights`` brings.
CONTROL = "control"
WEIGHTS = "weights"  # one thread: the trainers' pushes are taken in the order they come
ROLLOUT_NAMESPACE = "raytrain_ext_rollout"


@dataclass(frozen=True)
class RolloutResult:
    """A step's completions and what they are worth: ``rewards_per_function`` is
    ``[completions, functions]`` (NaN: the function returned None), ``advantages`` one
    per completion in group order."""

    step: int
    groups: List[GroupCompletions]
    rewards_per_function: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    function_names: Tuple[str, ...] = ()  # the reward functions', in column order
    phases_s: Dict[str, float] = field(default_factory=dict)  # wait_weights, generate, reward
    weights_version: int = -1  # the step whose weights generated it (rollout.schedule)


@dataclass
class RewardSpec:
    """The reward functions (``pkg.mod:fn`` names or callables), their weights (one
    each; all 1 by default), and how advantages are scaled."""

    functions: Sequence[Union[str, RewardFn]]
    weights: Optional[Sequence[float]] = None
    scale_rewards: ScaleRewards = ScaleRewards.group
    # no CPU reserved: a reward task never waits for a slot the trainers and engines hold
    task_options: Dict[str, Any] = field(default_factory=lambda: {"num_cpus": 0})

    def loaded(self) -> List[RewardFn]:
        return [load_reward_fn(f) if isinstance(f, str) else f for f in self.functions]


@dataclass
class RolloutSpec:
    """What a run's rollout is made of: ``build`` makes an engine's model (and
    ``reference``, when given, the reference policy each engine scores its completions
    under); ``engines`` engines of ``engine_options`` each; ``decode`` turns a
    completion's token ids into what the reward functions see (a tokenizer's decode; by
    default the ids as a list)."""

    build: ModelFactory
    settings: RolloutSettings
    rewards: RewardSpec
    engines: int
    engine_options: Optional[Dict[str, Any]] = None
    decode: Optional[Callable[[Sequence[int]], Any]] = None
    timeout_s: float = 600.0  # every wait on an engine
    reference: Optional[ModelFactory] = None
    schedule: WeightsSchedule = WeightsSchedule()
    backend: Optional[EngineBuilder] = None  # None: the hf engine over ``build``
    spare_engines: int = 0  # warm engines that take a lost one's place (EnginePool)


class RolloutService:
    """The actor (module doc)."""

    def __init__(self, spec: RolloutSpec):
        self.settings, self.rewards = spec.settings, spec.rewards
        self.decode = spec.decode or list  # what reward functions see of a completion
        self.reward_fns = spec.rewards.loaded()
        self._score_task = ray.remote(score_groups).options(**spec.rewards.task_options)
        self.weights = spec.rewards.weights or [1.0] * len(self.reward_fns)
        self.pool = EnginePool(
            spec.build,
            spec.settings,
            spec.engines,
            spec.engine_options,
            spec.timeout_s,
            spec.reference,
            spec.backend,
            spec.spare_engines,
        )
        self.version = -1  # the step whose weights the engines have
        self.schedule = spec.schedule
        self.anchor = 0  # a trainer group's start off the schedule (rollout.schedule)
        self._pushed: Dict[int, ray.ObjectRef] = {}  # version -> the trainers' weights
        self._lock = threading.Condition()
        self._generating = threading.Lock()
        self._results: Dict[int, "_Pending"] = {}
        self.generated_steps: List[int] = []  # in the order generated (tests: each once)
        self.starts: List[Dict[str, Any]] = []  # each trainer group's start: kept, weights sent

    @ray.method(concurrency_group=WEIGHTS)
    def load_weights(
        self,
        state: WireState,
        version: int,
        start: bool = False,
        carried: Sequence[RolloutResult] = (),
    ) -> int:
        """The trainers' weights after step ``version`` (a push point of the schedule, or a
        trainer group's ``start`` that ``begin_start`` found needs them), kept until the
        schedule names them for a generation (``_generate`` loads them then, so a push
        never overtakes a generation that needs older weights).  Kept: the newest
        ``KEEP_VERSIONS`` versions that some generation needs, and the anchor's, each in
        the object store under this service's ownership (the trainer whose call brought
        them may die; the engines read them in place).  Returns the anchor."""
        weights = ray.put(state)  # this service's own copy
        with self._lock:
            keeps = self._apply_start(version, carried) if start else True
            if not start or not keeps or self.schedule.pushes_after(version):
                self._pushed[version] = weights
            if start:
                self.starts.append({"step": version, "kept": keeps, "weights": True})
            kept = set(sorted(self._pushed)[-KEEP_VERSIONS:]) | {self.anchor}
            for old in [v for v in self._pushed if v not in kept]:
                del self._pushed[old]
            self._lock.notify_all()
            return self.anchor

    @ray.method(concurrency_group=WEIGHTS)
    def begin_start(self, version: int, carried: Sequence[RolloutResult] = ()) -> bool:
        """A trainer group starts at step ``version`` (its checkpoint carrying the results
        ``carried``): whether it must send its weights (then its ``load_weights(...,
        start=True)`` applies the start).  Not when the service holds them already (a
        group re-formed in place replays to the bit what an earlier group pushed), nor
        when it keeps the schedule without them and no generation takes them: then the
        start is applied here, in the same locked call, so a large model is not gathered
        and sent at every re-form."""
        with self._lock:
            held = {v for v in self._pushed if v <= version}
            if version not in held:
                carried_steps = {result.step for result in carried}
                keeps, _ = self.schedule.start(
                    version, self.anchor, self._next(version, carried_steps), held
                )
                if not keeps or self.schedule.pushes_after(version):
                    return True
            keeps = self._apply_start(version, carried)
            self.starts.append({"step": version, "kept": keeps, "weights": False})
            self._lock.notify_all()
            return False

    def _apply_start(self, version: int, carried: Sequence[RolloutResult]) -> bool:
        """A group's start at ``version`` (under the lock, its weights held or on their
        way): drop what a branch it left pushed, take the results its checkpoint
        ``carried`` as generated (a result already here for the same step is the same
        one) and decide the anchor (``WeightsSchedule.start``); a start that anchors also
        drops the results kept for later steps, generated on the schedule the group has
        left (not those it carried: its ranks train on them).  Whether it keeps the
        schedule."""
        for result in carried:
            self._results.setdefault(result.step, _Pending.done(result))
        for newer in [v for v in self._pushed if v > version]:
            del self._pushed[newer]
        held = set(self._pushed) | {version}
        keeps, self.anchor = self.schedule.start(version, self.anchor, self._next(version), held)
        if not keeps:
            carried_steps = {result.step for result in carried}
            for later in [s for s in self._results if s > version]:
                if later not in carried_steps:
                    del self._results[later]
        return keeps

    def _next(self, start: int, carried: Collection[int] = ()) -> int:
        """The first generation for a step after ``start`` not generated or under way (a
        request still waiting for its weights is neither; ``carried``: generated)."""
        step = self.schedule.key(start + 1)
        while step in carried or (
            (kept := self._results.get(step)) is not None and kept.version is not None
        ):
            step += self.schedule.iterations
        return step

    def rollout(
        self, step: int, prompts: Sequence[PromptGroup], wait_s: float = 600.0
    ) -> RolloutResult:
        """The step's result, generated once (module doc), with the weights the schedule
        names (a result kept from before a re-form was generated with the same weights:
        the trainers redo steps to the bit)."""
        with self._lock:
            pending = self._results.get(step)
            first = pending is None
            if first:
                pending = self._results[step] = _Pending()
                oldest = step - KEEP_STEPS * self.schedule.iterations - self.schedule.reach
                for old in [s for s in self._results if s <= oldest]:
                    del self._results[old]
        assert pending is not None
        if first:
            try:
                pending.set(self._generate(step, prompts, wait_s, pending))
            except BaseException as e:  # every waiting rank sees the cause
                pending.fail(e)
                with self._lock:
                    self._results.pop(step, None)
                raise
        return pending.get(3 * wait_s)  # the first request's own waits: weights, engines, rewards

    def _generate(
        self, step: int, prompts: Sequence[PromptGroup], wait_s: float, pending: "_Pending"
    ) -> RolloutResult:
        started = time.perf_counter()
        with self._lock:

            def due() -> int:
                return self.schedule.required(step, self.anchor)

            if not self._lock.wait_for(lambda: due() in self._pushed, timeout=wait_s):
                raise TimeoutError(
                    f"rollout of step {step}: no weights of step {due()} after {wait_s:.0f} s "
                    f"(load_weights({due()}) never came; the service holds "
                    f"{sorted(self._pushed)})"
                )
            version, weights = due(), self._pushed[due()]
            pending.version = version  # under way: a group's start counts it generated
        weights_in = time.perf_counter()
        requests = [GroupRequest(p.index, p.prompt_ids, step) for p in prompts]
        with self._generating:  # one generation at a time (a re-formed group may overlap)
            if self.version != version:  # the engines take them before this call
                self.pool.load_weights(weights, version)
                self.version = version
            groups = self.pool.generate(requests)
        generated = time.perf_counter()
        stale = sorted({g.weights_version for g in groups} - {version})
        if stale:
            raise RuntimeError(
                f"rollout of step {step}: engines generated with the weights of step(s) "
                f"{stale}, not {version} (an engine's load_weights failed, or the trainers "
                "set the version back meanwhile): see the engines' logs"
            )
        per_function = self._score(prompts, groups, wait_s)
        phases = {
            "wait_weights": weights_in - started,
            "generate": generated - weights_in,
            "reward": time.perf_counter() - generated,
        }
        rewards = combined_rewards(per_function, self.weights)
        advantages = group_advantages(
            rewards, self.settings.num_generations, self.rewards.scale_rewards
        )
        self.generated_steps.append(step)
        names = tuple(function_name(fn) for fn in self.reward_fns)
        return RolloutResult(
            step, groups, per_function, rewards, advantages, names, phases, version
        )

    def _score(
        self, prompts: Sequence[PromptGroup], groups: List[GroupCompletions], wait_s: float
    ) -> torch.Tensor:
        """Every completion scored by every function, in Ray tasks (one per 8 groups)."""
        scored = [
            ScoredGroup(p.index, p.prompt, [self.decode(c) for c in g.completions], dict(p.columns))
            for p, g in zip(prompts, groups, strict=True)
        ]
        task = self._score_task
        chunks = [scored[i : i + 8] for i in range(0, len(scored), 8)]
        parts = ray.get([task.remote(self.reward_fns, chunk) for chunk in chunks], timeout=wait_s)
        rows = [completion for part in parts for group in part for completion in group]
        return torch.tensor(rows, dtype=torch.float32).view(-1, len(self.reward_fns))

    @ray.method(concurrency_group=CONTROL)
    def stats(self) -> Dict[str, Any]:
        """Steps generated, the engines' weights version and (node id, pid) each, and each
        engine lost."""
        return {
            "generations": len(self.generated_steps),
            "generated_steps": list(self.generated_steps),
            "starts": list(self.starts),
            "anchor": self.anchor,
            "held_versions": sorted(self._pushed),
            "version": self.version,
            "engines": [list(p) for p in self.pool.known_placements()],
            "spares": len(self.pool.spares),
            "recoveries": [r.to_dict() for r in self.pool.recoveries],
        }

    @ray.method(concurrency_group=CONTROL)
    def engine_placements(self) -> List[Tuple[str, int]]:
        return self.pool.placements()

    @ray.method(concurrency_group=CONTROL)
    def spare_placements(self) -> List[Tuple[str, int]]:
        return self.pool.spare_placements()

    @ray.method(concurrency_group=CONTROL)
    def shutdown(self) -> None:
        self.pool.shutdown()


class _Pending:
    """A step's result being generated, waited for by every rank that asks."""

    def __init__(self) -> None:
        self.version: Optional[int] = None  # the weights it is generated with, once taken
        self._done = threading.Event()
        self._value: Optional[RolloutResult] = None
        self._error: Optional[BaseException] = None

    @classmethod
    def done(cls, value: RolloutResult) -> "_Pending":
        """A result generated before (a checkpoint carried it)."""
        pending = cls()
        pending.version = value.weights_version
        pending.set(value)
        return pending

    def set(self, value: RolloutResult) -> None:
        self._value = value
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._done.set()

    def get(self, wait_s: float) -> RolloutResult:
        if not self._done.wait(wait_s):
            raise TimeoutError(f"no rollout result within {wait_s:.0f} s")
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value


def start_rollout_service(
    spec: RolloutSpec, concurrency: int = 16, name: Optional[str] = None
) -> Any:
    """The service actor (threaded: every rank's request and the weights' loads at once),
    on the calling process's node, owned by it; ``name``: found by it in
    ``ROLLOUT_NAMESPACE``.  Pinned there (not a soft preference: Ray places a soft one on
    any node with room, and a trainer's or an engine's node may be lost), so that it
    shares the driver's fate and no other."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    strategy = NodeAffinitySchedulingStrategy(node, soft=False)
    named = {} if name is None else {"name": name, "namespace": ROLLOUT_NAMESPACE}
    groups = {CONTROL: 2, WEIGHTS: 1}
    actor_class = ray.remote(concurrency_groups=groups)(RolloutService).options(
        num_cpus=0, max_concurrency=concurrency, scheduling_strategy=strategy, **named
    )
    return actor_class.remote(spec)
