"""The torchft peer of ``ray_train_loop.py``'s kill scenario: Ray Train's ``TorchTrainer``
with ``TorchftConfig`` (Ray 2.60's ``train/v2/torch/torchft_config.py``), the strongest
open peer on the same substrate.

Each worker is its own replica group (Ray Train restarts a failed one alone); the loop
wraps the same MLP as ``bench_loop`` in torchft's ``Manager``, ``DistributedDataParallel``
and ``Optimizer`` (one quorum per step; the lighthouse lets one replica go on alone), and
notes each epoch of BATCHES steps as ``bench_loop`` does.  When a replica's process is
SIGKILLed, the survivor's step in flight fails and it goes on alone; Ray Train starts a new
process for the lost replica, which heals from the survivor at its first quorum.  Measured
here (torchft 0.2.0, Ray 2.60): in some runs the survivor's own step raises instead
(``assert fut._fut`` in torchft's DDP comm hook) and Ray Train restarts both; the run is
given ``max_failures=3`` so that it completes either way.

Figures: fault -> the first epoch any rank ends after it (``first_report_after_s``: the
survivor's), and fault -> the first epoch the replacement ends (``replaced_s``).
Needs ``pip install torchft==0.2.0`` (not in the CI install).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Dict

EPOCHS_AFTER_FAULT = 8


def torchft_loop(config: dict) -> None:
    """``bench_loop``'s MLP and batches under torchft, one replica group per worker."""
    from datetime import timedelta

    import ray.train as train
    import torch
    from torch import nn
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    rank, batches = train.get_context().get_world_rank(), config["batches"]
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 256))
    inner = torch.optim.SGD(module.parameters(), lr=0.01)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=30))
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=lambda s: (
            module.load_state_dict(s["model"]),
            inner.load_state_dict(s["optim"]),
        ),
        state_dict=lambda: {"model": module.state_dict(), "optim": inner.state_dict()},
        world_size=1,
        rank=0,
        replica_id=f"bench_{rank}",
        timeout=timedelta(seconds=60),
        checkpoint_transport=PGTransport(
            pg, timeout=timedelta(seconds=30), device=torch.device("cpu")
        ),
    )
    model, optimizer = DistributedDataParallel(manager, module), Optimizer(manager, inner)
    while manager.current_step() < config["epochs"] * batches:
        x = torch.randn(64, 256)
        loss = ((model(x) - x) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step = manager.current_step()
        if step % batches == 0:  # an epoch ended: noted as bench_loop notes it
            row = {
                "rank": rank,
                "epoch": step // batches - 1,
                "time": time.time(),
                "pid": os.getpid(),
            }
            with open(os.path.join(config["log_dir"], f"rank-{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
    manager.shutdown()


def kill_torchft(work: Path) -> Dict[str, float]:
    """2 workers on one node; SIGKILL rank 1's process at epoch FAULT_AT (module doc)."""
    import ray
    from ray import cloudpickle
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2.torch.torchft_config import TorchftConfig
    from ray_train_loop import BATCHES, FAULT_AT, _epoch_rows, rows
    from recovery_scaling import Background, wait_for

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import it

    log_dir = work / "torchft"
    log_dir.mkdir(parents=True)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        run = TorchTrainer(
            torchft_loop,
            train_loop_config={
                "epochs": FAULT_AT + EPOCHS_AFTER_FAULT,
                "batches": BATCHES,
                "log_dir": str(log_dir),
            },
            scaling_config=ScalingConfig(num_workers=2),
            torch_config=TorchftConfig(lighthouse_kwargs={"min_replicas": 1}, backend="gloo"),
            run_config=RunConfig(
                storage_path=str(work / "storage"), failure_config=FailureConfig(max_failures=3)
            ),
        )
        fit = Background(run.fit)
        at_fault = wait_for(lambda: _epoch_rows(log_dir, FAULT_AT), fit, "the fault epoch")
        victim = next(r["pid"] for r in reversed(at_fault) if r["rank"] == 1)
        fault = time.time()
        os.kill(victim, signal.SIGKILL)
        fit.result()
    finally:
        ray.shutdown()
    log = rows(log_dir)
    before = {r["pid"] for r in log if r["time"] <= fault}
    after = [r for r in log if r["time"] > fault]
    replaced = next((r for r in after if r["pid"] not in before), None)
    return {
        "first_report_after_s": after[0]["time"] - fault,
        "replaced_s": None if replaced is None else replaced["time"] - fault,
        "rank0_kept": float(len({r["pid"] for r in log if r["rank"] == 0}) == 1),
        "wall_s": fit.wall_s,
    }
