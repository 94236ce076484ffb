"""Which checkpoint to use: the one routine behind train's restore, ``ckpt export`` and
``report``, so that all three agree on what is usable and say the same thing about what
is not.

A step is a checkpoint once its ``manifest.json`` is there (written last, atomically).
A step can be: usable (the manifest parses); committed, then damaged (a manifest is
there but does not parse: never a state the writer leaves, so something altered it
afterwards); or never committed (files without a manifest: a save that did not finish,
or a step being deleted).  Only the first is loaded; the others are skipped with that
description, newest first, and the newest usable one wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from raytrain_ext.checkpoint.manifest import MANIFEST, Manifest, step_dir_name
from raytrain_ext.checkpoint.tiers.base import Tier, TierError


@dataclass
class StepCheck:
    """One step of one tier: its manifest when usable, else what is wrong with it."""

    step: int
    manifest: Optional[Manifest]
    problem: Optional[str]


@dataclass
class Resolution:
    """The step chosen (None: nothing usable) and the newer steps skipped, with why."""

    step: Optional[int]
    manifest: Optional[Manifest]
    skipped: List[str] = field(default_factory=list)


def parse_manifest(step: int, text: Optional[str], where: str) -> StepCheck:
    """``text`` as a tier returned it (None: no manifest there) -> a :class:`StepCheck`."""
    if text is None:
        return StepCheck(
            step,
            None,
            f"{where} has no {MANIFEST}: its save never committed (or the step is being deleted)",
        )
    try:
        return StepCheck(step, Manifest.from_json(text), None)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return StepCheck(
            step,
            None,
            f"{where}/{MANIFEST} is there but is not a valid manifest "
            f"({type(e).__name__}: {_first_line(e)}): the step was "
            "committed, then its manifest was damaged",
        )


def check_step(tier: Tier, step: int) -> StepCheck:
    """One step of one tier; a manifest that cannot be read (permissions, an S3 outage past
    its retries) is a problem of that step, so the caller can fall back to another."""
    where = describe(tier, step)
    try:
        return parse_manifest(step, tier.manifest_text(step), where)
    except (OSError, TierError) as e:
        return StepCheck(step, None, f"{where}/{MANIFEST} cannot be read: {e}")


def describe(tier: Tier, step: int) -> str:
    return f"{tier.name} {step_dir_name(step)}"


def newest_usable(tier: Tier, step: Optional[int] = None) -> Resolution:
    """``step`` given: that step, or None with its problem; else the newest usable step,
    skipping damaged ones (a step without a manifest is not a checkpoint and is not listed)."""
    candidates = [step] if step is not None else sorted(tier.committed_steps(), reverse=True)
    skipped: List[str] = []
    for candidate in candidates:
        check = check_step(tier, candidate)
        if check.manifest is not None:
            return Resolution(candidate, check.manifest, skipped)
        skipped.append(str(check.problem))
    return Resolution(None, None, skipped)


def _first_line(error: BaseException) -> str:
    lines = str(error).splitlines()
    return lines[0] if lines else ""
