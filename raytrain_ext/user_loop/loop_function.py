"""``LoopFunction``: the user's function and what every rank needs to run it, shipped from
the driver with each ``fit`` (in ``UserCode.train_loop``, cloudpickled: a closure or a
function defined in a notebook works).  Torch-free: the driver builds it."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

from raytrain_ext.user_loop.checkpoint import Checkpoint
from raytrain_ext.user_loop.storage import RunStorage


@dataclass(frozen=True)
class LoopFunction:
    """``fn``: Ray Train's ``train_loop_per_worker``, called as ``fn(config)`` when it takes
    an argument, else ``fn()``; ``resume_from``: ``resume_from_checkpoint``, what
    ``get_checkpoint`` returns before the run committed one of its own."""

    fn: Callable[..., Any]
    config: Optional[Dict[str, Any]]
    storage: RunStorage
    experiment_name: str
    resume_from: Optional[Checkpoint] = None
    datasets: Dict[str, Any] = field(default_factory=dict)
    metadata: Dict[str, Any] = field(default_factory=dict)

    def call(self) -> Any:
        if takes_config(self.fn):
            return self.fn(self.config if self.config is not None else {})
        return self.fn()


def takes_config(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` takes the loop's config (one positional parameter), as Ray Train
    decides; more than one required parameter is refused."""
    params = [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    required = [p for p in params if p.default is p.empty and p.kind != p.VAR_POSITIONAL]
    if len(required) > 1:
        raise ValueError(
            f"train_loop_per_worker {getattr(fn, '__name__', fn)!r} takes "
            f"{len(required)} required arguments; it takes none or one (the "
            "train_loop_config dict)"
        )
    return bool(params)
