"""Reward functions, TRL's way: ``fn(prompts, completions, **columns) -> list[float | None]``,
one value per completion, None where the function does not apply to it.

Why strict: a reward that silently becomes 0 (a crash, a short list, a NaN, a string)
biases every advantage of its group, and the run trains on it without a trace (NeMo-RL
committed failed generations as zero rewards).  Here each of those stops the run with
the function's name and the prompt's global index.

Where they run: :func:`score_groups` scores on the calling thread; the GRPO loop runs it
in Ray tasks (one per batch of groups) so that a slow reward, code execution say, never
holds the trainers.

Invariant: the scores of a group depend only on its prompts, completions and columns,
never on which task or in which order groups were scored.
"""

from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from raytrain_ext.errors import InputError
from raytrain_ext.user_code import import_function

RewardFn = Callable[..., Sequence[Optional[float]]]


class RewardError(InputError):
    """A reward function raised or returned what is not one score per completion."""


def load_reward_fn(path: str) -> RewardFn:
    """The function ``"pkg.module:name"`` names (``rollout.reward_fns``)."""
    return import_function(
        path,
        "rollout.reward_fns",
        "a function (prompts, completions, **columns) -> list of float or None",
        "a function (prompts, completions, **columns)",
        InputError,
    )


@dataclass(frozen=True)
class ScoredGroup:
    """One prompt group to score: its global index, prompt and completions (text, as the
    run decodes them), and the dataset's other columns of that prompt, passed through to
    every function."""

    prompt_index: int
    prompt: Any
    completions: Sequence[Any]
    columns: Dict[str, Any] = field(default_factory=dict)


def function_name(fn: RewardFn) -> str:
    """``module:qualname`` of a function or method; a callable object's class name."""
    if inspect.isroutine(fn):
        return f"{fn.__module__}:{fn.__qualname__}"
    return f"{type(fn).__module__}:{type(fn).__qualname__}"


def score_groups(fns: Sequence[RewardFn], groups: Sequence[ScoredGroup]) -> List[List[List[float]]]:
    """``[group][completion][function]`` scores (NaN where a function returned None), each
    function called once over all completions of ``groups`` as TRL calls it (prompts
    repeated per completion, each column likewise)."""
    prompts = [g.prompt for g in groups for _ in g.completions]
    completions = [c for g in groups for c in g.completions]
    owners = [g.prompt_index for g in groups for _ in g.completions]
    columns = _columns(groups)
    per_function = [_call(fn, prompts, completions, columns, owners) for fn in fns]
    scores, at = [], 0
    for group in groups:
        n = len(group.completions)
        scores.append([[values[at + k] for values in per_function] for k in range(n)])
        at += n
    return scores


def _columns(groups: Sequence[ScoredGroup]) -> Dict[str, List[Any]]:
    names = set(groups[0].columns) if groups else set()
    for group in groups:
        if set(group.columns) != names:
            raise InputError(
                f"prompt {group.prompt_index} has the columns {sorted(group.columns)}, "
                f"others {sorted(names)}: every prompt record needs the same columns"
            )
    return {name: [g.columns[name] for g in groups for _ in g.completions] for name in names}


def _call(
    fn: RewardFn,
    prompts: List[Any],
    completions: List[Any],
    columns: Dict[str, List[Any]],
    owners: List[int],
) -> List[float]:
    name = function_name(fn)
    first = owners[0] if owners else -1
    try:
        values = fn(prompts, completions, **columns)
    except Exception as e:  # noqa: BLE001 - named and re-raised as the run's error
        raise RewardError(
            f"reward function {name} raised {type(e).__name__}: {e} (prompts from index "
            f"{first}); fix the function: a reward that fails is never counted as 0"
        ) from e
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise RewardError(
            f"reward function {name} returned {type(values).__name__}, not a list of one "
            f"float or None per completion (prompts from index {first})"
        )
    if len(values) != len(completions):
        raise RewardError(
            f"reward function {name} returned {len(values)} values for {len(completions)} "
            f"completions (prompts from index {first}): return one per completion"
        )
    return [_checked(value, name, owner) for value, owner in zip(values, owners, strict=True)]


def _checked(value: Any, name: str, prompt_index: int) -> float:
    if value is None:
        return math.nan  # the function does not apply: left out, as in TRL
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardError(
            f"reward function {name} returned {value!r} ({type(value).__name__}) for a "
            f"completion of prompt {prompt_index}: return a float, or None where it does "
            "not apply"
        )
    if not math.isfinite(value):
        raise RewardError(
            f"reward function {name} returned {value} for a completion of prompt "
            f"{prompt_index}: return a finite float, or None where it does not apply"
        )
    return float(value)
