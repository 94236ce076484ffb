"""Expert parallelism: MoE experts sharded over groups of DDP ranks (DeepSpeed-MoE / torchtitan).

EP reuses the data-parallel ranks.  Ranks ``[g*ep, (g+1)*ep)`` form one EP
group; EP rank ``i`` of every group holds experts ``[i*E/ep, (i+1)*E/ep)``
under their global names (``blocks.0.ffn.experts.3.w_up``), so checkpoints
reshard by name.  The ranks holding the same experts (``i, i+ep, ...``,
``world/ep`` of them) form the expert-data-parallel (EDP) group.

Per MoE forward, each rank routes its own tokens (router, top-k, capacity: as
without EP), sends every kept (token, choice) row to the expert's owner with
``all_to_all_single``, the owner runs its experts, and a second all-to-all
brings the outputs back for the gate-weighted combine.  Backward runs the
reverse all-to-alls (``torch.distributed.nn.functional``).

Gradient invariant (the update equals DDP's on the unsharded model): the loss
on every rank is scaled by ``dp_size / global_tokens`` and DDP averages the
non-expert gradients over ``dp_size`` ranks.  An expert's owner accumulates
the gradient of its EP group's tokens; summing that over the EDP group gives
the sum over all ranks, and dividing by ``dp_size`` makes it DDP's average.
Expert parameters are excluded from DDP, which never sees them.
"""

from __future__ import annotations

import contextlib
import math
from typing import Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.nn.functional import all_to_all_single as all_to_all_with_grad
from torch.nn.parallel import DistributedDataParallel

from raytrain_ext.models.moe import Expert, MoEFeedForward
from raytrain_ext.parallel.ddp import DDPStrategy
from raytrain_ext.parallel.pp import StageStateDict
from raytrain_ext.parallel.strategy import DistContext


def group_ranks(world_size: int, ep: int) -> Tuple[List[List[int]], List[List[int]]]:
    """(EP groups, EDP groups): consecutive blocks of ``ep`` ranks; ranks ``ep`` apart."""
    ep_groups = [list(range(start, start + ep)) for start in range(0, world_size, ep)]
    edp_groups = [list(range(offset, world_size, ep)) for offset in range(ep)]
    return ep_groups, edp_groups


def owned_experts(num_experts: int, ep: int, ep_rank: int) -> range:
    per_rank = num_experts // ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


