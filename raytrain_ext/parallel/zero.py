"""DeepSpeed ZeRO stages 1-3 (``parallel.strategy: zero``) behind the Strategy interface.

The DeepSpeed JSON config is generated from our config (``deepspeed_config``):
``train_micro_batch_size_per_gpu`` from ``data.micro_batch_size``,
``gradient_clipping`` from ``optim.grad_clip``, bf16 when the loop would
autocast to bf16 (GPU), the ``parallel.zero.*`` stage and offload choices,
then ``parallel.zero.extra`` deep-merged last so any DeepSpeed key can be set.

Invariants that keep ZeRO numerically equal to DDP:
- Our torch AdamW goes into ``deepspeed.initialize``; DeepSpeed replaces each
  param group's ``params`` with its flat fp32 partition but keeps the group
  dicts, so our ``LambdaLR`` (built on the same AdamW, stepped by the loop)
  still sets the learning rate DeepSpeed's step uses.  No DS scheduler.
- ``gradient_accumulation_steps`` is 1, so ``engine.backward`` never divides
  the loss (the loop already scales it by ``dp_size / global_tokens``), and
  every ``engine.step()`` is an update.
- The loop's micro-batches run inside one ``engine.coalesce_grad_reduction()``
  block per step: backwards accumulate locally and the block's exit issues a
  single reduction pass.  Each rank therefore communicates exactly once per
  step whatever its micro-batch count, so ZeRO-1/2 accept the uneven splits of
  elastic world sizes.  ZeRO-3 also all-gathers parameters in every forward,
  so (like FSDP) it needs the same micro-batch count on every rank.
- The grad norm is DeepSpeed's own pre-step global norm (the same value its
  ``gradient_clipping`` uses and ``engine.get_global_grad_norm()`` reports
  after the step); it is read before the step so the NaN guard can veto it.
"""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, Iterable, Iterator, List, Optional

import torch
import torch.nn as nn

from raytrain_ext.models.spec import ModelSpec
from raytrain_ext.parallel.dims import microbatch_counts
from raytrain_ext.parallel.strategy import DistContext, Strategy


def check_zero_config(
    parallel_cfg, global_batch: int, micro: int, world_sizes: Iterable[int]
) -> None:
    """Raise ``ValueError`` naming the key and the fix for a ZeRO setup we cannot run."""
    z = parallel_cfg.zero
    if z.stage not in (1, 2, 3):
        raise ValueError(
            f"parallel.zero.stage: {z.stage} is not a ZeRO stage. Set it to 1 "
            "(optimizer state sharded), 2 (+ gradients) or 3 (+ parameters)."
        )
    if z.offload_param != "none" and z.stage != 3:
        raise ValueError(
            f"parallel.zero.offload_param: offloading parameters needs ZeRO stage 3 "
            f"(got stage {z.stage}). Set parallel.zero.stage=3 or "
            "parallel.zero.offload_param=none."
        )
    nvme = [k for k in ("offload_optimizer", "offload_param") if getattr(z, k) == "nvme"]
    if nvme and not z.nvme_path:
        raise ValueError(
            f"parallel.zero.{nvme[0]}: nvme offload needs a directory on a local "
            "NVMe drive. Set parallel.zero.nvme_path=/path/to/nvme/dir, or use cpu."
        )
    if nvme and z.stage != 3:
        raise ValueError(
            f"parallel.zero.{nvme[0]}: nvme offload (ZeRO-Infinity) needs ZeRO stage 3 "
            f"(got stage {z.stage}). Set parallel.zero.stage=3, or offload to cpu."
        )
    for key, what in (("tp", "tensor"), ("pp", "pipeline"), ("dp_replicate", "HSDP replica")):
        value = getattr(parallel_cfg, key)
        if value > 1:
            raise ValueError(
                f"parallel.{key}: {what} parallelism ({key}={value}) is not "
                f"supported with parallel.strategy=zero. Set parallel.{key}=1, or "
                "use parallel.strategy=fsdp (which composes with tp and HSDP)."
            )
    if not isinstance(z.extra, dict) and not hasattr(z.extra, "items"):
        raise ValueError(
            "parallel.zero.extra: must be a mapping of DeepSpeed config keys, "
            "e.g. parallel.zero.extra={zero_optimization: {reduce_bucket_size: 5e7}}."
        )
    if z.stage == 3:
        for world in world_sizes:
            check_stage3_split(global_batch, micro, world)


def check_nvme_support(zero_cfg, async_io_available: bool) -> None:
    """NVMe offload swaps through DeepSpeed's ``async_io`` op, which needs libaio on the
    worker's node; without it DeepSpeed fails deep inside ``initialize``."""
    nvme = [k for k in ("offload_optimizer", "offload_param") if getattr(zero_cfg, k) == "nvme"]
    if nvme and not async_io_available:
        raise RuntimeError(
            f"parallel.zero.{nvme[0]}: nvme offload needs DeepSpeed's async_io op, which needs "
            "libaio on this node (apt install libaio-dev, then reinstall deepspeed or let it "
            "JIT-build the op). Install it in the worker image, or offload to cpu."
        )


