"""Which objective a run trains with, and whether it fits the data and the layout:
checked on the driver before Ray starts (no torch here), naming the key and the fix.

A loss function given from Python (``Trainer(cfg, loss_fn=...)``) makes the objective
``user``, exactly as ``objective.name=user`` with ``objective.fn`` does.  Without an
``objective.name`` the objective follows what is given: ``user`` with a loss function,
else the one the data format trains with (chat: sft, preference: dpo, else causal_lm),
as the README's table of formats says; an explicit ``objective.name`` always wins.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

from raytrain_ext.data.config import DataFormat
from raytrain_ext.errors import InputError
from raytrain_ext.objectives.config import ObjectiveName

# the data format each built-in objective trains on (keyed by value: a member is its str)
FORMATS: Dict[str, Tuple[str, ...]] = {
    ObjectiveName.causal_lm: (DataFormat.tokens, DataFormat.text),
    ObjectiveName.sft: (DataFormat.chat,),
    ObjectiveName.dpo: (DataFormat.preference,),
    ObjectiveName.grpo: (DataFormat.prompts,),
}
# what each format-bound objective trains on, and what its data must hold
TRAINS_ON: Dict[str, str] = {
    ObjectiveName.sft: "the loss on response tokens",
    ObjectiveName.dpo: "preference pairs",
    ObjectiveName.grpo: "completions generated from the prompts",
}
NEEDS: Dict[str, str] = {
    ObjectiveName.sft: "prompt/response examples whose prompt tokens are masked out of the loss",
    ObjectiveName.dpo: "(prompt, chosen, rejected) records",
    ObjectiveName.grpo: "records with a 'prompt' or chat 'messages' to generate from",
}
# the objective each non-packed data format needs
OBJECTIVE_OF_FORMAT: Dict[str, str] = {
    DataFormat.chat: ObjectiveName.sft,
    DataFormat.preference: ObjectiveName.dpo,
    DataFormat.prompts: ObjectiveName.grpo,
}


def objective_name(objective_cfg, data_format: str, loss_fn: Optional[Callable] = None) -> str:
    """The objective that runs: ``user`` when a loss function is given from Python, else
    ``objective.name``, else the default that follows ``objective.fn`` and ``data_format``;
    an InputError when ``objective.*`` and ``loss_fn`` contradict."""
    name, fn = objective_cfg.name, objective_cfg.fn
    if name is None:
        given = loss_fn is not None or fn is not None
        name = ObjectiveName.user if given else default_objective(data_format)
    if loss_fn is not None:
        if not callable(loss_fn):
            raise InputError(
                f"loss_fn: {loss_fn!r} is not callable; pass a function (logits, batch) -> "
                "the sum of its per-token losses."
            )
        if fn is not None:
            raise InputError(
                f"objective.fn: set to {fn!r} and a loss_fn was also given from Python; give "
                "one of them."
            )
        if name not in (ObjectiveName.causal_lm, ObjectiveName.user):
            raise InputError(
                f"objective.name: a loss_fn given from Python makes the objective 'user', but "
                f"objective.name={name}; remove one of them."
            )
        return ObjectiveName.user
    if fn is not None and name != ObjectiveName.user:
        raise InputError(
            f"objective.fn: set to {fn!r} but objective.name={name}; set objective.name=user "
            "to train with it, or remove objective.fn."
        )
    if name == ObjectiveName.user and fn is None:
        raise InputError(
            "objective.fn: objective.name=user needs objective.fn=pkg.module:loss, or the "
            "loss passed from Python: Trainer(cfg, loss_fn=loss)."
        )
    return name


def check_objective(cfg, loss_fn: Optional[Callable] = None) -> None:
    """Before Ray: the objective fits ``data.format`` and ``parallel.pp``, and its function
    (``objective.fn``) imports (GRPO's rollout: ``rollout.config.check_rollout``)."""
    name = objective_name(cfg.objective, cfg.data.format, loss_fn)
    data_format = cfg.data.format
    if name in FORMATS and data_format not in FORMATS[name]:
        raise InputError(_format_mismatch(name, data_format))
    if cfg.parallel.pp > 1 and name != ObjectiveName.causal_lm:
        given = " (the loss_fn given from Python)" if loss_fn is not None else ""
        raise InputError(
            f"parallel.pp: objective.name={name}{given} is not supported with pipeline "
            f"parallelism yet (parallel.pp={cfg.parallel.pp}: the pipeline schedule computes "
            "the causal-LM loss on its last stage). Set parallel.pp=1."
        )
    if name == ObjectiveName.user and data_format == DataFormat.preference:
        raise InputError(
            "data.format: a user objective averages over target tokens, but preference data "
            "is averaged over pairs; train preference records with objective.name=dpo, or "
            "give the user loss tokens, text or chat data."
        )
    if name == ObjectiveName.user and loss_fn is None:
        from raytrain_ext.objectives.user import load_loss_fn

        load_loss_fn(cfg.objective.fn)


def default_objective(data_format: str) -> str:
    """The objective a format trains with when ``objective.name`` is not given."""
    return OBJECTIVE_OF_FORMAT.get(data_format, ObjectiveName.causal_lm)


def _format_mismatch(name: str, data_format: str) -> str:
    if data_format in OBJECTIVE_OF_FORMAT:
        wanted = OBJECTIVE_OF_FORMAT[data_format]
        what = TRAINS_ON[wanted]
        return (
            f"objective.name={name} does not train on data.format={data_format}: that format "
            f"needs objective.name={wanted} ({what}). objective.name={name} trains on "
            f"data.format={' or '.join(FORMATS[name])}."
        )
    needed = FORMATS[name][0]
    what = NEEDS[name]
    return (
        f"objective.name={name} needs data.format={needed} ({what}); got "
        f"data.format={data_format}. Set data.format={needed}, or train every token with "
        "objective.name=causal_lm."
    )
