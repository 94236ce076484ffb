"""Pipeline parallelism: a model's blocks split into stages along the ``pp`` mesh axis.

The model's spec builds each stage (``ModelSpec.pipeline_stage``): a contiguous run
of blocks (``stage_layers``), the first stage also the input layers, the last the
output ones.  Every stage is cut from the full, deterministically initialised model
and keeps its modules under their original names (``blocks.5.attn.wq.weight``), so
parameters, checkpoints and ``params_sha256`` are those of a DDP run.

Apply order (torchtitan's): split -> data parallelism per stage (FSDP2, with
optional TP, on the stage's slice of the mesh; or DDP-style averaging of the
stage's gradients over its ``dp_shard`` group) -> ``PipelineStage`` + schedule
(GPipe or 1F1B) over the ``pp`` group.  The schedule runs the step's
micro-batches itself; FSDP gradients are reduced after the last backward (the
schedule drives FSDP's gradient sync), DDP-style ones by ``average_gradients``.

Invariants the loop relies on:
- the last stage's ``loss_fn`` returns ``token-loss sum x loss_scale`` (the
  loop's normalisation) and the schedule does not rescale by the micro-batch
  count (``scale_grads=False``), so gradients equal DDP's;
- ``forward_backward`` returns the token-loss sum on the last stage and 0
  elsewhere (``DistContext.counts_loss`` reports it);
- gradient norms, full parameters and checkpoint param-group names are
  assembled over the ``pp`` group, so every stage sees whole-model values;
- a MoE block's balance loss enters the backward where it arises: the schedule
  backpropagates only from a stage's output, so the stage ties each MoE
  layer's weighted loss to its activations (``AttachAuxLoss``), with the
  weight the loop's own path gives it;
- with ``parallel.ep`` a stage's experts are split over its data-parallel
  ranks (``ExpertShards``), left out of the stage's DDP-style averaging or
  FSDP, and averaged over their expert-data-parallel group after the schedule.
"""

from __future__ import annotations

import contextlib
from typing import AbstractSet, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from raytrain_ext.models.spec import ModelSpec, PipelineStageModule
from raytrain_ext.parallel.ep_shards import ExpertShards
from raytrain_ext.parallel.grads import global_grad_norm, group_by_mesh
from raytrain_ext.parallel.stage_state import StageStateDict, whole_model_keys
from raytrain_ext.parallel.strategy import DistContext, Strategy

# keyed by ``parallel.pp_schedule``'s values (``parallel.config.PipelineSchedule``, which
# a unit test holds equal to these keys)
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class TokenLossSum:
    """The last stage's ``loss_fn``: ``token-loss sum x scale``, the loop's normalisation.

    Returned in float64, so ``forward_backward`` recovers each micro-batch's
    token-loss sum from the schedule's ``losses`` exactly (the schedule also
    calls ``loss_fn`` once for shape inference, so its calls cannot be counted);
    the gradient reaching the fp32 logits is the same fp32-rounded ``scale``
    as in the loop's own path.
    """

    def __init__(self) -> None:
        self.scale = 1.0

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        token_loss = F.cross_entropy(
            logits.float().flatten(0, 1), targets.flatten(), reduction="sum"
        )
        return token_loss.double() * self.scale


