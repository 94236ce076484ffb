"""A step's report, as every rank builds it from the step's clock, its exchange and the
loop's counters; rank 0's goes to the controller.

Why every rank builds it: the straggler guard observes the exchanged per-rank compute
times on each rank, so each keeps the same window; only rank 0's verdict and per-rank
times leave the process.

Invariant: tokens/s and MFU count the global batch's tokens (every rank's), over the
rank's own step time.
"""

from __future__ import annotations

import time
from typing import Dict, List, Sequence

import torch

from raytrain_ext.messages import StepReport
from raytrain_ext.metrics.flops import mfu, model_flops_per_token, peak_flops_for
from raytrain_ext.metrics.memory import peak_memory_bytes
from raytrain_ext.parallel import DistContext
from raytrain_ext.train.expert_load import ExpertLoad
from raytrain_ext.train.forward_backward import ForwardBackward
from raytrain_ext.train.guards import StragglerDetector
from raytrain_ext.train.step_clock import StepClock


class StepRecorder:
    """Builds each step's :class:`StepReport` for one rank of a group."""

    def __init__(
        self,
        cfg,
        ctx: DistContext,
        compute: ForwardBackward,
        metric_names: Sequence[str],
        expert_load: ExpertLoad,
    ):
        self.ctx = ctx
        self.compute = compute  # the loop's, whose times are the step's just taken
        self.metric_names = tuple(metric_names)  # the objective's, in the exchange's order
        self.expert_load = expert_load
        self.global_tokens = cfg.data.global_batch_size * cfg.model.seq_len
        self.stragglers = StragglerDetector(
            cfg.guards.straggler_factor, cfg.guards.straggler_window
        )
        self.flops_per_token = model_flops_per_token(cfg.model)
        device = ctx.device
        self.peak_flops = (
            peak_flops_for(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        )

    def report(
        self,
        step: int,
        clock: StepClock,
        loss: float,
        lr: float,
        grad_norm: float,
        stall: float,
        exchanged,
        units: float,
    ) -> StepReport:
        """Step ``step``'s report, ``exchanged`` being its all-gather's result."""
        step_time, ctx, compute = clock.seconds, self.ctx, self.compute
        flagged = self.stragglers.observe(exchanged.compute_s)
        return StepReport(
            step=step,
            time=time.time(),
            step_time_s=step_time,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            tokens_per_s=self.global_tokens / step_time,
            compute_s=compute.compute_s,
            data_s=compute.data_s,
            ckpt_stall_s=stall,
            wait_s=max(0.0, step_time - compute.compute_s - stall),  # comm + peers
            phases_s=clock.phases(),
            world_size=ctx.world_size,
            peak_memory_gb=peak_memory_bytes(ctx.device) / 2**30,
            mfu=mfu(
                self.global_tokens / step_time,
                self.flops_per_token,
                self.peak_flops,
                ctx.world_size,
            ),
            metrics={
                **self._objective_fields(exchanged.metrics, units),
                **self.expert_load.field(exchanged.expert_tokens),
            },
            rank_compute_s=[round(s, 6) for s in exchanged.compute_s] if ctx.rank == 0 else None,
            stragglers=flagged if ctx.rank == 0 else [],
        )

    def _objective_fields(self, metric_sums: List[float], units: float) -> Dict[str, float]:
        """The objective's metrics for the step, per loss unit (DPO: accuracy, margins)."""
        return {
            name: value / units for name, value in zip(self.metric_names, metric_sums, strict=True)
        }