def check_stage3_split(global_batch: int, micro: int, dp_size: int) -> None:
    """ZeRO-3 all-gathers parameters in every forward: equal micro-batch counts per rank."""
    counts = microbatch_counts(global_batch, dp_size, micro)
    if len(counts) > 1:
        raise ValueError(
            f"data.global_batch_size: {global_batch} samples over {dp_size} ranks in micro-batches "
            f"of {micro} give some ranks {min(counts)} and others {max(counts)} micro-batches; "
            "ZeRO stage 3 gathers parameters in every forward, so every rank needs the same count. "
            f"Use a global_batch_size that is a multiple of {dp_size * micro}, or "
            "parallel.zero.stage=2."
        )


def deep_merge(base: Dict[str, Any], extra: Dict[str, Any]) -> Dict[str, Any]:
    """``base`` with ``extra`` merged in recursively; ``extra`` wins on conflicts."""
    merged = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _offload(device: str, nvme_path: Optional[str]) -> Dict[str, Any]:
    section: Dict[str, Any] = {"device": device, "pin_memory": torch.cuda.is_available()}
    if device == "nvme":
        section["nvme_path"] = nvme_path
    return section


def deepspeed_config(
    zero_cfg, micro_batch_size: int, grad_clip: float, bf16: bool
) -> Dict[str, Any]:
    """The DeepSpeed JSON config for our settings (see the module docstring for why each key)."""
    zero: Dict[str, Any] = {"stage": zero_cfg.stage}
    if zero_cfg.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(zero_cfg.offload_optimizer, zero_cfg.nvme_path)
    if zero_cfg.offload_param != "none":
        zero["offload_param"] = _offload(zero_cfg.offload_param, zero_cfg.nvme_path)
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": float(grad_clip),
        "bf16": {"enabled": bool(bf16)},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # our torch AdamW
        "zero_force_ds_cpu_optimizer": False,  # keep torch AdamW even with offload_optimizer
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    return deep_merge(config, dict(_plain(zero_cfg.extra)))


def _plain(value: Any) -> Any:
    """OmegaConf containers to plain dicts/lists (DeepSpeed validates with pydantic)."""
    if hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return [_plain(v) for v in value]
    return value


def init_deepspeed_comm() -> None:
    """Point DeepSpeed's comm layer at the process group the worker group already formed.

    DeepSpeed reads the torchrun variables (set by ``worker.dist_env``) and, with
    torch.distributed already initialised, reuses the default group.  On CPU its
    shared-memory all-reduce op is turned off: DeepSpeed JIT-compiles it (~30 s)
    the first time each fresh node uses it, which would land inside every re-form
    onto a new node, and gloo already reduces over the group we formed.
    """
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise RuntimeError(
                f"parallel.strategy=zero: environment variable {key} is not set; "
                "DeepSpeed needs the torchrun variables (worker.dist_env sets them)."
            )
    if get_accelerator().device_name() == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)


