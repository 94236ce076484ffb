"""Semantic checks on a resolved config, run on the driver before anything starts.

Types, key names and choices (each section's enums) are enforced by OmegaConf while
merging.  Here run the ranges declared beside every field, each section's own checks
(declared beside the section by the package that reads it: ``check_*_section``) and the
checks that span sections, which live here: the batch over the world size and the
layout, the layout over the allowed world sizes, what the backend and device ask of the
scaling, fault and profile ranks below ``scaling.max_workers``.  Each message names the
full key, shows the numbers involved and says how to fix it.
"""

from __future__ import annotations

from typing import Callable, List

from omegaconf import DictConfig

from raytrain_ext.checkpoint.config import check_checkpoint_section
from raytrain_ext.config.schema import TrainConfig
from raytrain_ext.data.config import check_data_section
from raytrain_ext.elastic.config import check_scaling_section, fill_scaling_defaults
from raytrain_ext.errors import ConfigError
from raytrain_ext.models.config import check_model_section
from raytrain_ext.parallel.catalog import capabilities, load_class, offered
from raytrain_ext.parallel.dims import (
    ParallelDims,
    ParallelLayoutError,
    allowed_world_sizes,
    check_batch_split,
    check_degrees,
    check_expert_parallel,
    check_model_fits_tp,
    check_pipeline_microbatches,
    check_strategy_support,
    resize_unit,
)
from raytrain_ext.train.config import check_optim_section, check_profile_section
from raytrain_ext.typed_config.fields import declared_ranges


def validate(cfg: DictConfig) -> None:
    """Fill derived defaults (min/max workers, GPU resource), then check in order.

    Checks run from simple ranges to cross-key arithmetic, so later checks may
    rely on earlier ones (no division by a zero batch size); the first problem
    found is raised.
    """
    fill_scaling_defaults(cfg.scaling)
    for check in _CHECKS:
        check(cfg)


def _get(cfg: DictConfig, key: str):
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def _check_ranges(cfg: DictConfig) -> None:
    """The ranges declared beside every section's fields, then the name of the run."""
    for key, bounds in declared_ranges(TrainConfig):
        problem = bounds.problem(key, _get(cfg, key))
        if problem:
            raise ConfigError(problem)
    if not cfg.run.name or "/" in cfg.run.name or cfg.run.name in (".", ".."):
        raise ConfigError(
            f"run.name: {cfg.run.name!r} must be a non-empty name without '/'; "
            "it names the directory runs/<run.name>."
        )


def _check_vocabulary(cfg: DictConfig) -> None:
    m = cfg.model
    if cfg.data.path == "builtin:corpus" and m.vocab_size < 256:
        raise ConfigError(
            f"model.vocab_size: {m.vocab_size} is too small for the byte-level "
            "builtin corpus (token ids 0..255). Set model.vocab_size >= 256."
        )


def _check_batch(cfg: DictConfig) -> None:
    """Batch arithmetic over data-parallel ranks (= workers unless tp/pp > 1).

    Runs after ``_check_parallel``, so every world size in range divides by tp x pp.
    """
    d, s = cfg.data, cfg.scaling
    model_parallel = cfg.parallel.tp * cfg.parallel.pp
    dp_size = s.num_workers // model_parallel
    per_step = d.micro_batch_size * dp_size
    ranks = (
        f"scaling.num_workers = {d.micro_batch_size} x {s.num_workers}"
        if model_parallel == 1
        else f"the data-parallel size (scaling.num_workers / (parallel.tp x parallel.pp) = "
        f"{s.num_workers} / {model_parallel}) = {d.micro_batch_size} x {dp_size}"
    )
    if d.global_batch_size % per_step:
        raise ConfigError(
            f"data.global_batch_size: {d.global_batch_size} is not a multiple of "
            f"data.micro_batch_size x {ranks} "
            f"= {per_step}, so gradient accumulation would not be a whole number of micro-batches. "
            f"Use a global_batch_size such as {per_step * max(1, round(d.global_batch_size / per_step))}."
        )
    if d.global_batch_size < s.max_workers // model_parallel:
        raise ConfigError(
            f"data.global_batch_size: {d.global_batch_size} is smaller than "
            f"scaling.max_workers={s.max_workers}; every worker needs at least one "
            "sample per step. Raise global_batch_size or lower max_workers."
        )
    for world in allowed_world_sizes(s, cfg.parallel):  # FSDP: equal micro-batch counts
        try:
            dims = ParallelDims.build(cfg.parallel, cfg.model, world)
            check_batch_split(cfg.parallel.strategy, d.global_batch_size, d.micro_batch_size, dims)
            check_pipeline_microbatches(
                cfg.parallel.pp_schedule, d.global_batch_size, d.micro_batch_size, dims
            )
        except ParallelLayoutError as e:
            raise ConfigError(str(e)) from None


