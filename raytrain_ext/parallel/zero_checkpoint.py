"""ZeRO state in and out of our DCP checkpoints, and the few DeepSpeed internals we touch.

Checkpoint choice: DeepSpeed's own ``save_checkpoint`` writes per-rank
partition files (``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``) that load
only onto the same data-parallel size unless converted offline to a
"universal" checkpoint.  The elastic controller resizes the world between
attempts, so instead every rank exposes its ZeRO state in exactly the format
``torch.distributed.checkpoint.state_dict.get_state_dict`` gives for DDP:

- model: ``{fqn: full fp32 master weight}`` (+ buffers),
- optim: ``{"state": {fqn: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups":
  [{hyperparameters..., "params": [fqn, ...]}]}``.

Our existing DCP path (``checkpoint.state``) then saves, checksums, tiers and
restores it unchanged, so a ZeRO checkpoint loads on any world size, under any
ZeRO stage, and even into DDP (and vice versa).  The full tensors are
assembled with DeepSpeed's public ``safe_get_full_*`` API (one all-reduce or
all-gather per tensor) and written back with ``safe_set_full_*`` (each rank
copies its own fragment).  Cost: during a save each rank briefly holds the
full fp32 weights and Adam moments (3x the fp32 model), which ZeRO otherwise
shards; and DCP writes each replicated tensor once (deduplicated across ranks).
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.nn as nn

PER_PARAM_STATE = ("exp_avg", "exp_avg_sq")  # torch AdamW (amsgrad off)


def group_param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> List[List[str]]:
    """FQNs of each param group's parameters, read before DeepSpeed flattens the groups."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def _stage(zero_optimizer) -> int:
    return 3 if hasattr(zero_optimizer, "fp32_partitioned_groups_flat") else 2


def _flat_fp32_partitions(zero_optimizer) -> List[torch.Tensor]:
    """This rank's flat fp32 master partitions: the tensors our AdamW actually steps."""
    if _stage(zero_optimizer) == 3:
        return list(zero_optimizer.fp32_partitioned_groups_flat)
    return list(zero_optimizer.single_partition_of_fp32_groups)


def ensure_optimizer_state(zero_optimizer) -> None:
    """Create AdamW's state (zeros, step 0) before the first step, as torch would lazily.

    Needed to load a checkpoint into a fresh engine and to describe the state's
    shapes; an AdamW step from this state equals one from empty state.
    """
    inner = zero_optimizer.optimizer
    for flat in _flat_fp32_partitions(zero_optimizer):
        if not inner.state.get(flat):
            inner.state[flat] = {
                "step": torch.tensor(0.0),
                **{k: torch.zeros_like(flat) for k in PER_PARAM_STATE},
            }
    if hasattr(zero_optimizer, "_lazy_init_hp_params_optimizer_state"):
        # Stage 1/2 link each parameter's fragment to the optimizer state once, right
        # after the first group's first step, so later groups stay unlinked; relink all.
        zero_optimizer._hp_optimizer_states_linked = False
        zero_optimizer._lazy_init_hp_params_optimizer_state()


def _named_params(engine) -> Dict[str, nn.Parameter]:
    return dict(engine.module.named_parameters())


def _full_shape(param: nn.Parameter) -> torch.Size:
    return param.ds_shape if hasattr(param, "ds_shape") else param.shape


def full_fp32_parameters(engine) -> Dict[str, torch.Tensor]:
    """Every parameter's full fp32 master value (collective: every rank, same order)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {
        name: safe_get_full_fp32_param(p).detach().reshape(_full_shape(p)).clone().cpu()
        for name, p in _named_params(engine).items()
    }


def zero_state_dicts(engine, group_names: List[List[str]]):
    """(model, optimizer) state dicts in ``get_state_dict``'s DDP format (collective)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    zero_optimizer = engine.optimizer
    ensure_optimizer_state(zero_optimizer)
    params = _named_params(engine)
    model_sd = {k: v for k, v in engine.module.state_dict().items() if k not in params}
    model_sd.update(full_fp32_parameters(engine))
    step = _step_count(zero_optimizer)
    state = {}
    for name, p in params.items():
        entry = {"step": step.clone()}
        for key in PER_PARAM_STATE:
            full = safe_get_full_optimizer_state(p, key)
            entry[key] = full.detach().reshape(_full_shape(p)).clone().cpu()
        state[name] = entry
    groups = []
    for group, names in zip(zero_optimizer.optimizer.param_groups, group_names, strict=True):
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(names)})
    return model_sd, {"state": state, "param_groups": groups}


def _step_count(zero_optimizer) -> torch.Tensor:
    inner = zero_optimizer.optimizer
    steps = [inner.state[f]["step"] for f in _flat_fp32_partitions(zero_optimizer)]
    return torch.as_tensor(steps[0], dtype=torch.float32).detach().cpu().reshape(())


def load_zero_state_dicts(
    engine, group_names: List[List[str]], model_sd: Dict[str, Any], optim_sd: Dict[str, Any]
) -> None:
    """Install full FQN-keyed state: weights (master and compute copy), moments, step, groups."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    zero_optimizer = engine.optimizer
    ensure_optimizer_state(zero_optimizer)
    params = _named_params(engine)
    _load_compute_weights(engine, params, model_sd)
    for name, p in params.items():
        safe_set_full_fp32_param(p, model_sd[name].to(torch.float32))
        for key in PER_PARAM_STATE:
            safe_set_full_optimizer_state(p, optim_sd["state"][name][key].to(torch.float32), key)
    step = max(float(entry["step"]) for entry in optim_sd["state"].values())
    inner = zero_optimizer.optimizer
    for flat in _flat_fp32_partitions(zero_optimizer):
        inner.state[flat]["step"].fill_(step)
    for group, saved in zip(inner.param_groups, optim_sd["param_groups"], strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
    buffers = {k: v for k, v in model_sd.items() if k not in params}
    if buffers:
        engine.module.load_state_dict(buffers, strict=False)


def _load_compute_weights(
    engine, params: Dict[str, nn.Parameter], model_sd: Dict[str, Any]
) -> None:
    """The module's own (compute-precision) weights; stage 3 scatters rank 0's copy."""
    import deepspeed
    import torch.distributed as dist

    with torch.no_grad():
        if _stage(engine.optimizer) != 3:
            for name, p in params.items():
                p.data.copy_(model_sd[name].reshape(p.shape))
            return
        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0):
            if dist.get_rank() == 0:
                for name, p in params.items():
                    p.data.copy_(model_sd[name].reshape(p.shape))


def discard_gradients(zero_optimizer) -> None:
    """Drop reduced gradients of a step whose update was skipped (DeepSpeed's overflow path)."""
    zero_optimizer.zero_grad(set_to_none=True)
    if _stage(zero_optimizer) == 3:
        if zero_optimizer.offload_optimizer:
            zero_optimizer.reset_cpu_buffers()
        else:
            zero_optimizer.averaged_gradients = {}
        zero_optimizer.micro_step_id = 0
        return
    zero_optimizer._release_preflattened_grad_buffers()
    if zero_optimizer.cpu_offload:
        zero_optimizer.reset_cpu_buffers()
    else:
        for key in list(zero_optimizer.averaged_gradients):
            zero_optimizer.averaged_gradients[key] = None
            zero_optimizer.all_grad_tensors[key] = None
    zero_optimizer.micro_step_id = -1  # INITIAL_MICRO_STEP_ID: the next reduction overwrites
