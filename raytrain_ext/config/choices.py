"""The closed sets of values config keys accept: one enum per set, the single source.

Why enums: a field of ``schema.py`` annotated with one of them is checked by OmegaConf
while YAML files and ``key=value`` overrides are merged, so a typo fails before Ray
starts, and the allowed values are written once, here, instead of in comments, tables
and dicts that drift apart.

Why ``StrEnum`` members named by their own value: code everywhere compares config
values with plain strings (``cfg.parallel.strategy == "fsdp"``), looks them up in
dicts keyed by strings and formats them into messages.  A ``StrEnum`` member equals,
hashes and formats as its value, and :class:`Choice` makes its ``repr`` the value's
too.  OmegaConf accepts a member's name or its value and writes the *name* when a
config becomes YAML or a plain dict (``enum_to_str``), so name and value must be the
same string: each enum is declared with members named by their values.  Three are built
at run time by :func:`_choice` instead, from values a registry holds or that are not
identifiers (``1f1b``); a type checker sees them as a ``Choice`` without named members
(no code names one of their members: a registry key is looked up, not spelled).

The strategies and model sources are the keys of their registries
(``parallel.catalog``, ``models.sources``), so a new one is its module and its registry
line.  Those two registries import nothing from the package, and this module nothing
else, so any module can import it without a cycle.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, Tuple, Type, cast

from raytrain_ext.models.sources import MODEL_SOURCES
from raytrain_ext.parallel.catalog import STRATEGY_CATALOG


class Choice(StrEnum):
    """Base of the choice enums: a member reads, compares and prints as its plain value."""

    def __repr__(self) -> str:
        """Messages format values with ``!r`` (``got 'zero'``); keep them free of enum noise."""
        return repr(self.value)

    @classmethod
    def values(cls) -> Tuple[str, ...]:
        """The allowed spellings, in declaration order (for messages and CLI choices)."""
        return tuple(member.value for member in cls)


def _choice(name: str, doc: str, *values: str) -> Type[Choice]:
    """An enum whose members are named by their values (see the module docstring)."""
    members = [(value, value) for value in values]
    enum = Choice(name, members, module=__name__, qualname=name)  # type: ignore[call-arg]
    enum.__doc__ = doc
    return cast(Type[Choice], enum)


class Device(Choice):
    """``run.device``: auto is cuda when the worker has a GPU, else cpu."""

    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class PlacementStrategy(Choice):
    """``scaling.placement_strategy``: Ray placement-group strategies, spelled as Ray does."""

    PACK = "PACK"
    SPREAD = "SPREAD"
    STRICT_PACK = "STRICT_PACK"
    STRICT_SPREAD = "STRICT_SPREAD"


class Backend(Choice):
    """``parallel.backend``: the process-group backend; auto is nccl on GPU, gloo on CPU."""

    auto = "auto"
    nccl = "nccl"
    gloo = "gloo"


class Precision(Choice):
    """A concrete training precision (the planner's ``--precision``)."""

    bf16 = "bf16"
    fp32 = "fp32"


class MixedPrecision(Choice):
    """``parallel.mixed_precision``: auto is bf16 on GPU, fp32 on CPU."""

    auto = "auto"
    bf16 = "bf16"
    fp32 = "fp32"


class Offload(Choice):
    """``parallel.zero.offload_optimizer``/``offload_param``: where ZeRO offloads to (nvme and any
    parameter offload need stage 3)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OnBusy(Choice):
    """``checkpoint.on_busy``: a save due while the previous one still persists is skipped, or
    waits for it."""

    skip = "skip"
    wait = "wait"


class NanPolicy(Choice):
    """``guards.nan_policy``: a non-finite step is skipped (no update, batch consumed), rolled back
    to the last checkpoint (the batch skipped), or fails the run."""

    skip_step = "skip_step"
    rollback = "rollback"
    fail = "fail"


class DataFormat(Choice):
    """``data.format``: pre-tokenized ids (a ``tokens`` column), plain text documents packed into
    ``seq_len`` windows, chat or prompt/response examples (loss on responses only), or (prompt,
    chosen, rejected) preference records."""

    tokens = "tokens"
    text = "text"
    chat = "chat"
    preference = "preference"


class ObjectiveName(Choice):
    """``objective.name``: next-token loss, supervised fine-tuning (response tokens only), direct
    preference optimisation, or the user's loss (``objective.fn``)."""

    causal_lm = "causal_lm"
    sft = "sft"
    dpo = "dpo"
    user = "user"


if TYPE_CHECKING:  # members known at run time only (see the module docstring)

    class ModelSource(Choice): ...

    class StrategyName(Choice): ...

    class PipelineSchedule(Choice): ...

else:
    ModelSource = _choice(
        "ModelSource",
        "``model.source``: the built-in reference GPT, a Hugging Face causal LM "
        "(``model.hf``), or the user's own ``nn.Module`` (``model.factory``); one per entry of "
        "``models.sources.MODEL_SOURCES``.",
        *MODEL_SOURCES,
    )
    StrategyName = _choice(
        "StrategyName",
        "``parallel.strategy``: DDP, FSDP2, or DeepSpeed ZeRO (configured by ``parallel.zero``); "
        "one per entry of ``parallel.catalog.STRATEGY_CATALOG``.",
        *STRATEGY_CATALOG,
    )
    PipelineSchedule = _choice(
        "PipelineSchedule",
        "``parallel.pp_schedule``: all forwards then all backwards (gpipe), or one forward "
        "one backward once the pipeline is full (1f1b, less activation memory).",
        "gpipe",
        "1f1b",
    )
