"""A GRPO rank's training input: each step's rollout, served to the loop as a dataset.

The loop asks every dataset the same things: the global batch's loss units before any
forward (``target_weights``), and micro-batches by sample id (``batch``, from the
prefetcher's thread too).  Here a sample is a prompt group at a step
(:class:`raytrain_ext.rollout.order.RolloutOrder`); the first question about a step asks
the run's rollout service for it with the step's prompt groups in global-batch order,
and every rank gets the same generation, scores and advantages.  The policy reaches the
engines through :meth:`RolloutInput.push_policy`: rank 0 sends the full parameters after
each update the schedule needs (``rollout.schedule``) and when a group starts (a restore
or a re-form may set the engines' version back to the group's step).

Why on-policy is an order, not a flag: the service generates step ``s`` only with the
weights the schedule names (``rollout.schedule``; on-policy, those of step ``s - 1``), so
the prefetcher asking for step ``s + 1`` during step ``s`` waits there until step ``s``'s
update is pushed.  Each completion's log-probs under the generating policy are then the
current ones (``Rollout.old_logps`` None, every ratio 1, as TRL's ``num_iterations=1``).
With ``rollout.sync_every > 1`` or ``rollout.overlap`` the prefetched step is generated
with older weights at once (overlapping the update), and the engines' own log-probs of
the completions are the ratio's denominator.

A checkpoint carries the results of the generations made with weights older than its
own (:meth:`RolloutInput.carried`, ``rollout.schedule``): a rank restored from it trains
on those instead of asking the service, and rank 0 hands them to the service with the
group's first push, so a group re-formed later from live peers finds them there.

Invariants:
- A step's rollout is fetched at most once per rank, whichever thread asks first, and
  no lock is held while waiting for it (the main thread may need step ``s`` while the
  prefetcher waits for ``s + 1``); a re-form cuts the wait short (``rollout.waits``).
- A batch's rows are its groups' completions, ``num_generations`` each, in the order of
  its ids; each row's advantage is its completion's in the step's result, and with
  ``objective.grpo.beta > 0`` its reference log-probs are the ones the engine computed
  when it generated the completion (``rollout.reference``).
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from raytrain_ext.data.batch import Batch, Rollout
from raytrain_ext.data.eval_split import split_eval
from raytrain_ext.data.sampler import GlobalSampler
from raytrain_ext.data.training_input import TrainingInput
from raytrain_ext.objectives.config import GRPOLossType
from raytrain_ext.parallel.strategy import Strategy
from raytrain_ext.rollout.assemble import completion_rows
from raytrain_ext.rollout.carry import result_from_plain, result_to_plain
from raytrain_ext.rollout.order import KEPT_STEPS, RolloutOrder
from raytrain_ext.rollout.prompt_records import PromptRecords
from raytrain_ext.rollout.reference import CompletionLogps, logp_rows
from raytrain_ext.rollout.schedule import WeightsSchedule
from raytrain_ext.rollout.service import RolloutResult
from raytrain_ext.rollout.waits import arm, wait_for
from raytrain_ext.rollout.weights_wire import to_wire

EXTRA_WAIT_S = 60.0  # beyond the service's own waits (weights, engines, rewards)


class StepRollout:
    """One step's result, and where each prompt's group sits in it.

    Invariant: ``result.groups[k]`` is the group of the step's ``k``-th prompt in
    global-batch order; a prompt twice in one step (a batch across an epoch's end) maps
    to its first group, which the second would equal (same prompt, seeds and weights)."""

    def __init__(self, result: RolloutResult, prompts: np.ndarray, generations: int):
        self.result = result
        self.generations = generations
        self.position: Dict[int, int] = {}
        for k, prompt in enumerate(prompts.tolist()):
            self.position.setdefault(prompt, k)  # a prompt twice in a step: the same group

    def group(self, prompt: int):
        return self.result.groups[self.position[prompt]]

    def advantages(self, prompt: int) -> torch.Tensor:
        k = self.position[prompt] * self.generations
        return self.result.advantages[k : k + self.generations]


class RolloutInput:
    """The loop's dataset for ``objective.name=grpo`` (module doc)."""

    def __init__(self, cfg, records: PromptRecords, order: RolloutOrder, service: Any):
        g = cfg.objective.grpo
        self.records, self.order, self.service = records, order, service
        self.num_samples = records.num_samples
        self.generations = g.num_generations
        self.units_are_tokens = g.loss_type == GRPOLossType.dapo
        self.kl = g.beta > 0  # batches carry the reference's log-probs (rollout.reference)
        self.schedule = WeightsSchedule.of(cfg)
        tokenizer = records.tokenizer
        self.pad_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        self.wait_s = cfg.rollout.timeout_s
        self._lock = threading.Lock()
        self._refs: Dict[int, Any] = {}  # step -> the service call's result
        self._steps: Dict[int, StepRollout] = {}
        self._carried: Dict[int, RolloutResult] = {}  # generation -> a checkpoint's result
        self.last_step = cfg.run.max_steps
        arm()  # this group's waits (rollout.waits)

    def step_rollout(self, step: int) -> StepRollout:
        """The rollout step ``step`` trains on (its generation's, under the generation's
        first step: ``WeightsSchedule.key``): one the checkpoint carried, else asked of
        the service once (module doc)."""
        return self._generation(self.schedule.key(step), self.order.prompts_of(step))

    def _generation(self, key: int, prompts: np.ndarray) -> StepRollout:
        with self._lock:
            done = self._steps.get(key)
            if done is not None:
                return done
            carried = self._carried.get(key)
            ref = self._refs.get(key)
            if carried is None and ref is None:
                groups = [self.records.group(i) for i in prompts.tolist()]
                ref = self._refs[key] = self.service.rollout.remote(key, groups, self.wait_s)
        if carried is not None:
            return self._keep(key, prompts, carried, "the checkpoint")
        try:
            result = wait_for(ref, 3 * self.wait_s + EXTRA_WAIT_S, f"the rollout of step {key}")
        except BaseException:
            with self._lock:  # never a failed call kept: the next ask asks again
                if self._refs.get(key) is ref:
                    del self._refs[key]
            raise
        return self._keep(key, prompts, result, "the rollout service")

    def _keep(self, key: int, prompts: np.ndarray, result: RolloutResult, source: str):
        if result.step != key or len(result.groups) != len(prompts):
            raise RuntimeError(
                f"{source} answered step {key} with step {result.step}'s "
                f"{len(result.groups)} groups, not {len(prompts)}"
            )
        with self._lock:
            done = self._steps[key] = StepRollout(result, prompts, self.generations)
            oldest = key - KEPT_STEPS * self.schedule.iterations - self.schedule.reach
            for old in [s for s in self._steps if s <= oldest]:
                self._steps.pop(old)
                self._refs.pop(old, None)
        return done

    def carried(self, step: int, next_only: bool) -> Dict[str, Any]:
        """The results a checkpoint after ``step`` carries (``WeightsSchedule.carried``), as
        plain values by generation, each asked for and waited on when not held yet: the
        same on every rank (the schedule names them, the service made them).
        ``next_only``: only the generation the next step trains on (a save under a
        preemption deadline waits for at most that one, which the next step would wait
        for anyway)."""
        plain: Dict[str, Any] = {}
        for key in self.schedule.carried(step, self.last_step):
            if next_only and key > step + 1:
                break
            held = self._steps.get(key) or self._generation(key, self.order.prompts_ahead(key))
            plain[str(key)] = result_to_plain(held.result)
        return plain

    def load_carried(self, plain: Dict[str, Any]) -> None:
        """A restored checkpoint's carried results (none: a live handover, or a
        checkpoint without them), used instead of asking the service and handed to it
        with the group's first push."""
        self._carried = {int(key): result_from_plain(value) for key, value in plain.items()}

    def target_weights(self, ids: np.ndarray) -> np.ndarray:
        """Each group's loss units: its completion tokens (``loss_type=dapo``) or its
        completions."""
        step, prompts = self.order.split(ids)
        rollout = self.step_rollout(step)
        if not self.units_are_tokens:
            return np.full(len(ids), float(self.generations))
        return np.array(
            [sum(len(c) for c in rollout.group(p).completions) for p in prompts.tolist()],
            dtype=np.float64,
        )

    def batch(self, ids: np.ndarray) -> Batch:
        """The rows of the groups ``ids`` name (module doc), with their advantages."""
        step, prompts = self.order.split(ids)
        rollout = self.step_rollout(step)
        groups = [rollout.group(p) for p in prompts.tolist()]
        prompt_ids = {p: self.records.group(p).prompt_ids for p in set(prompts.tolist())}
        batch = completion_rows(groups, prompt_ids, self.pad_id)
        advantages = torch.cat([rollout.advantages(p) for p in prompts.tolist()])
        lengths = [len(prompt_ids[p]) for p in prompts.tolist()]
        shape = (batch.targets.shape[0], batch.targets.shape[1])
        reference = old = None
        if self.kl:
            reference = logp_rows(
                _present([g.ref_logps for g in groups], "reference", "objective.grpo.beta > 0"),
                lengths,
                shape,
            )
        if self.schedule.off_policy:
            old = logp_rows(
                _present([g.policy_logps for g in groups], "generating", OFF_POLICY),
                lengths,
                shape,
            )
        batch.rollout = Rollout(advantages.float(), old_logps=old, ref_logps=reference)
        batch.indices = np.asarray(ids)
        return batch

    def max_token(self) -> int:
        return 0  # prompts are checked against the vocabulary before Ray (check_prompt_data)

    def metrics(self, step: int) -> Dict[str, float]:
        """The step's rollout in the step's record: the mean reward (and per function),
        its spread, the completions' mean length, the share cut at the limit, and the
        service's time waiting for the weights, generating and scoring."""
        result = self.step_rollout(step).result
        lengths = [len(c) for g in result.groups for c in g.completions]
        cut = [t for g in result.groups for t in g.truncated]
        fields = {
            "reward": float(torch.nanmean(result.rewards)),
            "reward_std": float(_nanstd(result.rewards)),
            "completion_length": float(np.mean(lengths)),
            "completion_clipped": float(np.mean(cut)),
            "weights_version": float(result.weights_version),
            **{f"rollout_{phase}_s": seconds for phase, seconds in result.phases_s.items()},
        }
        if len(result.function_names) > 1:
            for k, name in enumerate(result.function_names):
                fields[f"reward/{name}"] = float(torch.nanmean(result.rewards_per_function[:, k]))
        return fields

    def push_policy(
        self, strategy: Strategy, model: torch.nn.Module, version: int, rank: int, start: bool
    ) -> None:
        """The engines take the policy after step ``version``, at a sync point or at the
        group's ``start`` (``rollout.schedule``: the service then decides whether they
        keep what they hold): every rank gathers (a sharded model's full parameters are a
        collective), rank 0 sends CPU copies; the service waits for the schedule's weights
        before generating a step."""
        if version >= self.last_step or not (start or self.schedule.pushes_after(version)):
            return  # no generation takes them
        carried = list(self._carried.values()) if start else []
        if start and not self._start_needs_weights(version, rank, carried):
            return
        params = strategy.full_parameters(model)
        if rank == 0:
            self.service.load_weights.remote(to_wire(params), version, start, carried)

    def _start_needs_weights(self, version: int, rank: int, carried: List[RolloutResult]) -> bool:
        """Rank 0 begins the group's start at the service (``RolloutService.begin_start``,
        which applies it when no weights are needed) and every rank takes its answer (one
        broadcast: the gather that may follow is a collective)."""
        box: List[Optional[bool]] = [None]
        if rank == 0:
            ref = self.service.begin_start.remote(version, carried)
            box[0] = wait_for(ref, self.wait_s, "the rollout service's start")
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        return bool(box[0])


OFF_POLICY = "rollout.sync_every > 1, rollout.overlap or objective.grpo.num_iterations > 1"


def _present(
    logps: List[Optional[CompletionLogps]], policy: str, key: str
) -> List[CompletionLogps]:
    """Each group's per-token log-probs under the ``policy`` policy, which the engines add
    when ``key``."""
    if any(lp is None for lp in logps):
        raise RuntimeError(
            f"{key} but the rollout service returned completions without their {policy} "
            "policy's log-probs: its engines were started for another configuration"
        )
    return [lp for lp in logps if lp is not None]


def _nanstd(values: torch.Tensor) -> torch.Tensor:
    kept = values[~torch.isnan(values)]
    return kept.std() if kept.numel() > 1 else torch.zeros(())


def open_rollout_input(cfg) -> TrainingInput:
    """A GRPO rank's :class:`TrainingInput`: the prompts' global order by step, and the
    run's rollout service behind it."""
    from raytrain_ext.rollout.prompt_records import open_prompt_records
    from raytrain_ext.rollout.run_service import find_run_rollout

    records = open_prompt_records(cfg)
    d = cfg.data
    sampler = GlobalSampler(records.num_samples, d.global_batch_size, d.seed, d.shuffle)
    order = RolloutOrder(sampler, cfg.objective.grpo.num_iterations)
    dataset = RolloutInput(cfg, records, order, find_run_rollout(cfg.run.name))
    return TrainingInput(dataset, split_eval(cfg, dataset), order, rollout=dataset)
