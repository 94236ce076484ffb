"""The small MLP the registered-state tests train over gloo (``tests/multiprocess``): its
objects as a loop registers them, a few deterministic steps, and its whole state to compare
to the bit."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def mlp_objects(mesh: Optional[Any], seed: int) -> dict:
    """The MLP (FSDP2 over ``mesh``, 1-D or HSDP's 2-D; plain for None), AdamW and a
    progress dict, built from ``seed``."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if mesh is not None:
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=False)
    return {"model": model, "optimizer": optimizer, "progress": {"epoch": 0}}


def train_steps(objects: dict, steps: int) -> None:
    """``steps`` optimizer steps on inputs seeded by rank and step; one epoch each."""
    model, optimizer = objects["model"], objects["optimizer"]
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * dist.get_rank() + step))
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        objects["progress"]["epoch"] += 1


def whole_state(objects: dict) -> dict:
    """Every parameter and Adam moment as a whole tensor (FSDP's gathered: a collective)."""

    def whole(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    model, optimizer = objects["model"], objects["optimizer"]
    out = {name: whole(p).detach().clone() for name, p in model.named_parameters()}
    for i, p in enumerate(model.parameters()):
        state = optimizer.state[p]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            out[f"{key}.{i}"] = whole(state[key]).clone()
    return out


def dcp_files(world: int) -> list:
    """The names ``registered_files`` writes for a group of ``world`` ranks, sorted."""
    data = [f"__{rank}_0.distcp" for rank in range(world)]
    return [".metadata", *data, *[f"checksums-{rank}.json" for rank in range(world)]]
