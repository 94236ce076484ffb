"""Reward functions for the examples and the tiny GRPO config (``configs/grpo_tiny.yaml``),
shipped with the package as ``builtin:corpus`` is, so they import wherever the package does.
Each has TRL's signature: ``fn(prompts, completions, **columns) -> list[float | None]``."""

from __future__ import annotations

from typing import Any, List, Sequence


def reward_len(prompts: Sequence[Any], completions: Sequence[str], **columns: Any) -> List[float]:
    """TRL's quick-start reward: completions of 20 characters are best
    (``-abs(20 - len(completion))``)."""
    return [-abs(20 - len(completion)) for completion in completions]
