"""The per-worker training loop (one instance per rank, inside a worker actor).

Per step: take the step's global batch from the sampler, run this rank's slice
as micro-batches (gradient accumulation, one synchronised backward), clip,
step the optimizer and the LR schedule, then exchange the consumed sample
indices and loss sums with one small all-gather so every rank records the same
sample ledger.

Loss normalisation: the objective (:mod:`raytrain_ext.objectives`) returns a loss
*sum* per micro-batch; each contributes ``loss sum * dp_size / global units``, where
the global units (counted target tokens, or preference pairs) are those of the whole
global batch, known to every rank from the sampler before any forward (dp_size =
world_size unless parallel.tp > 1).  DDP and FSDP average gradients over ``dp_size``,
so the update is the gradient of the mean loss per unit over the *global* batch,
identical for any world size up to float summation order.

The loop orchestrates named parts: ``ForwardBackward`` (the step's compute over its
micro-batches, :mod:`.forward_backward`), ``Handover`` (what this rank keeps for the next
group, :mod:`.handover`), the data (sampler, prefetcher), the checkpoint manager, the
guards and the evaluator; it owns the order of a step and the step's record.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
import torch

from raytrain_ext.checkpoint.held_chunks import HeldChunks
from raytrain_ext.checkpoint.manager import REQUEST_EMERGENCY, CheckpointManager, SaveRequests
from raytrain_ext.checkpoint.train_state import Progress, TrainState
from raytrain_ext.data import rank_slice
from raytrain_ext.data.prefetch import BatchPrefetcher
from raytrain_ext.errors.text import is_peer_loss
from raytrain_ext.faults import FaultInjector
from raytrain_ext.messages import FitResult, StepReport
from raytrain_ext.models import model_spec
from raytrain_ext.models.moe import moe_layers
from raytrain_ext.objectives import build_objective
from raytrain_ext.parallel import DistContext, dims_for_run
from raytrain_ext.parallel.dims import holds_own_shards
from raytrain_ext.parallel.registry import build_strategy
from raytrain_ext.train.evaluation import Evaluator
from raytrain_ext.train.exchange import exchange
from raytrain_ext.train.expert_load import ExpertLoad
from raytrain_ext.train.forward_backward import ForwardBackward
from raytrain_ext.train.guards import StepAction
from raytrain_ext.train.handover import Handover
from raytrain_ext.train.ledger import SampleLedger, params_sha256
from raytrain_ext.train.live_state import LiveState
from raytrain_ext.train.nonfinite import NonFiniteGuard
from raytrain_ext.train.optim import build_optimizer, build_scheduler
from raytrain_ext.train.profiler import StepProfiler
from raytrain_ext.train.reference import ReferenceLogps, compute_logps
from raytrain_ext.train.run_input import open_run_input
from raytrain_ext.train.seeding import seed_everything, step_seed
from raytrain_ext.train.step_clock import StepClock
from raytrain_ext.train.step_record import StepRecorder
from raytrain_ext.typed_config.serialize import config_digest
from raytrain_ext.user_code import UserCode

Report = Callable[[StepReport], None]


def autocast_dtype(mixed_precision: str, device: torch.device) -> Optional[torch.dtype]:
    if mixed_precision == "bf16" or (mixed_precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


class TrainLoop:
    """Owns model, optimizer, schedule, sampler and ledger for one rank."""

    def __init__(
        self,
        cfg,
        rank: int,
        world_size: int,
        local_rank: int,
        device: torch.device,
        report: Report,
        requests: Optional[SaveRequests] = None,
        faults: Optional[FaultInjector] = None,
        mark: Callable[[str], None] = lambda phase: None,
        user: UserCode = UserCode(),
        live: Optional[LiveState] = None,
        held: Optional[HeldChunks] = None,
    ):
        """``live``: this process's state from its previous group, offered to the new
        group's ranks (:mod:`raytrain_ext.train.live_state`); ``held``: its own shards
        from that group, which a checkpoint restore of their step copies instead of
        reading (:mod:`raytrain_ext.checkpoint.held_chunks`)."""
        self.cfg = cfg
        self.report = report
        self.mark = mark  # phase marks let the controller tell a hung rank from its waiting peers
        self.ctx = DistContext(
            rank,
            world_size,
            local_rank,
            device,
            autocast_dtype(cfg.parallel.mixed_precision, device),
            dims=dims_for_run(cfg, world_size),
        )
        seed_everything(cfg.run.seed + rank, device)
        self.build_marks: Dict[str, float] = {}  # RankLoop's: this group's start, by part
        self.objective = build_objective(cfg.objective, cfg.data.format, user.loss_fn)
        self._open_data(cfg)
        self.build_marks["data_opened_at"] = time.time()
        self._build_model(cfg, user.model)
        self.build_marks["model_built_at"] = time.time()
        self.reference = ReferenceLogps() if self.objective.uses_reference else None
        self._build_state(cfg)
        self.requests = requests or SaveRequests()
        self.faults = faults or FaultInjector.disarmed(cfg.chaos, rank)
        self._build_step_parts(cfg)
        self.handover = Handover(cfg, self.ctx)
        self.preempted_at: Optional[int] = None
        self.paused_at: Optional[int] = None
        self._resume(cfg, live, held)
        if self.progress.step < cfg.run.max_steps and not self.strategy.runs_microbatches:
            # the wrapper settles on the next step's first micro-batch (DDP: its buckets)
            upcoming = self.sampler.peek_global_batch()
            self.compute.settle(
                self.model, rank_slice(upcoming, self.ctx.dp_rank, self.ctx.dp_size)
            )

    def _build_state(self, cfg) -> None:
        """What a checkpoint and a live handover carry (``TrainState``), and the largest
        slice of a global batch this rank takes."""
        self.ledger = SampleLedger()
        self.progress = Progress()
        self.max_local = math.ceil(cfg.data.global_batch_size / self.ctx.dp_size)
        self.config_digest = config_digest(cfg)
        self.state = TrainState(
            self.strategy,
            self.model,
            self.optimizer,
            self.scheduler,
            self.sampler,
            self.ledger,
            self.ctx,
            self.config_digest,
            self.progress,
            self.reference,
            self.rollout,
        )

    def _build_step_parts(self, cfg) -> None:
        """The step's compute, its report (straggler guard, FLOPs accounting) and profiler."""
        self.compute = ForwardBackward(
            cfg,
            self.ctx,
            self.strategy,
            self.spec,
            self.objective,
            self.prefetch,
            self.expert_load,
            self.moe_layers,
            self.faults,
            self.mark,
            self.reference,
        )
        self._first_report = True
        self._reported_s = 0.0  # the last step's reporting, after its clock stopped
        self.recorder = StepRecorder(
            cfg, self.ctx, self.compute, self.objective.metric_names, self.expert_load
        )
        self.profiler = StepProfiler(cfg.profile, self.ctx.rank, self.ctx.device)

    def _resume(self, cfg, live: Optional[LiveState], held: Optional[HeldChunks]) -> None:
        """Where the run stands: the live ranks' state, else the newest usable checkpoint,
        else the start; then what depends on the restored weights (DPO's reference
        log-probs, the evaluator)."""
        self.ckpt: Optional[CheckpointManager] = None
        if cfg.checkpoint.enabled:
            self._open_checkpoints(cfg)
        self.build_marks["restore_started_at"] = time.time()
        self.restored = self.handover.restore(self.state, live)
        if self.restored is None and self.ckpt is not None:
            self.restored = self.ckpt.restore(self.state, held=held)
        self.build_marks["restored_at"] = time.time()
        self._push_policy(start=True)
        self.nonfinite = NonFiniteGuard(cfg.guards, self.state, self.ckpt)
        if self.reference is not None and not self.reference.ready:
            self._compute_reference(self.reference)
        self.evaluator = Evaluator(
            cfg.eval,
            cfg.run.max_steps,
            cfg.data.micro_batch_size,
            self.eval_split,
            self.objective,
            self.ctx,
            self.spec,
            self.reference,
        )

    def _open_data(self, cfg) -> None:
        """The dataset, the evaluation split, and the global order over the training
        samples (:mod:`raytrain_ext.data.training_input`); the batch prefetcher."""
        data = open_run_input(cfg, (self.ctx.dp_rank, self.ctx.dp_size))
        self.dataset, self.eval_split, self.sampler = data.dataset, data.eval_split, data.order
        self.rollout = data.rollout  # GRPO: where the policy goes after each update
        self.prefetch = BatchPrefetcher(self.dataset.batch, cfg.data.prefetch)

    def _compute_reference(self, reference: ReferenceLogps) -> None:
        """DPO: the starting weights' log-probs of every training and evaluation sample,
        before step 1 (:mod:`raytrain_ext.train.reference`)."""
        micro, split = self.cfg.data.micro_batch_size, self.eval_split
        args = (self.ctx, micro, self.compute.autocast)
        reference.train = compute_logps(
            self.model,
            self.spec,
            self.dataset,
            np.arange(split.train_samples),
            *args,
        )
        if split.dataset is not None:
            reference.held_out = compute_logps(
                self.model, self.spec, split.dataset, split.indices, *args
            )

    def _build_model(self, cfg, model_factory: Any) -> None:
        """Spec -> strategy -> placed model (pretrained weights in) -> optimizer, scheduler;
        ``prepare`` last, for a strategy that builds its engine around our optimizer."""
        self.spec = model_spec(cfg.model, model_factory)
        self.strategy = build_strategy(cfg.parallel, self.spec)
        module = self.strategy.build_model(cfg.model, cfg.run.seed)
        self.model = self.strategy.wrap(module, self.ctx)
        if self.spec.load_pretrained is not None:  # each rank reads what it holds
            self.spec.load_pretrained(self.model, cfg.model)
        self.optimizer = build_optimizer(
            self.model, cfg.optim, foreach=self.strategy.optimizer_foreach
        )
        self.scheduler = build_scheduler(self.optimizer, cfg.optim)
        self.model = self.strategy.prepare(self.model, self.optimizer, cfg)
        self.moe_layers = moe_layers(self.strategy.unwrap(self.model))  # empty when dense
        self.expert_load = ExpertLoad(self.moe_layers, cfg.model.moe.num_experts, self.ctx.rank)

    def _open_checkpoints(self, cfg) -> None:
        """The checkpoint manager, its tiers probed (restoring is ``__init__``'s choice)."""
        ctx = self.ctx
        self.ckpt = CheckpointManager(
            cfg.checkpoint,
            cfg.run.name,
            ctx.rank,
            ctx.world_size,
            ctx.local_rank,
            self.config_digest,
            stall_s=self.faults.save_stall_s,
            own_shards=holds_own_shards(cfg.parallel),
        )
        for tier in self.ckpt.tiers:
            tier.probe()

    def fit(self) -> FitResult:
        """Train until ``run.max_steps``; return this rank's final digests."""
        last_loss = float("nan")
        try:
            while (
                self.progress.step < self.cfg.run.max_steps
                and self.preempted_at is None
                and self.paused_at is None
            ):
                self.profiler.step_begin(self.progress.step + 1)
                last_loss = self.train_step()
                self.profiler.step_end(self.progress.step)
        except BaseException as e:
            # a save in flight waits in collectives with the lost peer (up to
            # checkpoint.timeout_s): leave it behind; a rank's own error lets it finish
            if self.ckpt is not None and not is_peer_loss(e):
                self.ckpt.close()
            raise
        finally:
            self.profiler.close()
            self.prefetch.close()
        if self.ckpt is not None:
            self.ckpt.close()
        params = self.strategy.full_parameters(self.model)
        return FitResult(
            rank=self.ctx.rank,
            steps=self.progress.step,
            final_loss=last_loss,
            params_sha256=params_sha256(params),
            samples_digest=self.ledger.digest,
            samples_consumed=self.ledger.samples,
            stream_fingerprint=self.sampler.fingerprint,
            restored=self.restored,
            preempted_at=self.preempted_at,
            paused_at=self.paused_at,
            checkpoint=self.ckpt.stats if self.ckpt else None,
        )

    def train_step(self) -> float:
        """One step, in order: take the batch, forward/backward, exchange (loss, votes,
        per-rank compute), the guarded update, the checkpoint, the report."""
        clock = StepClock(self._reported_s)
        self._reported_s = 0.0
        step = self.progress.step
        self.mark("compute")
        global_batch, local, units = self._take_batch(step)
        clock.lap("data")  # the sampler and the dataset (GRPO: the step's rollout)
        self.compute.begin()
        lr = self.scheduler.get_last_lr()[0]
        skip_batch = step in self.progress.skip_steps  # rolled back past it: consume, do not train
        loss_sum, grad_norm = self._forward_backward(step, local, units, skip_batch, clock)
        exchanged = self._exchange(local, loss_sum, clock)
        loss = exchanged.loss_sum / units
        decision = self.nonfinite.decide(step, loss, float(grad_norm), exchanged.consumed)
        clock.lap("bookkeeping")
        skipped = skip_batch or decision.action != StepAction.OK
        self._update(step, not skipped, exchanged.consumed, clock)
        rolled_back = decision.action == StepAction.ROLLBACK and self.nonfinite.rollback(step)
        self.handover.at_boundary()
        if self.rollout is not None:
            clock.lap("bookkeeping")
            self._push_policy(start=False)
            clock.lap("weights_sync")
        if rolled_back:
            return loss
        stall = self._checkpoint(exchanged, clock)
        clock.stop()
        report = self.recorder.report(  # the step just taken: progress counts it now
            self.progress.step,
            clock,
            loss,
            lr,
            float(grad_norm),
            stall,
            exchanged,
            units,
        )
        report.skipped = skipped
        self._report_step(report, clock)
        return loss

    def _push_policy(self, start: bool) -> None:
        """GRPO: the rollout engines take the weights of this step boundary (the group's
        ``start``, or after an update at a sync point)."""
        if self.rollout is not None:
            step, rank = self.progress.step, self.ctx.rank
            self.rollout.push_policy(self.strategy, self.model, step, rank, start)

    def _take_batch(self, step: int) -> Tuple[np.ndarray, np.ndarray, float]:
        """The step's global batch, this rank's slice and the batch's loss units; the
        next step's slice, if the run has one, is prefetched meanwhile."""
        ctx = self.ctx
        seed_everything(step_seed(self.cfg.run.seed, step, ctx.rank), ctx.device)
        self.handover.batch_taken(self.sampler)
        self.mark("data")  # a stream's reader, GRPO's rollout: waiting, not hung
        global_batch = self.sampler.next_global_batch()
        local = rank_slice(global_batch, ctx.dp_rank, ctx.dp_size)
        chunks = self.compute.micro_batches(local)
        if step + 1 < self.cfg.run.max_steps:
            upcoming = rank_slice(self.sampler.peek_global_batch(), ctx.dp_rank, ctx.dp_size)
            chunks += self.compute.micro_batches(upcoming)
        self.prefetch.ahead(chunks)
        units = max(float(self.dataset.target_weights(global_batch).sum()), 1e-12)
        self.mark("compute")
        return global_batch, local, units

    def _forward_backward(
        self, step: int, local: np.ndarray, units: float, skip_batch: bool, clock: StepClock
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """This rank's loss sum and the clipped gradient norm (zeros for a skipped batch)."""
        compute = self.compute
        if skip_batch:
            compute.compute_s = 0.0
            return torch.zeros((), dtype=torch.float64), torch.zeros(())
        self.faults.before_compute()
        clock.lap("bookkeeping")
        loss_sum = compute.run(self.model, local, units, clock.start, step)
        clock.lap("forward_backward")
        clock.move(compute.data_s, "forward_backward", "data")
        self.mark("compute")
        grad_norm = self.strategy.clip_grad_norm(self.model, self.cfg.optim.grad_clip)
        clock.lap("optimizer")
        return loss_sum, grad_norm

    def _exchange(self, local: np.ndarray, loss_sum: torch.Tensor, clock: StepClock):
        """One collective: the loss sum, the save and pause votes, each rank's compute
        time, the objective's metric sums and the experts' token counts."""
        vote = self.requests.vote()
        if self.ckpt is not None:
            vote = max(vote, self.ckpt.request_flag())
        busy = float(self.ckpt is not None and self.ckpt.busy())
        self.mark("exchange")
        clock.lap("bookkeeping")
        exchanged = exchange(
            self.ctx,
            local,
            self.max_local,
            loss_sum,
            (vote, busy, self.compute.compute_s, self.requests.pause_vote()),
            self.compute.metric_sums,
            self.expert_load.take(),
        )
        clock.lap("exchange")
        return exchanged

    def _update(self, step: int, apply: bool, consumed, clock: StepClock) -> None:
        """The optimizer step (only when ``apply``: a skipped or non-finite step consumes
        its batch without training on it), the schedule, the ledger; the step is done."""
        if self.ckpt is not None:  # the last per-step snapshot committed before the update
            clock.lap("bookkeeping")
            self.ckpt.before_update()  # may fail the step: the state is still at the boundary
            clock.lap("checkpoint")
        self.handover.updating()
        if apply:
            self.strategy.step(self.model, self.optimizer)
        self.scheduler.step()
        self.strategy.zero_grad(self.model, self.optimizer)
        clock.lap("optimizer")
        self.ledger.record(step, consumed)
        self.progress.step += 1

    def _checkpoint(self, exchanged, clock: StepClock) -> float:
        """A pause or preemption the ranks voted for, and the save due after this step;
        the save's stall."""
        if exchanged.pause > 0:
            self.paused_at = self.progress.step
        stall = 0.0
        clock.lap("bookkeeping")
        if self.ckpt is not None:
            stall = self.ckpt.after_step(
                self.state,
                self.progress.step,
                self.handover.save_request(exchanged.request, self.paused_at is not None),
                exchanged.busy > 0,
                final=self.progress.step == self.cfg.run.max_steps,
                deadline=self.requests.deadline,
            )
            clock.lap("checkpoint")
        if exchanged.request >= REQUEST_EMERGENCY:
            self.preempted_at = self.progress.step
        return stall

    def _report_step(self, report: StepReport, clock: StepClock) -> None:
        """Add the step's rollback note, evaluation and restore facts to its report and
        send it; the time this takes, evaluation aside, is the next step's bookkeeping."""
        report.rolled_back, self.nonfinite.rollback_note = self.nonfinite.rollback_note, None
        evaluated_s = 0.0
        if self.evaluator.due(self.progress.step):
            evaluated_s = time.perf_counter()
            report.metrics.update(self.evaluator.run(self.model, self.compute.autocast))
            evaluated_s = time.perf_counter() - evaluated_s
        if self.rollout is not None:
            report.metrics.update(self.rollout.metrics(self.progress.step))
        if self._first_report:  # tells the controller where this group resumed from
            report.first_of_group, report.restored = True, self.restored
            self._first_report = False
        self.report(report)
        self.faults.after_step(self.progress.step, self.mark)
        self._reported_s = clock.since_stop() - evaluated_s

    @property
    def finished(self) -> bool:
        """The run is complete: every step done, not stopped by a pause or a preemption
        (then no group comes after this one)."""
        return (
            self.progress.step >= self.cfg.run.max_steps
            and self.preempted_at is None
            and self.paused_at is None
        )

    def live_state(self) -> Optional[LiveState]:
        """This rank's state at the last step boundary, for the next group (``Handover``)."""
        return self.handover.live_state(self.state)

    def held_chunks(self) -> Optional[HeldChunks]:
        """This rank's own shards at the last step boundary (``Handover``)."""
        return self.handover.held_chunks(self.state)
