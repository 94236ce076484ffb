"""The per-worker training loop (one instance per rank, inside a worker actor).

Per step: take the step's global batch from the sampler, run this rank's slice
as micro-batches (gradient accumulation, one synchronised backward), clip,
step the optimizer and the LR schedule, then exchange the consumed sample
indices and loss sums with one small all-gather so every rank records the same
sample ledger.

Loss normalisation: each micro-batch contributes ``sum of token losses *
world_size / global_tokens``; DDP averages gradients over ``world_size``, so
the update is the gradient of the mean token loss over the *global* batch,
identical for any world size up to float summation order.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import threading
import time
from typing import Any, Callable, Dict, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from raytrain_ext.checkpoint.manager import REQUEST_EMERGENCY, CheckpointManager, SaveRequests
from raytrain_ext.config import config_digest
from raytrain_ext.data import GlobalSampler, open_token_dataset, rank_slice
from raytrain_ext.models import build_model
from raytrain_ext.parallel import DistContext, build_strategy
from raytrain_ext.train.ledger import SampleLedger, params_sha256
from raytrain_ext.train.optim import build_optimizer, build_scheduler

Report = Callable[[Dict[str, Any]], None]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def autocast_dtype(mixed_precision: str, device: torch.device) -> Optional[torch.dtype]:
    if mixed_precision == "bf16" or (mixed_precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


class TrainLoop:
    """Owns model, optimizer, schedule, sampler and ledger for one rank."""

    def __init__(self, cfg, rank: int, world_size: int, local_rank: int, device: torch.device,
                 report: Report, requests: Optional[SaveRequests] = None,
                 chaos_armed: bool = False, mark: Callable[[str], None] = lambda phase: None):
        self.cfg = cfg
        self.report = report
        self.mark = mark  # phase marks let the controller tell a hung rank from its waiting peers
        self.ctx = DistContext(rank, world_size, local_rank, device,
                               autocast_dtype(cfg.parallel.mixed_precision, device))
        seed_everything(cfg.run.seed + rank)
        self.dataset = open_token_dataset(cfg.data.path, cfg.model.seq_len,
                                          s3_endpoint_url=cfg.data.s3_endpoint_url,
                                          s3_region=cfg.data.s3_region)
        max_token = self.dataset.max_token()
        if max_token >= cfg.model.vocab_size:
            raise ValueError(f"data.path {cfg.data.path} holds token id {max_token}, but "
                             f"model.vocab_size is {cfg.model.vocab_size}; raise model.vocab_size")
        self.sampler = GlobalSampler(self.dataset.num_samples, cfg.data.global_batch_size,
                                     cfg.data.seed, cfg.data.shuffle)
        self.strategy = build_strategy(cfg.parallel.strategy)
        self.model = self.strategy.wrap(build_model(cfg.model, cfg.run.seed), self.ctx)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim)
        self.ledger = SampleLedger()
        self.step = 0
        self.global_tokens = cfg.data.global_batch_size * cfg.model.seq_len
        self.max_local = math.ceil(cfg.data.global_batch_size / world_size)
        self.config_digest = config_digest(cfg)
        self.requests = requests or SaveRequests()
        self.preempted_at: Optional[int] = None
        self.chaos_armed = chaos_armed
        self._first_report = True
        self.ckpt: Optional[CheckpointManager] = None
        self.restored: Optional[Dict[str, Any]] = None
        if cfg.checkpoint.enabled:
            self.ckpt = CheckpointManager(cfg.checkpoint, cfg.run.name, rank, world_size,
                                          local_rank, self.config_digest,
                                          stall_s=cfg.chaos.stall_save_s)
            for tier in self.ckpt.tiers:
                tier.probe()
            self.restored = self.ckpt.restore(self)

    def fit(self) -> Dict[str, Any]:
        """Train until ``run.max_steps``; return this rank's final digests."""
        last_loss = float("nan")
        try:
            while self.step < self.cfg.run.max_steps and self.preempted_at is None:
                last_loss = self.train_step()
        finally:
            if self.ckpt is not None:
                self.ckpt.close()
        params = self.strategy.full_parameters(self.model)
        return {"rank": self.ctx.rank, "steps": self.step, "final_loss": last_loss,
                "params_sha256": params_sha256(params), "samples_digest": self.ledger.digest,
                "samples_consumed": self.ledger.samples, "restored": self.restored,
                "preempted_at": self.preempted_at,
                "checkpoint": self.ckpt.stats if self.ckpt else None}

    def train_step(self) -> float:
        start = time.perf_counter()
        step, ctx = self.step, self.ctx
        self.mark("compute")
        local = rank_slice(self.sampler.next_global_batch(), ctx.rank, ctx.world_size)
        lr = self.scheduler.get_last_lr()[0]
        loss_sum = self._forward_backward(local)
        self.mark("compute")
        grad_norm = self.strategy.clip_grad_norm(self.model, self.cfg.optim.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        vote = self.requests.vote()
        if self.ckpt is not None:
            vote = max(vote, self.ckpt.request_flag())
        busy = float(self.ckpt is not None and self.ckpt.busy())
        self.mark("exchange")
        consumed, total_loss, request, any_busy = self._exchange(local, loss_sum, (vote, busy))
        self.ledger.record(step, consumed)
        self.step += 1
        stall = 0.0
        if self.ckpt is not None:
            stall = self.ckpt.after_step(self, self.step, request, any_busy > 0,
                                         final=self.step == self.cfg.run.max_steps,
                                         deadline=self.requests.deadline)
        if request >= REQUEST_EMERGENCY:
            self.preempted_at = self.step
        step_time = time.perf_counter() - start
        loss = total_loss / self.global_tokens
        record = {"step": self.step, "loss": loss, "lr": lr, "grad_norm": float(grad_norm),
                  "step_time_s": step_time, "tokens_per_s": self.global_tokens / step_time,
                  "ckpt_stall_s": stall, "world_size": ctx.world_size, "time": time.time()}
        if self._first_report:  # tells the controller where this group resumed from
            record["restored"], self._first_report = self.restored, False
        self.report(record)
        self._maybe_inject_fault()
        return loss

    def _maybe_inject_fault(self) -> None:
        """``chaos.kill_rank`` dies as on a crash, ``chaos.hang_rank`` stops forever."""
        chaos = self.cfg.chaos
        if self.chaos_armed and self.ctx.rank == chaos.kill_rank and self.step == chaos.kill_at_step:
            logging.getLogger(__name__).warning("chaos: killing rank %d after step %d",
                                                self.ctx.rank, self.step)
            os._exit(1)
        if self.chaos_armed and self.ctx.rank == chaos.hang_rank and self.step == chaos.hang_at_step:
            logging.getLogger(__name__).warning("chaos: hanging rank %d after step %d",
                                                self.ctx.rank, self.step)
            self.mark("hung")
            threading.Event().wait()

    def _forward_backward(self, local: np.ndarray) -> torch.Tensor:
        """Accumulate gradients over this rank's micro-batches; return its token-loss sum."""
        ctx, micro = self.ctx, self.cfg.data.micro_batch_size
        chunks = [local[i:i + micro] for i in range(0, len(local), micro)]
        scale = ctx.world_size / self.global_tokens
        aux_weight = self.cfg.model.moe.aux_loss_weight
        loss_sum = torch.zeros((), device=ctx.device, dtype=torch.float64)
        for j, indices in enumerate(chunks):
            inputs, targets = (t.to(ctx.device, non_blocking=True) for t in self.dataset.batch(indices))
            sync = j == len(chunks) - 1
            with self.strategy.accumulate(self.model, sync=sync):
                with self._autocast():
                    logits = self.model(inputs)
                token_loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                             reduction="sum")
                loss = token_loss * scale
                aux = self.strategy.unwrap(self.model).aux_loss()
                if aux is not None:
                    loss = loss + aux_weight * aux * (targets.numel() * scale)
                if sync:  # the gradient all-reduce: from here on this rank waits for its peers
                    self.mark("exchange")
                loss.backward()
            loss_sum += token_loss.detach()
        return loss_sum

    def _autocast(self):
        if self.ctx.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=self.ctx.autocast_dtype)

    def _exchange(self, local: np.ndarray, loss_sum: torch.Tensor, votes: tuple):
        """One all-gather of [loss sum, save request, save busy, indices padded with -1].

        Returns the consumed indices, the global loss sum, and the max over ranks
        of the checkpoint votes, so every rank takes the same save decision.
        """
        head = 3
        payload = torch.full((head + self.max_local,), -1.0, dtype=torch.float64)
        payload[1:head] = torch.tensor(votes, dtype=torch.float64)
        payload[head:head + len(local)] = torch.from_numpy(local.astype(np.float64))
        payload = payload.to(self.ctx.device)
        payload[0] = loss_sum
        gathered = torch.empty(self.ctx.world_size * payload.numel(), dtype=torch.float64,
                               device=self.ctx.device)
        _all_gather_flat(gathered, payload)
        gathered = gathered.view(self.ctx.world_size, -1).cpu()
        indices = gathered[:, head:].flatten()
        consumed = indices[indices >= 0].to(torch.int64).numpy()
        request, busy = gathered[:, 1].max().item(), gathered[:, 2].max().item()
        return consumed, float(gathered[:, 0].sum()), request, busy


def _all_gather_flat(output: torch.Tensor, tensor: torch.Tensor) -> None:
    """``all_gather_single`` (torch >= 2.13) or its older name."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor)
