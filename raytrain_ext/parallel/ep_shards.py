"""Expert parallelism: MoE experts sharded over groups of data-parallel ranks
(DeepSpeed-MoE / torchtitan), under DDP or FSDP (with or without TP).

EP reuses the data-parallel ranks.  Along each line of data-parallel ranks
(the ranks that share a pipeline stage and a TP coordinate), ``ep``
consecutive ones form an EP group; EP rank ``i`` of every group holds experts ``[i*E/ep, (i+1)*E/ep)``
under their global names (``blocks.0.ffn.experts.3.w_up``), so checkpoints
reshard by name.  The ranks of a line holding the same experts (``i, i+ep,
...``, ``dp/ep`` of them) form the expert-data-parallel (EDP) group.  Under TP
a MoE feed-forward is not split (parallel/tp.py): the ranks of a TP group hold
the same experts and see the same tokens, so each EP exchange stays within
one TP coordinate.

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
Expert parameters are excluded from DDP and FSDP (``ignored_params``), which
never see them.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.nn.functional import all_to_all_single as all_to_all_with_grad

from raytrain_ext.models.moe import Expert, MoEFeedForward
from raytrain_ext.parallel.stage_state import StageStateDict
from raytrain_ext.parallel.strategy import DistContext


def group_ranks(world_size: int, ep: int) -> Tuple[List[List[int]], List[List[int]]]:
    """(EP groups, EDP groups): consecutive blocks of ``ep`` ranks; ranks ``ep`` apart."""
    ep_groups = [list(range(start, start + ep)) for start in range(0, world_size, ep)]
    edp_groups = [list(range(offset, world_size, ep)) for offset in range(ep)]
    return ep_groups, edp_groups


def expert_group_ranks(dims, world_size: int) -> Tuple[List[List[int]], List[List[int]]]:
    """``group_ranks`` along each line of data-parallel ranks (one line per pipeline stage
    and TP coordinate), in global ranks."""
    lines: Dict[Tuple[int, int], List[int]] = {}
    for rank in range(world_size):
        lines.setdefault((dims.pp_rank(rank), dims.tp_rank(rank)), []).append(rank)
    ep_groups: List[List[int]] = []
    edp_groups: List[List[int]] = []
    for coordinate in sorted(lines):
        line = sorted(lines[coordinate], key=dims.dp_rank)
        eps, edps = group_ranks(len(line), dims.ep)
        ep_groups += [[line[i] for i in group] for group in eps]
        edp_groups += [[line[i] for i in group] for group in edps]
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

    def __call__(
        self, moe: MoEFeedForward, inputs: torch.Tensor, pair_experts: torch.Tensor
    ) -> torch.Tensor:
        owner = pair_experts // self.experts_per_rank
        order = torch.argsort(owner, stable=True)
        send = torch.bincount(owner, minlength=self.ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_splits, recv_splits = send.tolist(), recv.tolist()
        received = sum(recv_splits)
        recv_experts = pair_experts.new_empty(received)
        dist.all_to_all_single(
            recv_experts, pair_experts[order], recv_splits, send_splits, group=self.group
        )
        recv_inputs = all_to_all_with_grad(
            inputs.new_empty((received, inputs.shape[1])),
            inputs[order],
            recv_splits,
            send_splits,
            group=self.group,
        )
        outputs = moe.run_experts(recv_inputs, recv_experts)
        returned = all_to_all_with_grad(
            outputs.new_empty((len(order), outputs.shape[1])),
            outputs,
            send_splits,
            recv_splits,
            group=self.group,
        )
        return returned[torch.argsort(order)]  # back to (token, choice) order


class ExpertShards:
    """This rank's experts and the groups that move their tokens and gradients.

    Built on the unwrapped model, before DDP/FSDP: experts this rank does not
    own are deleted, each MoE layer's ``dispatch`` becomes the all-to-all, and
    ``params`` are the experts the wrapper must leave alone.
    """

    def __init__(self, model: nn.Module, ctx: DistContext):
        self.ctx = ctx
        ep_groups, edp_groups = expert_group_ranks(ctx.dims, ctx.world_size)
        self.ep_group = _new_groups(ep_groups, ctx.rank)
        self.edp_group = _new_groups(edp_groups, ctx.rank)
        ep_rank = next(g.index(ctx.rank) for g in ep_groups if ctx.rank in g)
        self.full_order = [name for name, _ in model.named_parameters()]
        for moe in (m for m in model.modules() if isinstance(m, MoEFeedForward)):
            keep = owned_experts(moe.num_experts, ctx.dims.ep, ep_rank)
            for key in [k for k in moe.experts if int(k) not in keep]:
                del moe.experts[key]
            moe.dispatch = AllToAllDispatch(self.ep_group, ctx.dims.ep, len(keep))
        self.names = sorted(name for name, _ in _expert_parameters(model))
        self.params = [p for _, p in _expert_parameters(model)]  # kept by .to(device)
        self.ids = {id(p) for p in self.params}

    def average_gradients(self) -> None:
        """Sum over the EDP group (one flat all-reduce), divide by ``dp_size`` (module doc)."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in self.params])
        if dist.get_world_size(self.edp_group) > 1:
            dist.all_reduce(flat, group=self.edp_group)
        flat /= self.ctx.dp_size
        offset = 0
        for p in self.params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def grad_norm_squared(self) -> torch.Tensor:
        """The squared norm of all experts' gradients: this rank's, summed over its EP group."""
        squares = torch.nn.utils.get_total_norm([p.grad for p in self.params]).double() ** 2
        dist.all_reduce(squares, group=self.ep_group)
        return squares

    def gather(self, params: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """``params`` with the EP group's experts added (a collective over it)."""
        own = {name: params[name].detach().cpu() for name in self.names}
        parts: List[Dict[str, torch.Tensor]] = [None] * self.ctx.dims.ep  # type: ignore[list-item]
        dist.all_gather_object(parts, own, group=self.ep_group)
        for part in parts:
            params.update(part)
        return params

    def state_dicts(self, model_sd: Dict[str, Any], optim_sd: Dict[str, Any]):
        """FQN-keyed state, each expert on its owner only, with whole-model param groups.

        As for pipeline stages (:meth:`PipelineStrategy.state_dicts`): DCP keeps
        one copy of the non-tensor param-group name lists, so every rank writes
        the whole model's lists (what a DDP checkpoint holds), and
        ``whole_model_keys`` tells the restore check that the other ranks'
        experts belong to this model.
        """
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


def _new_groups(groups: List[List[int]], rank: int):
    """Every rank creates every group, in the same order (``new_group`` is collective);
    returns this rank's."""
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def _expert_parameters(model: nn.Module):
    for module_name, module in model.named_modules():
        if isinstance(module, Expert):
            for name, p in module.named_parameters():
                yield f"{module_name}.{name}", p