def _check_parallel(cfg: DictConfig) -> None:
    """The layout must work for every world size the elastic controller may choose.

    The controller resizes in whole model-parallel groups (multiples of
    ``dp_replicate x tp x pp x ep``) within ``min_workers..max_workers``, so both
    bounds and ``num_workers`` must be multiples of it.  With FSDP every allowed
    size must also split the global batch into equal micro-batch counts.
    Workers check again with the actual world size (``ParallelDims.build``).
    """
    p, s = cfg.parallel, cfg.scaling
    try:
        check_degrees(p)
        check_expert_parallel(p, cfg.model)
        check_strategy_support(p)
        check_model_fits_tp(p.tp, cfg.model)
        if p.cpu_offload and not s.use_gpu:
            raise ConfigError(
                "parallel.cpu_offload: offloads GPU parameters to host memory; "
                "without GPUs they are there already. Set parallel.cpu_offload="
                "false, or scaling.use_gpu=true."
            )
        ParallelDims.build(p, cfg.model, s.num_workers)  # the arithmetic for the usual size first
        unit = resize_unit(p)
        for key in ("min_workers", "num_workers", "max_workers"):
            if s[key] % unit:
                raise ConfigError(
                    f"scaling.{key}: {s[key]} is not a multiple of dp_replicate x tp x pp x ep = "
                    f"{p.dp_replicate} x {p.tp} x {p.pp} x {p.ep} = {unit}; the world grows and "
                    f"shrinks in whole model-parallel groups. Use a multiple of {unit} such as "
                    f"{max(unit, s[key] // unit * unit)}."
                )
        for world in allowed_world_sizes(s, p):
            ParallelDims.build(p, cfg.model, world)
    except ParallelLayoutError as e:
        raise ConfigError(str(e)) from None


def _check_zero(cfg: DictConfig) -> None:
    """The strategy's own options (``parallel.zero.*`` for DeepSpeed), checked by the
    function its catalog entry names; see :mod:`raytrain_ext.parallel.catalog`."""
    caps = capabilities(cfg.parallel.strategy)
    if not caps.native_checkpoint and cfg.parallel.zero.native_checkpoint:
        raise ConfigError(
            "parallel.zero.native_checkpoint: DeepSpeed's own checkpoint files come from a "
            f"DeepSpeed engine, but parallel.strategy={cfg.parallel.strategy}. Set "
            f"parallel.strategy={offered(lambda c: c.native_checkpoint)}, "
            "or parallel.zero.native_checkpoint=false."
        )
    if caps.config_check is None:
        return
    try:
        load_class(caps.config_check)(
            cfg.parallel,
            cfg.data.global_batch_size,
            cfg.data.micro_batch_size,
            allowed_world_sizes(cfg.scaling, cfg.parallel),
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def schedule_warnings(cfg: DictConfig) -> List[str]:
    """A schedule that trains but is almost surely not what was meant: said out loud, not
    refused (a one-step smoke test with a long warmup is legitimate)."""
    o, steps = cfg.optim, cfg.run.max_steps
    peak = o.lr * min(1.0, steps / o.warmup_steps) if o.warmup_steps else o.lr
    if peak < o.min_lr:
        return [
            f"optim.warmup_steps: {o.warmup_steps} warmup steps in a run of run.max_steps="
            f"{steps} keep the learning rate at or below {peak:.3g}, under optim.min_lr="
            f"{o.min_lr}, for the whole run. Lower optim.warmup_steps (e.g. to "
            f"{max(1, steps // 10)}) or raise run.max_steps."
        ]
    if o.warmup_steps > steps:
        return [
            f"optim.warmup_steps: {o.warmup_steps} is more than run.max_steps={steps}: the "
            f"run ends before the learning rate reaches optim.lr={o.lr}."
        ]
    return []


def _check_devices(cfg: DictConfig) -> None:
    """What the backend and the device ask of ``scaling.use_gpu``."""
    s, p = cfg.scaling, cfg.parallel
    if p.backend == "nccl" and not s.use_gpu:
        raise ConfigError(
            "parallel.backend: 'nccl' needs GPUs. Set scaling.use_gpu=true, "
            "or parallel.backend=gloo (or auto) on CPU."
        )
    if cfg.run.device == "cuda" and not s.use_gpu:
        raise ConfigError(
            "run.device: 'cuda' needs scaling.use_gpu=true so that Ray assigns each worker a GPU."
        )


def _check_chaos_ranks(cfg: DictConfig) -> None:
    """A fault aimed at a rank the run never has would silently not fire."""
    for key in ("chaos.kill_rank", "chaos.hang_rank", "chaos.nan_rank", "chaos.slow_rank"):
        if _get(cfg, key) >= cfg.scaling.max_workers:
            raise ConfigError(
                f"{key}: {_get(cfg, key)} is not a rank below "
                f"scaling.max_workers={cfg.scaling.max_workers}."
            )


def _check_profile_ranks(cfg: DictConfig) -> None:
    for rank in cfg.profile.ranks:
        if not 0 <= rank < cfg.scaling.max_workers:
            raise ConfigError(
                f"profile.ranks: {rank} is not a rank below "
                f"scaling.max_workers={cfg.scaling.max_workers}."
            )


# each section's own checks (declared beside it), then those across sections, in an order
# where a later check may rely on an earlier one
_CHECKS: List[Callable[[DictConfig], None]] = [
    _check_ranges,
    lambda cfg: check_model_section(cfg.model),
    _check_vocabulary,
    _check_zero,
    _check_parallel,
    _check_batch,
    lambda cfg: check_optim_section(cfg.optim),
    lambda cfg: check_scaling_section(cfg.scaling),
    _check_devices,
    lambda cfg: check_checkpoint_section(cfg.checkpoint),
    lambda cfg: check_data_section(cfg.data),
    _check_chaos_ranks,
    lambda cfg: check_profile_section(cfg.profile),
    _check_profile_ranks,
]
