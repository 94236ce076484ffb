"""Evaluation on a held-out split, every ``eval.every_steps`` steps.

The split is ``data.eval_path`` (read like ``data.path``, same format) or the last
``eval.fraction`` of the training dataset's samples, which the sampler then never
draws (the training order is over the leading samples only, so it does not depend on
whether evaluation runs).  ``eval.max_samples`` caps each evaluation (the first ones,
in order).  Evaluation reads no sampler, ledger or RNG state and runs in eval mode
without autograd, so a run with it ends with the same parameters and sample digest as
one without.
"""

from __future__ import annotations

import math
from typing import Callable, ContextManager, Dict

import torch
import torch.distributed as dist

from raytrain_ext.data.eval_split import EvalSplit
from raytrain_ext.models.spec import batch_logits
from raytrain_ext.train.config import EvalConfig
from raytrain_ext.train.forward_only import inference, lockstep_chunks


class Evaluator:
    """The split's mean loss (per unit), perplexity for token objectives, and the
    objective's metrics, identical on every rank."""

    def __init__(
        self,
        eval_cfg: EvalConfig,
        max_steps: int,
        micro_batch_size: int,
        split: EvalSplit,
        objective,
        ctx,
        spec,
        reference,
    ):
        """``eval_cfg``: the ``eval`` section; it also runs after the last step
        (``max_steps``), ``micro_batch_size`` samples per forward."""
        self.every = eval_cfg.every_steps
        self.max_steps = max_steps
        self.micro = micro_batch_size
        self.split, self.objective, self.ctx = split, objective, ctx
        self.spec, self.reference = spec, reference

    def due(self, step: int) -> bool:
        if self.every is None or self.split.dataset is None:
            return False
        return step % self.every == 0 or step == self.max_steps

    def run(self, model: torch.nn.Module, autocast: Callable[[], ContextManager]) -> Dict:
        ctx, names, dataset = self.ctx, self.objective.metric_names, self.split.dataset
        if dataset is None:  # never due without one
            raise RuntimeError("evaluation asked of a run without an evaluation split")
        sums = torch.zeros(2 + len(names), dtype=torch.float64)
        with inference(model):
            for chunk, real in lockstep_chunks(len(self.split.indices), ctx, self.micro):
                batch = dataset.batch(self.split.indices[chunk]).to(ctx.device)
                with autocast():
                    out = batch_logits(self.spec, model, batch)
                if not (real and ctx.counts_loss):
                    continue
                reference = None
                if self.objective.uses_reference:
                    reference = self.reference.for_batch(chunk, ctx.device, held_out=True)
                terms = self.objective.loss(out, batch, reference)
                values = [terms.loss_sum, self.objective.units(batch)]
                values += [terms.metrics[name] for name in names]
                sums += torch.tensor([float(v) for v in values], dtype=torch.float64)
        sums = sums.to(ctx.device)
        if ctx.world_size > 1:
            dist.all_reduce(sums)
        sums = sums.cpu().tolist()
        units = max(sums[1], 1e-12)
        result = {"eval_loss": sums[0] / units}
        if not self.objective.uses_reference:
            result["eval_ppl"] = math.exp(min(result["eval_loss"], 50.0))
        result.update({f"eval_{n}": v / units for n, v in zip(names, sums[2:], strict=True)})
        return result
