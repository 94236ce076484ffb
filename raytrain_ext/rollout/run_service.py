"""A GRPO run's rollout service, from its config: started by the driver before the
trainers (so that it, and the engines it owns, outlive every trainer re-form), found by
the ranks under the run's name, asked for its record at the end.

What the config decides (``objective.grpo``, ``rollout``, ``model``, ``data``): each
engine builds the run's Hugging Face architecture (its weights come from the trainers
before the first generation, so it reads no checkpoint), samples as TRL's settings say,
and decodes completions with the run's tokenizer for the reward functions (special
tokens skipped, as TRL decodes them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence

from raytrain_ext.errors import InputError
from raytrain_ext.rollout.config import RolloutBackend
from raytrain_ext.rollout.engine import RolloutSettings
from raytrain_ext.rollout.reference import HFReferenceBuilder
from raytrain_ext.rollout.sampling import SamplingParams
from raytrain_ext.rollout.schedule import WeightsSchedule
from raytrain_ext.rollout.service import (
    ROLLOUT_NAMESPACE,
    RewardSpec,
    RolloutSpec,
    start_rollout_service,
)
from raytrain_ext.rollout.vllm_engine import VLLMEngineBuilder


def service_name(run_name: str) -> str:
    return f"rollout/{run_name}"


@dataclass(frozen=True)
class HFPolicyBuilder:
    """Builds an engine's model: the run's architecture (``model.hf``), on the engine's
    GPU when Ray gave it one; weights random until the trainers' first ``load_weights``."""

    model_cfg: Any

    def __call__(self):
        import ray
        import torch
        from transformers import AutoModelForCausalLM

        from raytrain_ext.models.sources import model_source

        config = model_source(self.model_cfg).hf_config(self.model_cfg)
        model = AutoModelForCausalLM.from_config(config)
        if ray.get_gpu_ids():
            model = model.to(device="cuda", dtype=torch.bfloat16)
        return model


@dataclass(frozen=True)
class TokenizerDecode:
    """A completion's token ids -> its text, as TRL decodes it (special tokens skipped)."""

    tokenizer_spec: str
    eos_token: Optional[str] = None

    def __call__(self, ids: Sequence[int]) -> str:
        return self._tokenizer().decode(list(ids), skip_special_tokens=True)

    def _tokenizer(self):
        from raytrain_ext.prepare.tokenizer import load_tokenizer

        cached = _TOKENIZERS.get(self)
        if cached is None:
            cached = _TOKENIZERS[self] = load_tokenizer(self.tokenizer_spec, self.eos_token)
        return cached


_TOKENIZERS: Dict[TokenizerDecode, Any] = {}  # per process: each decode reuses one


def rollout_settings(cfg, eos_token_id: int, pad_token_id: int) -> RolloutSettings:
    g = cfg.objective.grpo
    return RolloutSettings(
        num_generations=g.num_generations,
        max_completion_length=g.max_completion_length,
        seed=cfg.run.seed,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        sampling=SamplingParams(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k),
        groups_per_call=cfg.rollout.groups_per_call,
        score_policy=WeightsSchedule.of(cfg).off_policy,
    )


def engine_options(
    resources: Dict[str, float], runtime_env: Optional[Dict[str, Any]] = None
) -> Dict[str, Any]:
    """``rollout.resources_per_engine`` as Ray actor options, the engines' processes
    started in ``runtime_env``."""
    other = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    options: Dict[str, Any] = {
        "num_cpus": resources.get("CPU", 1.0),
        "num_gpus": resources.get("GPU", 0.0),
    }
    if runtime_env is not None:
        options["runtime_env"] = runtime_env
    if other:
        options["resources"] = other
    return options


