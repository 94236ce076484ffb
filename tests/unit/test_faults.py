"""The fault injector's hooks (unit rung, no Ray): each fires only on its rank, step and
armed attempts; a kill is a real process exit."""

import multiprocessing
import threading

import pytest
import torch

from raytrain_ext.config import load_config
from raytrain_ext.faults import FaultInjector


def chaos(*overrides):
    return load_config(None, [f"chaos.{o}" for o in overrides]).chaos


def test_nan_fires_on_its_rank_and_step_only_while_armed():
    cfg = chaos("nan_rank=1", "nan_at_step=3", "attempts=1")
    loss = torch.tensor(2.0)
    assert torch.isnan(FaultInjector(cfg, rank=1, attempt=0).on_loss(3, loss))
    assert FaultInjector(cfg, rank=1, attempt=0).on_loss(2, loss) == loss
    assert FaultInjector(cfg, rank=0, attempt=0).on_loss(3, loss) == loss
    assert FaultInjector(cfg, rank=1, attempt=1).on_loss(3, loss) == loss  # a re-form: disarmed
    assert FaultInjector.disarmed(cfg, rank=1).on_loss(3, loss) == loss
    assert FaultInjector(chaos("stall_save_s=1.5"), rank=0).save_stall_s == 1.5
    assert FaultInjector(chaos("stall_save_s=1.5"), rank=0, attempt=1).save_stall_s == 0


def _step_then_report(queue, overrides, step):
    FaultInjector(chaos(*overrides), rank=0).after_step(step, lambda phase: None)
    queue.put("survived")


@pytest.mark.parametrize("step, code", [(4, 1), (3, 0)])
def test_kill_exits_the_process_after_its_step(step, code):
    # forked: a spawned child re-imported torch and this module (2 s of the unit tier each)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(
        target=_step_then_report, args=(queue, ["kill_rank=0", "kill_at_step=4"], step)
    )
    child.start()
    child.join(60)
    assert child.exitcode == code
    assert queue.empty() == (code == 1)


def test_hang_marks_the_phase_and_never_returns():
    marks = []
    hook = FaultInjector(chaos("hang_rank=0", "hang_at_step=2"), rank=0).after_step
    thread = threading.Thread(target=hook, args=(2, marks.append), daemon=True)
    thread.start()
    thread.join(0.3)
    assert thread.is_alive() and marks == ["hung"]