class ZeroStrategy(Strategy):
    """DeepSpeed ZeRO; ``prepare`` builds the engine once the loop has our optimizer."""

    name = "zero"
    owns_optimizer_state = True  # fp32 partitions and moments live in DeepSpeed's optimizer

    def __init__(self, parallel_cfg, spec: ModelSpec):
        super().__init__(parallel_cfg, spec)
        self.zero_cfg = parallel_cfg.zero
        self.ctx: DistContext  # set by wrap
        self._coalescing: Optional[contextlib.ExitStack] = None
        self._stepped = False  # whether this step's update was applied
        self.group_names: List[List[str]] = []  # FQNs per param group, before DS flattens

    def wrap(self, model: nn.Module, ctx: DistContext) -> nn.Module:
        self.ctx = ctx
        return model.to(ctx.device)

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer, cfg) -> nn.Module:
        """``deepspeed.initialize`` with our AdamW; returns the engine the loop trains."""
        import deepspeed

        from raytrain_ext.parallel.zero_checkpoint import group_param_names

        if self.zero_cfg.stage == 3:
            check_stage3_split(
                cfg.data.global_batch_size, cfg.data.micro_batch_size, self.ctx.dp_size
            )
        self.group_names = group_param_names(model, optimizer)
        if "nvme" in (self.zero_cfg.offload_optimizer, self.zero_cfg.offload_param):
            from deepspeed.ops.op_builder import AsyncIOBuilder

            check_nvme_support(self.zero_cfg, AsyncIOBuilder().is_compatible(verbose=False))
        init_deepspeed_comm()
        config = deepspeed_config(
            self.zero_cfg,
            cfg.data.micro_batch_size,
            cfg.optim.grad_clip,
            bf16=self.ctx.autocast_dtype == torch.bfloat16,
        )
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=config, dist_init_required=False
        )
        return engine

    @contextlib.contextmanager
    def accumulate(self, wrapped: nn.Module, sync: bool) -> Iterator[None]:
        """One ``coalesce_grad_reduction`` block spans all of a step's micro-batches.

        It opens at the step's first micro-batch and closes (one reduction pass)
        after the ``sync`` one's backward.
        """
        if self._coalescing is None:
            self._coalescing = contextlib.ExitStack()
            self._coalescing.enter_context(wrapped.coalesce_grad_reduction())
        yield
        if sync:
            stack, self._coalescing = self._coalescing, None
            stack.close()

    def backward(self, wrapped: nn.Module, loss: torch.Tensor) -> None:
        wrapped.backward(loss)  # gradient_accumulation_steps=1: no division by DeepSpeed

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float) -> torch.Tensor:
        """The pre-step global grad norm; DeepSpeed clips inside ``step`` (``gradient_clipping``).

        DeepSpeed computes the norm only inside ``step``; the loop's NaN guard must
        see it before, so the optimizer's own norm routine runs once more here
        (one pass over this rank's gradient partition and a scalar all-reduce).
        """
        optimizer = wrapped.optimizer
        if self.zero_cfg.stage == 3:
            from deepspeed.runtime.utils import combine_grad_norm_groups

            norm = combine_grad_norm_groups(optimizer._get_norm_groups())
        else:
            norm = optimizer.scaled_global_norm()
        norm = torch.as_tensor(norm, dtype=torch.float32).detach().cpu()
        return (
            torch.full((), float("nan")) if float(norm) < 0 else norm
        )  # DS may mark inf/NaN as -1

    def step(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        wrapped.step()  # also zeroes DeepSpeed's gradients
        self._stepped = True

    def zero_grad(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """After a skipped update, drop the step's reduced gradients as DeepSpeed's own
        overflow path does, so they do not leak into the next step."""
        from raytrain_ext.parallel.zero_checkpoint import discard_gradients

        if not self._stepped:
            discard_gradients(wrapped.optimizer)
        self._stepped = False

    def unwrap(self, wrapped: nn.Module) -> nn.Module:
        return wrapped.module

    def full_parameters(self, wrapped: nn.Module) -> Dict[str, torch.Tensor]:
        """Full fp32 master weights by FQN (a collective: every rank calls it)."""
        from raytrain_ext.parallel.zero_checkpoint import full_fp32_parameters

        return full_fp32_parameters(wrapped)

    def state_dicts(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer):
        """(model, optimizer) state dicts in ``get_state_dict``'s full, FQN-keyed format."""
        from raytrain_ext.parallel.zero_checkpoint import zero_state_dicts

        return zero_state_dicts(wrapped, self.group_names)

    def load_state_dicts(
        self,
        wrapped: nn.Module,
        optimizer: torch.optim.Optimizer,
        model_sd: Dict[str, Any],
        optim_sd: Dict[str, Any],
        timed: Callable[[str], ContextManager] = lambda _phase: contextlib.nullcontext(),
    ) -> None:
        """Model and optimizer at once (DeepSpeed's partitions), timed as ``model``."""
        from raytrain_ext.parallel.zero_checkpoint import load_zero_state_dicts

        with timed("model"):
            load_zero_state_dicts(wrapped, self.group_names, model_sd, optim_sd)

    # ---- DeepSpeed's own checkpoint files (parallel.zero.native_checkpoint) --------------
    @property
    def native_checkpoint(self) -> bool:
        return bool(self.zero_cfg.native_checkpoint)

    def native_info(self) -> Dict[str, Any]:
        """What a native checkpoint must match to be loaded by ``native_load``."""
        return {"format": "deepspeed", "stage": self.zero_cfg.stage}

    def native_save(self, wrapped: nn.Module, save_dir: Path, tag: str) -> None:
        """``engine.save_checkpoint`` into ``save_dir/tag`` (a collective: every rank calls it).

        ``save_dir`` is this rank's own; DeepSpeed creates it only on rank 0.
        """
        (save_dir / tag).mkdir(parents=True, exist_ok=True)
        wrapped.save_checkpoint(str(save_dir), tag=tag, save_latest=False)

    def native_load(self, wrapped: nn.Module, load_dir: Path, tag: str) -> None:
        """``engine.load_checkpoint``: module, fp32 partitions and optimizer state, at the
        world size it was saved with (the LR schedule is ours, restored with the rest)."""
        path, _ = wrapped.load_checkpoint(
            str(load_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint at {load_dir}/{tag}")
