"""The ``rollout`` section: the engines that generate GRPO's completions, the reward
functions that score them, and how the engines follow the policy.  Read only when
``objective.name`` is ``grpo``; :func:`check_rollout` checks it on the driver, before Ray
starts (no torch imported here)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from raytrain_ext.data.config import DataFormat
from raytrain_ext.errors import InputError
from raytrain_ext.models.sources import model_source
from raytrain_ext.objectives.choice import objective_name
from raytrain_ext.objectives.config import ObjectiveName
from raytrain_ext.rollout.rewards import load_reward_fn
from raytrain_ext.typed_config.choice import Choice
from raytrain_ext.typed_config.fields import at_least, positive


class RolloutBackend(Choice):
    """``rollout.backend``: ``hf`` (transformers ``generate`` with its KV cache; CPU or
    GPU) or ``vllm`` (GPU, the optional ``vllm`` extra)."""

    hf = "hf"
    vllm = "vllm"


@dataclass
class RolloutConfig:
    """Rollout engines are Ray actors owned by the run (not by a trainer rank), so a
    trainer's re-form keeps them and their weights; a lost engine's prompt groups are
    generated again, whole, by the others, and a replacement takes the newest weights.

    ``reward_fns``: ``pkg.mod:fn`` names with TRL's signature ``fn(prompts, completions,
    **columns) -> list[float | None]`` (or ``Trainer(cfg, reward_fns=[...])``);
    ``reward_weights``: one per function (all 1 when null).  ``sync_every``: the engines
    take the policy's weights after every ``sync_every`` updates (1: on-policy);
    ``overlap``: generate step t+1 while step t updates (one step off-policy)."""

    engines: int = positive(1)
    # warm engines (process started, model built) that take a lost engine's place at once;
    # each holds resources_per_engine while it waits
    spare_engines: int = at_least(0, 0)
    resources_per_engine: Dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    backend: RolloutBackend = RolloutBackend.hf
    reward_fns: List[str] = field(default_factory=list)
    reward_weights: Optional[List[float]] = None
    sync_every: int = positive(1)
    overlap: bool = False
    # prompt groups an engine generates in one call (fixed, so a re-issued call generates
    # the same tokens: batch shapes change a kernel's rounding); more use the hardware fuller
    groups_per_call: int = positive(8)
    # the longest a step waits for its completions and rewards (a hung engine or reward)
    timeout_s: float = positive(600.0)


NOT_YET = {
    "guards.nan_policy": (
        lambda cfg: cfg.guards.nan_policy == "rollback",
        "rolling back re-generates steps whose rollouts were asked for with the weights "
        "rolled back from; set guards.nan_policy=skip_step or fail",
    ),
}


def check_rollout(
    cfg, reward_fns: Optional[Sequence[Callable]] = None, loss_fn: Optional[Callable] = None
) -> None:
    """Before Ray (after ``objectives.check_objective``): reward functions only where the
    objective is GRPO; for GRPO, what is not built yet is refused by name, the policy is a
    Hugging Face causal LM (the engines ``generate`` with it), the reward functions import
    and their weights match, and no evaluation split is asked for."""
    name = objective_name(cfg.objective, cfg.data.format, loss_fn)
    if name != ObjectiveName.grpo and cfg.data.format == DataFormat.prompts:
        raise InputError(
            f"objective.name: data.format=prompts is generated from and trained by "
            f"objective.name=grpo; this run trains {name} (objective.name or a loss_fn). "
            "Remove objective.name/objective.fn/loss_fn, or give data in another format."
        )
    if name != ObjectiveName.grpo:
        if reward_fns is not None or cfg.rollout.reward_fns:
            raise InputError(
                f"rollout.reward_fns: reward functions score generated completions, which "
                f"only objective.name=grpo has (this run trains {name}); remove them or set "
                "objective.name=grpo with data.format=prompts."
            )
        return
    for key, (applies, fix) in NOT_YET.items():
        if applies(cfg):
            raise InputError(f"{key}: not supported with objective.name=grpo yet: {fix}.")
    if cfg.rollout.backend == RolloutBackend.vllm:
        check_vllm(cfg)
    if not cfg.objective.grpo.top_p > 0:
        raise InputError(
            f"objective.grpo.top_p: must be in (0, 1], got {cfg.objective.grpo.top_p}; 1 keeps "
            "every token."
        )
    source = model_source(cfg.model)
    if source.hf_config(cfg.model) is None:
        raise InputError(
            f"model.source: objective.name=grpo generates with Hugging Face generate, so the "
            f"policy must be a Hugging Face causal LM, not {source.label} "
            f"(model.source={cfg.model.source}). Set model.source=hf with model.hf.path (or "
            "model.hf.config)."
        )
    functions = _reward_functions(cfg, reward_fns)
    weights = cfg.rollout.reward_weights
    if weights is not None and len(weights) != len(functions):
        raise InputError(
            f"rollout.reward_weights: {len(weights)} weights for {len(functions)} reward "
            "functions; give one weight per function, or null for all 1."
        )
    if cfg.eval.fraction or cfg.data.eval_path is not None:
        key = "eval.fraction" if cfg.eval.fraction else "data.eval_path"
        raise InputError(
            f"{key}: evaluating GRPO (rewards on held-out prompts) is not built yet; set "
            "eval.fraction=0 and data.eval_path=null."
        )


def _reward_functions(cfg, given: Optional[Sequence[Callable]]) -> List[object]:
    """The reward functions from Python or ``rollout.reward_fns`` (never both), imported
    here so that a wrong name fails before Ray starts."""
    named = list(cfg.rollout.reward_fns)
    if given is not None and named:
        raise InputError(
            f"rollout.reward_fns: set to {named} and reward_fns were also given from Python; "
            "give one of them."
        )
    if given is not None:
        for fn in given:
            if not callable(fn):
                raise InputError(
                    f"reward_fns: {fn!r} is not callable; pass functions "
                    "(prompts, completions, **columns) -> list of float or None."
                )
        functions: List[object] = list(given)
    else:
        functions = [load_reward_fn(name) for name in named]
    if not functions:
        raise InputError(
            "rollout.reward_fns: objective.name=grpo needs at least one reward function: "
            "rollout.reward_fns=[pkg.module:fn] or Trainer(cfg, reward_fns=[fn])."
        )
    return functions


def check_vllm(cfg) -> None:
    """``rollout.backend=vllm`` needs the extra where the driver runs and a GPU per engine;
    refused before Ray, naming the key and the fix."""
    if importlib.util.find_spec("vllm") is None:
        raise InputError(
            "rollout.backend: vllm is not installed here; install the optional extra "
            "(pip install 'raytrain-ext[vllm]') on every node, or set rollout.backend=hf "
            "(transformers generate, CPU or GPU)."
        )
    gpus = dict(cfg.rollout.resources_per_engine).get("GPU", 0.0)
    if gpus < 1:
        raise InputError(
            f"rollout.resources_per_engine: the vllm backend generates on a GPU, but each "
            f"engine asks for {gpus:g}; set rollout.resources_per_engine={{GPU: 1, CPU: 4}} "
            "(one GPU per engine), or rollout.backend=hf."
        )
