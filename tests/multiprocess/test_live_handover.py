"""State handed over by live peers (``train.live_state``), over gloo without Ray.

The ranks train 4 of 8 steps, keep their state in memory at the step boundary and
leave their group, as survivors of a failure or a pause do.  A new group is then
formed in the same processes: 2 ranks whose rank 1 holds nothing (a replacement
process), or 3 ranks shrunk to 2.  The new group takes the state from the ranks that
hold it, reads no checkpoint, and trains on.

Replaced, the run must equal the uninterrupted 2-rank run bit for bit: same samples,
and a sum of two gradients does not depend on the order DDP's new buckets add them
in (with three ranks it would: a fresh DDP wrapper buckets its first step's gradients
differently).  Shrunk, the same samples are seen once each and the parameters agree
with the 2-rank run within ``ATOL_UNEVEN`` (the 12-sample batch splits 4/4/4 for 4
steps: only float summation order differs; see test_training_math).
"""

from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from raytrain_ext.config import config_from_dict, load_config, to_dict
from raytrain_ext.worker.dist_env import destroy_distributed
from raytrain_ext.worker.rendezvous import free_port
from tests.helpers.dist import init_local_rank, spawn_ranks, train_processes
from tests.helpers.layouts import ATOL_UNEVEN, max_param_diff

BASE = [
    "run.max_steps=8",
    "data.global_batch_size=12",
    "data.micro_batch_size=2",
    "scaling.num_workers=2",
    "checkpoint.enabled=false",
]
HANDOVER_AT = 4


def _two_groups(rank: int, sizes, replaced: int, ports, cfg_dict: dict, out_dir: str) -> None:
    """``sizes``: the two groups' world sizes; ``replaced``: the rank whose process is new
    in the second group (it holds nothing), -1 when every process keeps its state."""
    from raytrain_ext.train.loop import TrainLoop

    cfg = config_from_dict(cfg_dict)
    device = init_local_rank(rank, sizes[0], ports[0])
    loop = TrainLoop(cfg, rank, sizes[0], rank, device, lambda record: None)
    for _ in range(HANDOVER_AT):
        loop.train_step()
    assert not loop.finished  # its state goes on to the next group (worker.actor keeps it)
    live = None if rank == replaced else loop.live_state()
    del loop
    destroy_distributed()
    if rank >= sizes[1]:
        return  # left out of the smaller group
    device = init_local_rank(rank, sizes[1], ports[1])
    try:
        loop = TrainLoop(cfg, rank, sizes[1], rank, device, lambda record: None, live=live)
        result = loop.fit()
        assert loop.finished  # the run is complete: a worker keeps nothing of it
        params = {k: v.clone() for k, v in loop.strategy.full_parameters(loop.model).items()}
        del loop
    finally:
        destroy_distributed()
    torch.save({"result": asdict(result), "params": params}, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return train_processes(2, BASE, tmp_path_factory.mktemp("straight"))


@pytest.mark.parametrize("first_size", [2, 3], ids=["replaced", "shrunk"])
def test_new_group_takes_the_state_of_live_peers(first_size, uninterrupted, tmp_path):
    cfg = load_config(None, [*BASE, f"scaling.num_workers={first_size}"])
    ports = (free_port("127.0.0.1"), free_port("127.0.0.1"))
    replaced = 1 if first_size == 2 else -1
    args = ((first_size, 2), replaced, ports, to_dict(cfg), str(tmp_path))
    spawn_ranks(_two_groups, args, first_size)
    runs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    restored = runs[0]["result"]["restored"]
    assert restored["tier"] == "peers" and restored["step"] == HANDOVER_AT
    assert restored["source_rank"] == 0  # the lowest rank holding the newest state
    straight = uninterrupted[0]
    assert runs[0]["result"]["steps"] == 8
    assert runs[0]["result"]["samples_digest"] == straight["result"]["samples_digest"]
    assert runs[0]["result"]["samples_consumed"] == 8 * 12
    if first_size == 2:
        assert runs[0]["result"]["params_sha256"] == straight["result"]["params_sha256"]
        assert runs[1]["result"]["params_sha256"] == straight["result"]["params_sha256"]
    else:
        assert max_param_diff(runs[0]["params"], straight["params"]) < ATOL_UNEVEN


@pytest.mark.parametrize("replaced", [0, 2], ids=["rank0", "last-rank"])
def test_three_ranks_with_one_replaced_end_bit_identical(replaced, tmp_path):
    """With three ranks the gradient sums depend on where DDP's buckets put each gradient
    (gloo's ring adds each chunk in another order), so the new group's fresh DDP wrappers
    must bucket the first step as the uninterrupted run's wrappers bucket every step after
    their first: the replacement of rank 0 (the store's host) or of the last rank ends
    bit-identical."""
    three = [*BASE, "scaling.num_workers=3"]
    straight = train_processes(3, three, tmp_path / "straight")[0]["result"]
    cfg = load_config(None, three)
    ports = (free_port("127.0.0.1"), free_port("127.0.0.1"))
    spawn_ranks(_two_groups, ((3, 3), replaced, ports, to_dict(cfg), str(tmp_path)), 3)
    for rank in range(3):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)["result"]
        assert result["restored"]["tier"] == "peers"
        assert result["samples_digest"] == straight["samples_digest"]
        assert result["params_sha256"] == straight["params_sha256"], f"rank {rank}"


