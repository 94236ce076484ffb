"""A model that is not the reference GPT, trained by DDP and FSDP through its ModelSpec on
two gloo processes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from raytrain_ext.parallel.ddp import DDPStrategy
from raytrain_ext.parallel.fsdp import FSDPStrategy
from raytrain_ext.parallel.strategy import DistContext, Strategy
from raytrain_ext.worker.dist_env import destroy_distributed
from raytrain_ext.worker.rendezvous import free_port
from tests.helpers.dist import init_local_rank, spawn_ranks
from tests.helpers.toy import TOY_SPEC, PlainStrategy

FSDP_OPTIONS = SimpleNamespace(activation_checkpointing=False, compile=False, cpu_offload=False)


def _train(strategy: Strategy, ctx: DistContext, steps: int = 3) -> dict:
    """SGD on a fixed regression, each rank its half of every batch (DDP's split)."""
    model = strategy.wrap(TOY_SPEC.build(None, 5), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(0)
    for _ in range(steps):
        inputs, targets = torch.randn(4, 8, generator=data), torch.randn(4, 1, generator=data)
        share = slice(2 * ctx.rank, 2 * ctx.rank + 2) if ctx.world_size == 2 else slice(None)
        with strategy.accumulate(model, sync=True):
            loss = ((model(inputs[share]) - targets[share]) ** 2).mean()
            strategy.backward(model, loss)
        strategy.clip_grad_norm(model, 0.0)
        strategy.step(model, optimizer)
        strategy.zero_grad(model, optimizer)
    return {name: p.clone() for name, p in strategy.full_parameters(model).items()}


def _rank(rank: int, world: int, port: int, out_dir: str) -> None:
    device = init_local_rank(rank, world, port)
    try:
        ctx = DistContext(rank, world, rank, device, None)
        results = {
            "ddp": _train(DDPStrategy(None, TOY_SPEC), ctx),
            "fsdp": _train(FSDPStrategy(FSDP_OPTIONS, TOY_SPEC), ctx),
        }
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        destroy_distributed()


def test_ddp_and_fsdp_train_a_model_of_another_family_through_its_spec(tmp_path):
    """Two gloo ranks, each half of every batch: the same parameters as one process
    training on whole batches (gradients averaged), under DDP and FSDP alike."""
    spawn_ranks(_rank, (2, free_port("127.0.0.1"), str(tmp_path)), 2)
    single = SimpleNamespace(rank=0, world_size=1)
    reference = _train(PlainStrategy(), single)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for name in ("ddp", "fsdp"):
            assert set(results[name]) == set(reference)
            for key, value in reference.items():
                torch.testing.assert_close(results[name][key], value, msg=f"{name} {key}")
