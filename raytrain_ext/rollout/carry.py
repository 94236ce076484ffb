"""A rollout result as plain values, for a checkpoint's JSON ``train`` items.

A GRPO checkpoint carries the results of the generations made with weights older than
its own (``WeightsSchedule.carried``), so a run resumed from it trains on exactly the
completions the uninterrupted run trained on.  Plain values (lists, numbers, strings),
not pickles: a checkpoint outlives the classes that wrote it.

Invariant: ``result_from_plain(json.loads(json.dumps(result_to_plain(r))))`` equals ``r``
field for field, tensors bit for bit (float32 values round-trip exactly through Python
floats; NaN, a reward function's None, through JSON's NaN).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from raytrain_ext.rollout.engine import GroupCompletions
from raytrain_ext.rollout.reference import CompletionLogps
from raytrain_ext.rollout.service import RolloutResult

TENSORS = ("rewards_per_function", "rewards", "advantages")


def result_to_plain(result: RolloutResult) -> Dict[str, Any]:
    plain: Dict[str, Any] = {
        "step": result.step,
        "groups": [_group_to_plain(g) for g in result.groups],
        "function_names": list(result.function_names),
        "phases_s": dict(result.phases_s),
        "weights_version": result.weights_version,
    }
    tensors = {
        "rewards_per_function": result.rewards_per_function,
        "rewards": result.rewards,
        "advantages": result.advantages,
    }
    for name, tensor in tensors.items():
        plain[name] = {"shape": list(tensor.shape), "values": tensor.flatten().tolist()}
    return plain


def result_from_plain(plain: Dict[str, Any]) -> RolloutResult:
    tensors = {
        name: torch.tensor(plain[name]["values"], dtype=torch.float32).view(plain[name]["shape"])
        for name in TENSORS
    }
    return RolloutResult(
        step=int(plain["step"]),
        groups=[_group_from_plain(g) for g in plain["groups"]],
        function_names=tuple(plain["function_names"]),
        phases_s=dict(plain["phases_s"]),
        weights_version=int(plain["weights_version"]),
        **tensors,
    )


def _group_to_plain(group: GroupCompletions) -> Dict[str, Any]:
    return {
        "prompt_index": group.prompt_index,
        "step": group.step,
        "completions": [list(c) for c in group.completions],
        "truncated": list(group.truncated),
        "weights_version": group.weights_version,
        "ref_logps": _logps_to_plain(group.ref_logps),
        "policy_logps": _logps_to_plain(group.policy_logps),
    }


def _group_from_plain(plain: Dict[str, Any]) -> GroupCompletions:
    return GroupCompletions(
        prompt_index=int(plain["prompt_index"]),
        step=int(plain["step"]),
        completions=tuple(tuple(int(t) for t in c) for c in plain["completions"]),
        truncated=tuple(bool(t) for t in plain["truncated"]),
        weights_version=int(plain["weights_version"]),
        ref_logps=_logps_from_plain(plain["ref_logps"]),
        policy_logps=_logps_from_plain(plain["policy_logps"]),
    )


def _logps_to_plain(logps: Optional[CompletionLogps]) -> Optional[list]:
    return None if logps is None else [list(row) for row in logps]


def _logps_from_plain(plain: Optional[list]) -> Optional[CompletionLogps]:
    return None if plain is None else tuple(tuple(float(v) for v in row) for row in plain)