HSDP = [
    "run.max_steps=8",
    "data.global_batch_size=16",
    "data.micro_batch_size=2",
    "scaling.num_workers=4",
    "parallel.strategy=fsdp",
    "parallel.dp_replicate=2",
    "checkpoint.enabled=false",
]


def _hsdp_regroup(rank: int, ports, cfg_dict: dict, out_dir: str) -> None:
    """4 HSDP ranks (2 replicas x 2 shards) train 4 steps; rank 0 loses its state (a
    replacement process) and every process takes the next rank in the new group, so the
    survivors hold shards that are not theirs in the new layout."""
    from raytrain_ext.train.loop import TrainLoop

    cfg = config_from_dict(cfg_dict)
    device = init_local_rank(rank, 4, ports[0])
    loop = TrainLoop(cfg, rank, 4, rank, device, lambda record: None)
    for _ in range(HANDOVER_AT):
        loop.train_step()
    live = loop.live_state() if rank != 0 else None
    del loop
    destroy_distributed()
    new_rank = (rank + 1) % 4
    device = init_local_rank(new_rank, 4, ports[1])
    try:
        loop = TrainLoop(cfg, new_rank, 4, new_rank, device, lambda record: None, live=live)
        result = loop.fit()
        del loop
    finally:
        destroy_distributed()
    torch.save({"result": asdict(result)}, Path(out_dir) / f"rank{new_rank}.pt")


def test_hsdp_replacement_takes_each_shard_from_a_live_replica(tmp_path):
    """Same world size, same mesh: each shard comes from a rank of another replica that
    holds it, nothing is read from a checkpoint, and the run ends bit-identical to the
    uninterrupted one."""
    straight = train_processes(4, HSDP, tmp_path / "straight")[0]["result"]
    cfg = load_config(None, HSDP)
    ports = (free_port("127.0.0.1"), free_port("127.0.0.1"))
    (tmp_path / "regroup").mkdir()
    spawn_ranks(_hsdp_regroup, (ports, to_dict(cfg), str(tmp_path / "regroup")), 4)
    runs = [torch.load(tmp_path / "regroup" / f"rank{r}.pt", weights_only=False) for r in range(4)]
    for new_rank, run in enumerate(runs):
        restored = run["result"]["restored"]
        assert restored["tier"] == "peers" and restored["step"] == HANDOVER_AT
        # shard 0's lowest holder is old rank 2 (new 3), shard 1's is old rank 3 (new 0)
        assert restored["source_rank"] == (3 if new_rank % 2 == 0 else 0)
        assert run["result"]["samples_digest"] == straight["samples_digest"]
        assert run["result"]["params_sha256"] == straight["params_sha256"]
