"""``model.source: python``: the user's own ``nn.Module``, named by ``model.factory``.

``model.factory`` is ``"pkg.module:name"``.  ``name`` is either a callable
``(model_cfg, seed) -> nn.Module`` whose forward maps token ids to logits, or a
``ModelSpec`` (whose ``build`` is that callable) for layouts that need more than the
module: tensor parallelism (``tp_block_plan``), pipeline stages (``pipeline_stage``).
Without a spec, DDP and FSDP2 run it; FSDP wraps every module of class
``model.block_class`` (e.g. ``TransformerBlock``) as one unit, or only the root when it
is unset.  Both are checked on the driver, before Ray starts.
"""

from __future__ import annotations

from typing import Any, List

import torch.nn as nn

from raytrain_ext.errors import ConfigError
from raytrain_ext.models.spec import ModelSpec
from raytrain_ext.user_code import import_named


def load_factory(path: str | None) -> Any:
    """The object ``model.factory`` names; a ConfigError naming the key when it is not there."""
    target = import_named(
        path,
        "model.factory",
        "the function that builds your model (model_cfg, seed) -> nn.Module "
        "(with model.source=python)",
        ConfigError,
    )
    if not (isinstance(target, ModelSpec) or callable(target)):
        raise ConfigError(f"model.factory: {path} is neither a callable nor a ModelSpec.")
    return target


def blocks_of_class(class_name: str | None):
    """``ModelSpec.blocks`` for a spec-less module: every submodule of that class."""

    def blocks(module: nn.Module) -> List[nn.Module]:
        if not class_name:
            return []
        return [m for m in module.modules() if type(m).__name__ == class_name]

    return blocks


def python_spec(model_cfg, target: Any = None) -> ModelSpec:
    """The user's spec, or one built around their factory (DDP and FSDP only); ``target`` is
    the factory or spec given from Python (``Trainer(cfg, model=...)``), else
    ``model.factory``'s."""
    if target is None:
        target = load_factory(model_cfg.factory)
    if isinstance(target, ModelSpec):
        return target
    if not callable(target):
        raise ConfigError(f"model: {target!r} is neither a callable nor a ModelSpec.")
    name = model_cfg.factory or "the model given to Trainer"
    return ModelSpec(name=name, build=target, blocks=blocks_of_class(model_cfg.block_class))


def check_python_model(cfg, target: Any = None) -> None:
    """Before Ray: the factory imports (or was given), and a layout that needs a spec member
    has it."""
    if target is None and cfg.model.factory is None:
        raise ConfigError(
            "model.factory: model.source=python needs model.factory=pkg.module:build, or the "
            "model passed from Python: Trainer(cfg, model=build)."
        )
    spec = python_spec(cfg.model, target)
    needs = (
        (cfg.parallel.tp > 1, "tp_block_plan", "parallel.tp"),
        (cfg.parallel.sequence_parallel, "tp_model_plan", "parallel.sequence_parallel"),
        (cfg.parallel.pp > 1, "pipeline_stage", "parallel.pp"),
    )
    for wanted, member, key in needs:
        if wanted and getattr(spec, member) is None:
            raise ConfigError(
                f"{key}: {spec.name} gives no ModelSpec.{member}, which this layout "
                f"needs. Point model.factory at a ModelSpec that defines {member} "
                "(raytrain_ext.models.spec), or train with DDP/FSDP only."
            )