class TrainingForwardStage(PipelineStage):
    """A ``PipelineStage`` that tells its stage module which forwards train a micro-batch.

    On its first step the schedule also runs the stage on placeholder inputs to
    infer shapes; MoE bookkeeping (expert load, balance loss) must skip those.
    """

    def __init__(self, stage_module: PipelineStageModule, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stage_module = stage_module

    def forward_one_chunk(self, *args, **kwargs):
        self.stage_module.training_forward = True
        try:
            return super().forward_one_chunk(*args, **kwargs)
        finally:
            self.stage_module.training_forward = False


class PipelineStrategy(Strategy):
    """``parallel.pp > 1``: this rank's stage, data-parallel under ``inner`` (DDP or FSDP)."""

    name = "pp"
    runs_microbatches = True  # the schedule runs the step's micro-batches

    def __init__(self, parallel_cfg, spec: ModelSpec, inner: Strategy):
        super().__init__(parallel_cfg, spec)
        self.inner = inner
        # set by wrap, as are the members below and mesh (its (pp, dp_replicate, dp_shard, tp))
        self.ctx: DistContext
        self.stage: Optional[PipelineStage] = None
        self.experts: Optional[ExpertShards] = None  # parallel.ep > 1: this stage's (ep.py)
        self.loss_fn = TokenLossSum()
        self._schedules: Dict[int, object] = {}

    @property
    def pp_group(self):
        return self.mesh["pp"].get_group()

    def wrap(self, model: nn.Module, ctx: DistContext) -> nn.Module:
        self.ctx, dims = ctx, ctx.dims
        pipeline_stage = self.spec.require("pipeline_stage", "parallel.pp > 1")
        stage = pipeline_stage(model, dims.pp_rank(ctx.rank), dims.pp)
        if dims.ep > 1:  # experts split over this stage's data-parallel ranks
            self.experts = ExpertShards(stage, ctx)
        stage = self.stage_module = stage.to(ctx.device)
        if self.inner.shards_parameters:
            if self.experts is not None:
                self.inner.ignored = set(self.experts.params)
            wrapped = self.inner.wrap(stage, ctx)  # builds the 4-D mesh, shards over dp
            self.mesh = self.inner.mesh
        else:  # DDP: gradients all-reduced after the schedule (see average_gradients)
            self.mesh = dims.build_mesh(ctx.device.type)
            wrapped = stage
        self.stage = TrainingForwardStage(
            stage, wrapped, dims.pp_rank(ctx.rank), dims.pp, ctx.device, group=self.pp_group
        )
        return wrapped

    def _schedule(self, n_microbatches: int):
        if n_microbatches not in self._schedules:
            schedule_cls = SCHEDULES[self.cfg.pp_schedule]
            self._schedules[n_microbatches] = schedule_cls(
                self.stage, n_microbatches, loss_fn=self.loss_fn, scale_grads=False
            )
        return self._schedules[n_microbatches]

    def forward_backward(
        self,
        wrapped: nn.Module,
        batches: Sequence[Tuple[torch.Tensor, torch.Tensor]],
        loss_scale: float,
        autocast: Callable[[], ContextManager],
        aux_weight: float = 0.0,
    ) -> torch.Tensor:
        """Run this step's micro-batches through the schedule; the last stage's token-loss sum.

        The first stage feeds the token ids, the last the targets; the
        schedule splits both back into the same ``len(batches)`` micro-batches.
        A MoE layer's balance loss weighs ``aux_weight x its micro-batch's tokens
        x loss_scale``, as in the loop's own path.
        """
        schedule = self._schedule(len(batches))
        self.loss_fn.scale = loss_scale
        tokens_per_micro = sum(targets.numel() for _, targets in batches) / len(batches)
        self.stage_module.aux_weight = aux_weight * tokens_per_micro * loss_scale
        dims, rank = self.ctx.dims, self.ctx.rank
        losses: List[torch.Tensor] = []
        with autocast():
            if dims.is_first_stage(rank):
                schedule.step(torch.cat([inputs for inputs, _ in batches]))
            elif dims.is_last_stage(rank):
                schedule.step(
                    target=torch.cat([targets for _, targets in batches]),
                    losses=losses,
                    return_outputs=False,
                )
            else:
                schedule.step()
        if not isinstance(wrapped, FSDPModule) and self.ctx.dp_size > 1:
            average_gradients(wrapped, self.mesh["dp_shard"].get_group(), self._expert_ids())
        if self.experts is not None:
            self.experts.average_gradients()
        if not losses:
            return torch.zeros((), device=self.ctx.device, dtype=torch.float64)
        return torch.stack([loss.detach() for loss in losses]).sum() / loss_scale

    def _expert_ids(self) -> set:
        return self.experts.ids if self.experts is not None else set()

    def take_kept_tokens(self) -> Optional[torch.Tensor]:
        """MoE: tokens each expert kept in this stage's layers since the last call."""
        return self.stage_module.take_kept_tokens()

    def accumulate(self, wrapped: nn.Module, sync: bool) -> ContextManager:
        """Unused: the schedule decides when gradients are reduced (see ``forward_backward``)."""
        return contextlib.nullcontext()

    @property
    def optimizer_foreach(self) -> bool:
        """The inner layout's choice (FSDP's: the per-tensor step); plain expert tensors
        beside FSDP's DTensors need the per-tensor step too (train/optim.py)."""
        return self.inner.optimizer_foreach

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip by the whole model's norm: each stage's squared norm, summed over the pp group."""
        expert_ids = self._expert_ids()
        params = [p for p in wrapped.parameters() if p.grad is not None and id(p) not in expert_ids]
        if isinstance(wrapped, FSDPModule):
            groups = group_by_mesh(params)
            stage_norm = global_grad_norm(groups)
        else:
            groups = [params]
            stage_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        squares = stage_norm.detach().to(self.ctx.device, torch.float64) ** 2
        if self.experts is not None:  # sharded over the EP group: their squares summed over it
            squares = squares + self.experts.grad_norm_squared().to(squares.device)
            groups = groups + [self.experts.params]
        dist.all_reduce(squares, group=self.pp_group)
        total = squares.sqrt().to(torch.float32)
        if max_norm > 0:
            for group in groups:
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
        return total

    def unwrap(self, wrapped: nn.Module) -> nn.Module:
        return wrapped

    def full_parameters(self, wrapped: nn.Module) -> Dict[str, torch.Tensor]:
        """Every stage's full parameters on every rank, canonical names, on CPU (a collective)."""
        stage_params = (
            self.inner.full_parameters(wrapped)
            if isinstance(wrapped, FSDPModule)
            else dict(wrapped.named_parameters())
        )
        own = {name: p.detach().cpu() for name, p in stage_params.items()}
        if self.experts is not None:
            own = self.experts.gather(own)
        stages: List[Dict[str, torch.Tensor]] = [None] * self.ctx.dims.pp  # type: ignore[list-item]
        dist.all_gather_object(stages, own, group=self.pp_group)
        return {name: p for stage in stages for name, p in stage.items()}

    def state_dicts(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer):
        """This stage's FQN-keyed model/optimizer state, with whole-model param groups.

        DCP stores non-tensor items (the param groups' name lists) once, as if
        replicated, so every stage writes the same whole-model lists, which
        are also what a DDP checkpoint holds; ``set_state_dict`` picks this
        stage's names out of them on load.  ``whole_model_keys`` lets the
        restore check tell other stages' keys from a different model.
        """
        model_sd, optim_sd = get_state_dict(wrapped, optimizer)
        if self.experts is not None:  # first the stage's whole lists over its EP group
            model_sd, optim_sd = self.experts.state_dicts(model_sd, optim_sd)
        keys = list(whole_model_keys(model_sd))
        own = ([list(group["params"]) for group in optim_sd["param_groups"]], list(keys))
        stages: List[tuple] = [None] * self.ctx.dims.pp  # type: ignore[list-item]
        dist.all_gather_object(stages, own, group=self.pp_group)
        for index, group in enumerate(optim_sd["param_groups"]):
            group["params"] = [name for groups, _ in stages for name in groups[index]]
        stage_sd = StageStateDict(model_sd)
        stage_sd.whole_model_keys = {key for _, keys in stages for key in keys}
        return stage_sd, optim_sd


def average_gradients(stage: nn.Module, dp_group, skip: AbstractSet[int] = frozenset()) -> None:
    """DDP's gradient averaging over the stage's data-parallel group, in one flat all-reduce.

    ``DistributedDataParallel`` itself cannot wrap a stage here: the schedule's
    per-micro-batch backwards double its bucket-rebuild bookkeeping on the
    first step (torch 2.13: "rebuilt parameter indices size is not same as
    original model parameters size").  One all-reduce after the last backward
    is what DDP's ``no_sync`` accumulation does, minus the overlap.  ``skip``:
    ids of parameters averaged elsewhere (experts, over their EDP group).
    """
    grads = [p.grad for p in stage.parameters() if p.grad is not None and id(p) not in skip]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=dp_group)
    flat /= dist.get_world_size(dp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
