"""Comparing parallel layouts with plain DDP: the tolerances (why they are what they are is in
multiprocess/test_training_math.py), a short gloo training run, and the assertion that a
layout trained the same model on the same samples."""

from __future__ import annotations

from tests.helpers.dist import train_processes

ATOL = 1e-5

ATOL_UNEVEN = 1e-4

LAYOUT_BASE = [
    "run.max_steps=8",
    "data.global_batch_size=8",
    "data.micro_batch_size=2",
    "optim.warmup_steps=2",
    "checkpoint.every_steps=4",
    "checkpoint.every_seconds=null",
]
FSDP = ["parallel.strategy=fsdp"]
LOSS_ATOL = 1e-5
TP_LOSS_ATOL = 1e-4


def max_param_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def train(world, tmp, *extra):
    return train_processes(
        world, LAYOUT_BASE + [f"checkpoint.dir={tmp / 'ckpt'}", *extra], tmp / "out"
    )


def curve(rank_output, key):
    """{step: value} from the per-step records the loop reported."""
    return {r["step"]: r[key] for r in rank_output["records"]}


def assert_matches(ranks, reference, atol=ATOL, loss_atol=LOSS_ATOL):
    """Parameters, every step's loss and gradient norm, and the sample ledger match."""
    ref = reference[0]
    assert max_param_diff(ranks[0]["params"], ref["params"]) < atol
    assert len({r["result"]["params_sha256"] for r in ranks}) == 1  # every rank sees one model
    loss, ref_loss = curve(ranks[0], "loss"), curve(ref, "loss")
    norm, ref_norm = curve(ranks[0], "grad_norm"), curve(ref, "grad_norm")
    assert loss and all(abs(loss[s] - ref_loss[s]) < loss_atol for s in loss)
    assert all(abs(norm[s] - ref_norm[s]) < 1e-4 * ref_norm[s] for s in norm)
    # the global order is world-size independent: each sample counted exactly once
    assert {r["result"]["samples_digest"] for r in ranks} == {ref["result"]["samples_digest"]}
    assert ranks[0]["result"]["samples_consumed"] == 8 * 8