def start_run_rollout(
    cfg,
    reward_fns: Optional[Sequence[Callable]] = None,
    engine_env: Optional[Dict[str, Any]] = None,
) -> Any:
    """The run's service actor, named for the run (:func:`find_run_rollout`); its engines'
    processes start in ``engine_env`` (the trainer's sets the ranks' CPU priority,
    ``worker.priority``: an engine is on the step's path as a rank is)."""
    from raytrain_ext.data.open import tokenizer_spec
    from raytrain_ext.prepare.tokenizer import load_tokenizer

    spec = tokenizer_spec(cfg)
    assert spec is not None  # preflight: check_prompt_data
    tokenizer = load_tokenizer(spec, cfg.data.eos_token)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    r = cfg.rollout
    rollout = RolloutSpec(
        build=HFPolicyBuilder(cfg.model),
        settings=rollout_settings(cfg, eos, pad),
        rewards=RewardSpec(
            functions=list(reward_fns) if reward_fns is not None else list(r.reward_fns),
            weights=None if r.reward_weights is None else list(r.reward_weights),
            scale_rewards=cfg.objective.grpo.scale_rewards,
        ),
        engines=r.engines,
        spare_engines=r.spare_engines,
        engine_options=engine_options(dict(r.resources_per_engine), engine_env),
        decode=TokenizerDecode(spec, cfg.data.eos_token),
        timeout_s=r.timeout_s,
        reference=HFReferenceBuilder(cfg.model, cfg.run.seed) if cfg.objective.grpo.beta else None,
        schedule=WeightsSchedule.of(cfg),
        backend=VLLMEngineBuilder(cfg.model) if r.backend == RolloutBackend.vllm else None,
    )
    check_room(cfg)
    # every rank of a group, and of a group that re-formed mid-wait, may wait in it at once
    threads = max(16, 4 * cfg.scaling.max_workers + 4)
    service = start_rollout_service(rollout, threads, name=service_name(cfg.run.name))
    await_engines(service, cfg)
    return service


def check_room(cfg) -> None:
    """The engines and the smallest trainer group fit the cluster's resources at all (the
    engines are placed first: the trainers then take what is left)."""
    import ray

    total = ray.cluster_resources()
    engines = dict(cfg.rollout.resources_per_engine)
    workers = dict(cfg.scaling.resources_per_worker)
    count = cfg.rollout.engines + cfg.rollout.spare_engines
    for name in sorted(set(engines) | set(workers)):
        need = count * engines.get(name, 0.0)
        need += cfg.scaling.min_workers * workers.get(name, 0.0)
        if need > total.get(name, 0.0) + 1e-9:
            raise InputError(
                f"rollout.resources_per_engine: {count} engine(s) of {engines} (spares included) "
                f"and scaling.min_workers={cfg.scaling.min_workers} trainers of {workers} need "
                f"{need:g} {name}, but the cluster has {total.get(name, 0.0):g}; lower "
                "rollout.resources_per_engine, rollout.engines, rollout.spare_engines or "
                "scaling.resources_per_worker, "
                "or add nodes."
            )


def await_engines(service: Any, cfg) -> None:
    """Every engine placed and its model built before the trainers are placed; a service
    that cannot start is ended, with the reason."""
    import ray

    try:
        ray.get(service.engine_placements.remote(), timeout=cfg.rollout.timeout_s)
    except (ray.exceptions.RayError, TimeoutError) as e:
        ray.kill(service, no_restart=True)
        raise InputError(
            f"rollout: the {cfg.rollout.engines} rollout engine(s) did not start within "
            f"rollout.timeout_s={cfg.rollout.timeout_s:g} s ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); check rollout.resources_per_engine "
            "against the cluster's free resources."
        ) from None


def find_run_rollout(run_name: str) -> Any:
    """The run's service actor (a rank's handle to it)."""
    import ray

    return ray.get_actor(service_name(run_name), namespace=ROLLOUT_NAMESPACE)


def rollout_record(service: Any, timeout_s: float = 30.0) -> Dict[str, Any]:
    """The service's record for the run's summary: steps generated and every engine lost
    (an unreachable service says so instead)."""
    import ray

    try:
        return ray.get(service.stats.remote(), timeout=timeout_s)
    except (ray.exceptions.RayError, TimeoutError) as e:
        return {"error": f"the rollout service could not be asked: {type(e).__name__}"}
