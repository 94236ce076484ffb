"""The sections the training loop reads: ``optim``, ``guards``, ``profile`` and ``eval``;
their own checks (``check_optim_section``, ``check_profile_section``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from raytrain_ext.errors import ConfigError
from raytrain_ext.typed_config.choice import Choice
from raytrain_ext.typed_config.fields import at_least, positive, within


class NanPolicy(Choice):
    """``guards.nan_policy``: a non-finite step is skipped (no update, batch consumed), rolled back
    to the last checkpoint (the batch skipped), or fails the run."""

    skip_step = "skip_step"
    rollback = "rollback"
    fail = "fail"


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay to ``min_lr``."""

    lr: float = positive(3.0e-3)
    min_lr: float = at_least(0, 3.0e-4)
    weight_decay: float = at_least(0, 0.1)
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = positive(1.0e-8)
    warmup_steps: int = at_least(0, 5)
    decay_steps: int = positive("${run.max_steps}")
    grad_clip: float = at_least(0, 1.0)


@dataclass
class GuardsConfig:
    """In-run guards, on by default.

    A rank whose compute time per step exceeds ``straggler_factor`` x the median
    of all ranks for ``straggler_window`` consecutive steps is reported (and
    evicted by the elastic controller when ``evict_stragglers``).  A non-finite
    loss or gradient norm is handled by ``nan_policy``: ``skip_step`` (no update,
    the batch is consumed), ``rollback`` (restore the last checkpoint and skip the
    offending batch) or ``fail``.  When the controller declares a hang, Python
    stacks of every worker go to ``<run_dir>/hang-stacks/``.
    """

    straggler_factor: float = positive(1.5)
    straggler_window: int = positive(20)
    evict_stragglers: bool = False
    nan_policy: NanPolicy = NanPolicy.skip_step
    max_nan_steps: int = at_least(0, 10)  # more non-finite steps than this in one run: fail
    hang_stacks: bool = True


@dataclass
class ProfileConfig:
    """torch.profiler traces (Chrome trace format, open in Perfetto) for a step range.

    ``steps: [a, b]`` records steps a..b inclusive on the ``ranks`` listed;
    an empty list disables profiling.
    """

    steps: List[int] = field(default_factory=list)
    ranks: List[int] = field(default_factory=lambda: [0])
    dir: str = "${run.output_dir}/${run.name}/profile"
    record_shapes: bool = False
    with_stack: bool = False


@dataclass
class EvalConfig:
    """Evaluation every ``every_steps`` steps (null: never) on ``data.eval_path`` or on the
    last ``fraction`` of the samples, which are then held out of training.  Evaluation
    never changes the training order or the sample ledger."""

    every_steps: Optional[int] = positive(None, null="disabled")
    fraction: float = within(0, 0.5, 0.0, hi_open=True)
    max_samples: Optional[int] = positive(None, null="all")  # cap per evaluation


def check_optim_section(o: OptimConfig) -> None:
    if o.min_lr > o.lr:
        raise ConfigError(
            f"optim.min_lr: {o.min_lr} is larger than optim.lr={o.lr}. Set min_lr <= lr."
        )
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        raise ConfigError(
            f"optim.betas: {list(o.betas)} must be two numbers in [0, 1), for example [0.9, 0.95]."
        )


def check_profile_section(p: ProfileConfig) -> None:
    """The step range's shape (which ranks exist depends on ``scaling``: validate)."""
    steps = list(p.steps)
    if steps and not (len(steps) == 2 and 1 <= steps[0] <= steps[1]):
        raise ConfigError(
            f"profile.steps: {steps} must be [] (off) or [first, last] with "
            "1 <= first <= last, for example profile.steps=[10,12]."
        )