class AllToAllDispatch:
    """``MoEFeedForward.dispatch`` for sharded experts: rows to their owners and back."""

    def __init__(self, group, ep: int, experts_per_rank: int):
        self.group = group
        self.ep = ep
        self.experts_per_rank = experts_per_rank

    def __call__(self, moe: MoEFeedForward, inputs: torch.Tensor,
                 pair_experts: torch.Tensor) -> torch.Tensor:
        owner = pair_experts // self.experts_per_rank
        order = torch.argsort(owner, stable=True)
        send = torch.bincount(owner, minlength=self.ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_splits, recv_splits = send.tolist(), recv.tolist()
        received = sum(recv_splits)
        recv_experts = pair_experts.new_empty(received)
        dist.all_to_all_single(recv_experts, pair_experts[order], recv_splits, send_splits,
                               group=self.group)
        recv_inputs = all_to_all_with_grad(inputs.new_empty((received, inputs.shape[1])),
                                           inputs[order], recv_splits, send_splits,
                                           group=self.group)
        outputs = moe.run_experts(recv_inputs, recv_experts)
        returned = all_to_all_with_grad(outputs.new_empty((len(order), outputs.shape[1])),
                                        outputs, send_splits, recv_splits, group=self.group)
        return returned[torch.argsort(order)]  # back to (token, choice) order


class ExpertParallelStrategy(DDPStrategy):
    """DDP for the dense parameters; experts sharded over ``parallel.ep`` ranks."""

    name = "ddp"

    def wrap(self, model: nn.Module, ctx: DistContext) -> nn.Module:
        ep = ctx.dims.ep
        self.ctx = ctx
        self.ep_group, self.edp_group = self._new_groups(ctx.world_size, ep, ctx.rank)
        self.full_order = [name for name, _ in model.named_parameters()]
        for moe in (m for m in model.modules() if isinstance(m, MoEFeedForward)):
            keep = owned_experts(moe.num_experts, ep, ctx.rank % ep)
            for key in [k for k in moe.experts if int(k) not in keep]:
                del moe.experts[key]
            moe.dispatch = AllToAllDispatch(self.ep_group, ep, len(keep))
        model = model.to(ctx.device)
        self.expert_names = sorted(name for name, _ in _expert_parameters(model))
        self.expert_params = [p for _, p in _expert_parameters(model)]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, self.expert_names)
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)

    @staticmethod
    def _new_groups(world_size: int, ep: int, rank: int):
        """Every rank creates every group, in the same order (``new_group`` is collective)."""
        ep_groups, edp_groups = group_ranks(world_size, ep)
        mine = {}
        for kind, groups in (("ep", ep_groups), ("edp", edp_groups)):
            for ranks in groups:
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine[kind] = group
        return mine["ep"], mine["edp"]

    @contextlib.contextmanager
    def accumulate(self, wrapped: nn.Module, sync: bool) -> Iterator[None]:
        """DDP's accumulation for dense grads; expert grads averaged after the sync backward."""
        with super().accumulate(wrapped, sync):
            yield
        if sync:
            self._average_expert_gradients()

    def _average_expert_gradients(self) -> None:
        """Sum over the EDP group (one flat all-reduce), divide by ``dp_size`` (module doc)."""
        for p in self.expert_params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in self.expert_params])
        if dist.get_world_size(self.edp_group) > 1:
            dist.all_reduce(flat, group=self.edp_group)
        flat /= self.ctx.dp_size
        offset = 0
        for p in self.expert_params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float) -> torch.Tensor:
        """The norm of the whole model's gradient: dense grads are replicated, expert
        grads are sharded over the EP group, so their squares are summed over it."""
        expert_ids = {id(p) for p in self.expert_params}
        params = [p for p in wrapped.module.parameters() if p.grad is not None]
        dense = [p.grad for p in params if id(p) not in expert_ids]
        experts = [p.grad for p in params if id(p) in expert_ids]
        expert_sq = torch.nn.utils.get_total_norm(experts).double() ** 2
        dist.all_reduce(expert_sq, group=self.ep_group)
        total = torch.sqrt(torch.nn.utils.get_total_norm(dense).double() ** 2 + expert_sq).float()
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def full_parameters(self, wrapped: nn.Module) -> Dict[str, torch.Tensor]:
        """Every parameter under its global name: the EP group's experts gathered."""
        params = {name: p.detach() for name, p in wrapped.module.named_parameters()}
        own = {name: params[name].cpu() for name in self.expert_names}
        parts: List[Dict[str, torch.Tensor]] = [None] * self.ctx.dims.ep  # type: ignore[list-item]
        dist.all_gather_object(parts, own, group=self.ep_group)
        for part in parts:
            params.update(part)
        return params

    def state_dicts(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer):
        """FQN-keyed state, each expert on its owner only, with whole-model param groups.

        As for pipeline stages (:meth:`PipelineStrategy.state_dicts`): DCP keeps
        one copy of the non-tensor param-group name lists, so every rank writes
        the whole model's lists (what a DDP checkpoint holds), and
        ``whole_model_keys`` tells the restore check that the other ranks'
        experts belong to this model.
        """
        model_sd, optim_sd = get_state_dict(wrapped, optimizer)
        own = ([list(group["params"]) for group in optim_sd["param_groups"]], list(model_sd))
        parts: List[tuple] = [None] * self.ctx.dims.ep  # type: ignore[list-item]
        dist.all_gather_object(parts, own, group=self.ep_group)
        rank_of = {name: i for i, name in enumerate(self.full_order)}
        for index, group in enumerate(optim_sd["param_groups"]):
            names = {name for groups, _ in parts for name in groups[index]}
            group["params"] = sorted(names, key=lambda name: rank_of.get(name, math.inf))
        sharded_sd = StageStateDict(model_sd)
        sharded_sd.whole_model_keys = {key for _, keys in parts for key in keys}
        return sharded_sd, optim_sd


def _expert_parameters(model: nn.Module):
    for module_name, module in model.named_modules():
        if isinstance(module, Expert):
            for name, p in module.named_parameters():
                yield f"{module_name}.{name}", p
