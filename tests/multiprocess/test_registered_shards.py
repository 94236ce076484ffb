"""``register``'s copies of sharded state (``user_loop.registered``), over gloo without Ray.

Four ranks train an MLP under HSDP (``fully_shard`` on a 2 x 2 mesh: two replicas of two
shards), copy their registered state at a report, and train on.  Then rank 1's process is
taken as new (its copy gone) and every rank builds the model and optimizer again from
another seed: the group finds each shard held live (shard 1 on rank 3, rank 1's replica),
each holder broadcasts its shard, and every rank's model and optimizer are the state of
the report again, whole tensors equal to the bit.
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from raytrain_ext.user_loop.registered import SnapshotKeeper, live_start
from raytrain_ext.user_loop.registered_state import layout_of, state_of
from raytrain_ext.worker.dist_env import destroy_distributed
from raytrain_ext.worker.rendezvous import free_port
from tests.helpers.dist import init_local_rank, spawn_ranks


def _hsdp_objects(mesh, seed: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=False)
    return {"model": model, "optimizer": optimizer, "progress": {"epoch": 0}}


def _train(objects: dict, steps: int) -> None:
    model, optimizer = objects["model"], objects["optimizer"]
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * dist.get_rank() + step))
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        objects["progress"]["epoch"] += 1


def _whole(objects: dict) -> dict:
    """Every parameter and Adam moment as a whole tensor (a collective)."""
    model, optimizer = objects["model"], objects["optimizer"]
    out = {name: p.full_tensor() for name, p in model.named_parameters()}
    for i, p in enumerate(model.parameters()):
        state = optimizer.state[p]
        out[f"exp_avg.{i}"] = state["exp_avg"].full_tensor()
        out[f"exp_avg_sq.{i}"] = state["exp_avg_sq"].full_tensor()
        out[f"step.{i}"] = state["step"].clone()
    return out


def _resume_after_a_lost_replica(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    init_local_rank(rank, 4, port)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        objects = _hsdp_objects(mesh, seed=0)
        _train(objects, 2)
        keeper = SnapshotKeeper()
        keeper.take("run", 2, {"train": (0, 16)}, objects, layout_of(state_of(objects), 4))
        expected = _whole(objects)
        _train(objects, 1)  # the live objects move on; the copy stays at report 2
        if rank == 1:
            keeper = SnapshotKeeper()  # a new process: it holds nothing
        offers: list = [None] * 4
        dist.all_gather_object(offers, keeper.offer("run"))
        start = live_start(offers, committed=0, world=4)
        fresh = _hsdp_objects(mesh, seed=1)
        layout = layout_of(state_of(fresh), 4)
        record = keeper.resume("run", start, fresh, layout, group=None)
        got = _whole(fresh)
        result = {
            "sources": list(start.sources),
            "layout": list(offers[rank][2].__dict__.values()) if offers[rank][2] else None,
            "equal": all(torch.equal(expected[k], got[k]) for k in expected),
            "progress": fresh["progress"],
            "source_rank": record["source_rank"],
            "kept": keeper.offer("run")[0],
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        destroy_distributed()


def test_hsdp_shards_come_back_from_their_live_replicas(tmp_path):
    spawn_ranks(_resume_after_a_lost_replica, (free_port("127.0.0.1"), str(tmp_path)), nprocs=4)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["layout"] for r in results] == [
        [4, 2, 0, True],
        None,
        [4, 2, 0, True],
        [4, 2, 1, True],
    ]
    assert all(r["sources"] == [0, 3] for r in results)  # shard 1 from rank 1's replica
    assert [r["source_rank"] for r in results] == [0, 3, 0, 3]
    assert all(r["equal"] for r in results)
    assert all(r["progress"] == {"epoch": 2} and r["kept"] == 2 for r in results)
