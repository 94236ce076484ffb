"""One step's forward and backward over this rank's micro-batches: the step's compute.

Either the loop's own micro-batch loop (gradient accumulation, one synchronising
backward on the last micro-batch) or, for a strategy that ``runs_microbatches`` (a
pipeline schedule), the strategy's.  It also keeps what the step's record needs from
that part: the time spent waiting for data, this rank's own compute time before it can
wait for a peer, and the objective's metric sums.

Loss normalisation (see :mod:`raytrain_ext.train.loop`): each micro-batch contributes its
objective's loss sum times ``dp_size / units``, ``units`` being the whole global batch's
loss units, so the update is the same for any world size.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, ContextManager, List, Optional

import numpy as np
import torch

from raytrain_ext.data.batch import Batch
from raytrain_ext.data.prefetch import BatchPrefetcher
from raytrain_ext.faults import FaultInjector
from raytrain_ext.models.moe import moe_aux_loss
from raytrain_ext.models.spec import ModelSpec, batch_logits
from raytrain_ext.objectives.base import Objective
from raytrain_ext.parallel import DistContext
from raytrain_ext.parallel.strategy import Strategy
from raytrain_ext.train.expert_load import ExpertLoad
from raytrain_ext.train.reference import ReferenceLogps


class ForwardBackward:
    """The compute of one step on one rank (module doc).  After ``run``: ``compute_s``,
    ``data_s`` and ``metric_sums`` describe that step."""

    def __init__(
        self,
        cfg: Any,
        ctx: DistContext,
        strategy: Strategy,
        spec: ModelSpec,
        objective: Objective,
        prefetch: BatchPrefetcher,
        expert_load: ExpertLoad,
        moe_layers: List[torch.nn.Module],
        faults: FaultInjector,
        mark: Callable[[str], None],
        reference: Optional[ReferenceLogps] = None,
    ):
        self.ctx, self.strategy, self.spec, self.objective = ctx, strategy, spec, objective
        self.prefetch, self.expert_load, self.moe_layers = prefetch, expert_load, moe_layers
        self.faults, self.mark, self.reference = faults, mark, reference
        self.micro = cfg.data.micro_batch_size
        self.aux_weight = cfg.model.moe.aux_loss_weight
        self.compute_s = 0.0
        self.data_s = 0.0
        self.metric_sums: List[float] = []

    def begin(self) -> None:
        """A new step: no data waited for, no metric summed yet."""
        self.data_s = 0.0
        self.metric_sums = [0.0] * len(self.objective.metric_names)

    def micro_batches(self, local: np.ndarray) -> List[np.ndarray]:
        return [local[i : i + self.micro] for i in range(0, len(local), self.micro)]

    def fetch(self, indices: np.ndarray) -> Batch:
        """A micro-batch on this rank's device; the time this step waited for it adds to
        ``data_s`` (the input pipeline's cost; usually assembled ahead by
        :class:`BatchPrefetcher` while the previous micro-batch computed)."""
        start = time.perf_counter()
        batch = self.prefetch.take(indices).to(self.ctx.device)
        self.data_s += time.perf_counter() - start
        return batch

    def autocast(self) -> ContextManager:
        if self.ctx.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=self.ctx.autocast_dtype)

    def settle(self, model: torch.nn.Module, local: np.ndarray) -> None:
        """``Strategy.settle`` on this rank's first micro-batch of ``local`` (every rank of
        the group calls it: DDP's backward is a collective)."""
        batch = self.fetch(self.micro_batches(local)[0])

        def forward() -> torch.Tensor:
            with self.autocast():
                return batch_logits(self.spec, model, batch)

        self.strategy.settle(model, forward)

    def run(
        self, model: torch.nn.Module, local: np.ndarray, units: float, start: float, step: int
    ) -> torch.Tensor:
        """Accumulate gradients over this rank's micro-batches of step ``step + 1``; return
        its loss sum.  ``compute_s`` becomes the time from ``start`` to the synchronising
        backward: this rank's own work, before it can wait for any peer."""
        chunks = self.micro_batches(local)
        scale = self.ctx.dp_size / units
        if self.strategy.runs_microbatches:  # a pipeline schedule: compute_s includes waiting
            batches = [self.fetch(i) for i in chunks]
            loss_sum = self.strategy.forward_backward(
                model,
                [(b.inputs, b.targets) for b in batches],
                scale,
                self.autocast,
                aux_weight=self.aux_weight,
            )
            self.expert_load.tokens = self.strategy.take_kept_tokens()
            self.compute_s = time.perf_counter() - start
            return loss_sum
        self.expert_load.tokens = None  # a rolled-back step's counts do not carry over
        loss_sum = torch.zeros((), device=self.ctx.device, dtype=torch.float64)
        for j, indices in enumerate(chunks):
            batch = self.fetch(indices)
            sync = j == len(chunks) - 1
            with self.strategy.accumulate(model, sync=sync):
                loss, terms = self._micro_batch_loss(model, batch, scale)
                loss = self.faults.on_loss(step + 1, loss)
                if sync:  # the gradient all-reduce: from here on this rank waits for its peers
                    self.compute_s = time.perf_counter() - start
                    self.mark("exchange")
                self.strategy.backward(model, loss)
            loss_sum += terms.loss_sum.detach()
        return loss_sum

    def _micro_batch_loss(self, model: torch.nn.Module, batch: Batch, scale: float):
        """The scaled loss to back-propagate (with the MoE auxiliary loss) and the
        objective's terms; adds the terms' metric sums to the step's."""
        with self.autocast():
            logits = batch_logits(self.spec, model, batch)
        reference = None
        if self.reference is not None:
            reference = self.reference.for_batch(batch.indices, self.ctx.device)
        terms = self.objective.loss(logits, batch, reference)
        for k, name in enumerate(self.objective.metric_names):
            self.metric_sums[k] += float(terms.metrics[name])
        loss = terms.loss_sum * scale
        aux = moe_aux_loss(self.moe_layers)
        if aux is not None:
            loss = loss + self.aux_weight * aux * (batch.targets.numel() * scale)
            self.expert_load.count()
        return loss, terms
