"""GRPO test helpers: the tiny config's prompts, and the ledger a run must end with."""

from __future__ import annotations

from pathlib import Path

from raytrain_ext.data.sampler import GlobalSampler
from raytrain_ext.rollout.order import RolloutOrder
from raytrain_ext.train.ledger import SampleLedger

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "grpo_tiny.yaml"
PROMPTS = REPO / "configs" / "data" / "dpo_tiny.jsonl"


def expected_samples_digest(steps: int, groups: int, seed: int, iterations: int = 1) -> str:
    """The ledger of a run that consumed the global order's prompt groups, each step's
    whole (each generation's for ``iterations`` steps), computed from the sampler alone
    (no run)."""
    prompts = len(PROMPTS.read_text().splitlines())
    order = RolloutOrder(GlobalSampler(prompts, groups, seed), iterations)
    ledger = SampleLedger()
    for step in range(steps):
        ledger.record(step, order.next_global_batch())
    return ledger.digest
