"""The one small all-gather per step that keeps every rank's bookkeeping identical.

Payload per rank (float64): ``[loss sum, votes..., objective metric sums..., kept
tokens per expert (MoE only)..., sample indices padded with -1]``.  Every rank gets
the consumed indices, the global loss sum, the max over ranks of the checkpoint votes
(so all take the same save decision), every rank's compute time (for the straggler
guard), the max of the pause votes (so all stop at the same step boundary), the
global objective metric sums and the global kept tokens per expert (float64:
exact below 2**53).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import numpy as np
import torch
import torch.distributed as dist


@dataclass
class Exchanged:
    """What one step's all-gather tells every rank."""

    consumed: np.ndarray
    loss_sum: float
    request: float
    busy: float
    compute_s: List[float]
    pause: float  # > 0: some rank was asked to pause at this step's boundary
    metrics: List[float]  # the objective's metric sums over all ranks
    expert_tokens: List[float]  # summed over ranks; empty unless MoE


def exchange(
    ctx,
    local: np.ndarray,
    max_local: int,
    loss_sum: torch.Tensor,
    votes: Sequence[float],
    metrics: Sequence[float],
    expert_tokens: Sequence[float],
) -> Exchanged:
    """All-gather this rank's step facts; ``votes`` are (save request, save busy, compute s,
    pause).

    One rank per data-parallel group reports its samples (``counts_samples``), one
    (the last stage) its loss and metric sums (``counts_loss``).
    """
    n_votes, n_metrics = len(votes), len(metrics)
    head = 1 + n_votes + n_metrics + len(expert_tokens)
    payload = torch.full((head + max_local,), -1.0, dtype=torch.float64)
    metric_values = list(metrics) if ctx.counts_loss else [0.0] * n_metrics
    payload[1:head] = torch.tensor([*votes, *metric_values, *expert_tokens], dtype=torch.float64)
    if ctx.counts_samples:
        payload[head : head + len(local)] = torch.from_numpy(local.astype(np.float64))
    payload = payload.to(ctx.device)
    payload[0] = loss_sum if ctx.counts_loss else 0.0
    gathered = torch.empty(ctx.world_size * payload.numel(), dtype=torch.float64, device=ctx.device)
    _all_gather_flat(gathered, payload)
    gathered = gathered.view(ctx.world_size, -1).cpu()
    indices = gathered[:, head:].flatten()
    first_metric = 1 + n_votes
    return Exchanged(
        consumed=indices[indices >= 0].to(torch.int64).numpy(),
        loss_sum=float(gathered[:, 0].sum()),
        request=gathered[:, 1].max().item(),
        busy=gathered[:, 2].max().item(),
        compute_s=gathered[:, 3].tolist(),
        pause=gathered[:, 4].max().item(),
        metrics=gathered[:, first_metric : first_metric + n_metrics].sum(dim=0).tolist(),
        expert_tokens=gathered[:, first_metric + n_metrics : head].sum(dim=0).tolist(),
    )


def _all_gather_flat(output: torch.Tensor, tensor: torch.Tensor) -> None:
    """``all_gather_single`` (torch >= 2.13) or its older name."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor)
