"""The registered state's DCP files in a checkpoint (``user_loop.registered_files``), over
gloo without Ray.

Two ranks train an MLP under FSDP2 with AdamW and write their registered state into their
staged report files, as a report with a checkpoint does; both ranks' files are put in one
checkpoint directory, as storage keeps them.  Then the same three processes start a group
of 3 (FSDP over 3 ranks, chunks of 16 rows as 6, 6 and 4), and one process alone with the
plain, unsharded model: each builds the objects from another seed, and ``load`` gives every
one of them the whole state of the report to the bit (parameters, Adam's moments and
step, progress), resharded by DCP; the loaded objects train on.
"""

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from raytrain_ext.user_loop.checkpoint import Checkpoint
from raytrain_ext.user_loop.registered_files import REGISTERED_DIR, RegisteredFiles
from raytrain_ext.worker.dist_env import destroy_distributed
from tests.helpers.dist import distinct_free_ports, init_local_rank, spawn_ranks
from tests.helpers.registered_mlp import dcp_files, mlp_objects, train_steps, whole_state


def _objects(world: int, seed: int) -> dict:
    """The MLP under FSDP2 over ``world`` ranks (plain for one), AdamW, progress."""
    from torch.distributed.device_mesh import init_device_mesh

    return mlp_objects(init_device_mesh("cpu", (world,)) if world > 1 else None, seed)


def _save_then_load(rank: int, ports: list, out_dir: str) -> None:
    checkpoint = Path(out_dir, "checkpoint")
    expected = None
    if rank < 2:
        init_local_rank(rank, 2, ports[0])
        objects = _objects(2, seed=0)
        train_steps(objects, 2)
        staged = RegisteredFiles().add_to(None, objects, "files")
        expected = whole_state(objects)
        for name in staged.names:  # storage merges every rank's files into one directory
            target = checkpoint / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(Path(staged.directory, name), target)
        shutil.rmtree(staged.directory)
        torch.save(expected, Path(out_dir, f"expected{rank}.pt"))
        destroy_distributed()
    results = {}
    init_local_rank(rank, 3, ports[1])
    dist.barrier()  # both writers' files are in place
    results["grown"] = _load(3, checkpoint, out_dir)
    destroy_distributed()
    if rank == 0:
        init_local_rank(0, 1, ports[2])
        results["alone"] = _load(1, checkpoint, out_dir)
        destroy_distributed()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def _load(world: int, checkpoint: Path, out_dir: str) -> dict:
    fresh = _objects(world, seed=7)
    record = RegisteredFiles().load(fresh, Checkpoint(str(checkpoint)))
    got = whole_state(fresh)
    expected = torch.load(Path(out_dir, "expected0.pt"))
    model = fresh["model"]
    rows = {
        n: p.to_local().shape[0] if world > 1 else p.shape[0] for n, p in model.named_parameters()
    }
    progress = dict(fresh["progress"])
    train_steps(fresh, 1)  # the loaded objects train on
    return {
        "equal": sorted(got) == sorted(expected)
        and all(torch.equal(expected[k], got[k]) for k in expected),
        "progress": progress,
        "rows": rows,
        "bytes": record["bytes"],
    }


def test_registered_fsdp_state_saved_on_2_ranks_loads_on_3_and_on_1(tmp_path):
    spawn_ranks(_save_then_load, (distinct_free_ports(3), str(tmp_path)), nprocs=3)
    assert (
        torch.load(tmp_path / "expected0.pt").keys() == torch.load(tmp_path / "expected1.pt").keys()
    )
    files = sorted(p.name for p in (tmp_path / "checkpoint" / REGISTERED_DIR).iterdir())
    assert files == dcp_files(2)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    for phase in [r["grown"] for r in results] + [results[0]["alone"]]:
        assert phase["equal"], phase
        assert phase["progress"] == {"epoch": 2}
        assert phase["bytes"] > 0
    assert [r["grown"]["rows"]["0.weight"] for r in results] == [6, 6, 4]
    assert results[0]["alone"]["rows"]["0.weight"] == 16


def test_a_checkpoint_without_registered_state_loads_nothing(tmp_path):
    objects = {"progress": {"epoch": 3}}
    assert RegisteredFiles().load(objects, Checkpoint(str(tmp_path))) is None
    assert objects == {"progress": {"epoch": 3}}
