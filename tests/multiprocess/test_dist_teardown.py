"""Re-forming process groups of other sizes inside the same processes (gloo), after
``destroy_distributed``: the re-form-without-restart path's torch half.

Three processes form a 3-rank group; rank 2 then exits without any teardown (a
vanished peer); ranks 0 and 1 tear down, form a 2-rank group on a new port, then
tear down again and each forms a group of its own.  Every all_reduce must give the
exact sum of its members' contributions.
"""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from raytrain_ext.worker.dist_env import destroy_distributed
from tests.helpers.dist import distinct_free_ports, init_local_rank, spawn_ranks

pytestmark = pytest.mark.slow


def _join(rank: int, world: int, port: int) -> None:
    init_local_rank(rank, world, port)


def _sum_of_ranks() -> float:
    """all_reduce of (rank + 1): the group's exact sum 1 + ... + world."""
    t = torch.full((1024,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    assert torch.all(t == t[0])
    return float(t[0])


def _rank(rank: int, ports: list, out_dir: str) -> None:
    torch.set_num_threads(1)
    seen = {}
    _join(rank, 3, ports[0])
    seen["world3"] = _sum_of_ranks()
    store = distributed_c10d._get_default_store()
    store.set(f"done{rank}", "1")
    if rank == 2:
        store.wait(["done0", "done1"])  # leave only after the others have their sums
        os._exit(0)  # vanish: no teardown, sockets closed by the kernel
    destroy_distributed()
    _join(rank, 2, ports[1])
    seen["world2"] = _sum_of_ranks()
    destroy_distributed()
    _join(0, 1, ports[2 + rank])
    seen["world1"] = _sum_of_ranks()
    destroy_distributed()
    seen["initialized_after"] = dist.is_initialized()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(seen))


def test_reform_other_sizes_in_the_same_processes(tmp_path):
    ports = distinct_free_ports(4)
    spawn_ranks(_rank, (ports, str(tmp_path)), nprocs=3, deadline_s=120)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen == {
            "world3": 6.0,
            "world2": 3.0,
            "world1": 1.0,
            "initialized_after": False,
        }
    assert not (tmp_path / "rank2.json").exists()
