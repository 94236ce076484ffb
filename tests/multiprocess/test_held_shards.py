"""Survivors of a sharded layout restore only what they lost (``checkpoint.held_chunks``),
over gloo.

The ranks train 4 of 8 steps, saving every 4th; some are lost, and the survivors form
a smaller group in the same processes and restore step 4, resharded:
- FSDP: 3 ranks, rank 1 lost, ranks 0 and 2 go on (thirds resharded into halves);
- FSDP x TP: 4 ranks (2 x 2), the TP pair of ranks 0 and 1 lost (a node), ranks 2 and
  3 go on as one TP pair that needs its whole data-parallel extent;
- PP (DDP over 2 stages of 2 ranks): rank 1 lost, ranks 0 and 2 go on, one per stage.
With their own shards kept, each survivor copies the chunks it saved from memory and
reads the rest from the checkpoint; without them it reads everything.  Both runs must
end bit-identical, having restored the same state.
"""

from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from raytrain_ext.config import config_from_dict, load_config, to_dict
from raytrain_ext.worker.dist_env import destroy_distributed
from raytrain_ext.worker.rendezvous import free_port
from tests.helpers.dist import init_local_rank, spawn_ranks

BASE = [
    "run.max_steps=8",
    "data.global_batch_size=12",
    "data.micro_batch_size=2",
    "checkpoint.every_steps=4",  # LOST_AT: the step restored
    "checkpoint.every_seconds=null",
    "checkpoint.async_save=false",
]
LOST_AT = 4
# layout -> (its keys, world size, old rank -> new rank of the survivors that go on)
LAYOUTS = {
    "fsdp": (["parallel.strategy=fsdp"], 3, {0: 0, 2: 1}),
    "fsdp_tp": (["parallel.strategy=fsdp", "parallel.tp=2"], 4, {2: 0, 3: 1}),
    "pp": (["parallel.pp=2"], 4, {0: 0, 2: 1}),
}


def _lose_ranks(rank: int, ports, cfg_dict: dict, layout: str, keep_shards: bool, out_dir: str):
    from raytrain_ext.train.loop import TrainLoop

    _, world, new_ranks = LAYOUTS[layout]
    cfg = config_from_dict(cfg_dict)
    device = init_local_rank(rank, world, ports[0])
    loop = TrainLoop(cfg, rank, world, rank, device, lambda record: None)
    for _ in range(LOST_AT):
        loop.train_step()
    loop.ckpt.close()
    held = loop.held_chunks() if keep_shards else None
    del loop
    destroy_distributed()
    if rank not in new_ranks:
        return
    new_rank = new_ranks[rank]
    device = init_local_rank(new_rank, 2, ports[1])
    try:
        loop = TrainLoop(cfg, new_rank, 2, new_rank, device, lambda record: None, held=held)
        result = loop.fit()
        del loop
    finally:
        destroy_distributed()
    torch.save(asdict(result), Path(out_dir) / f"rank{new_rank}.pt")


def _run(tmp_path: Path, layout: str, keep_shards: bool):
    keys, world, _ = LAYOUTS[layout]
    out = tmp_path / ("kept" if keep_shards else "read")
    out.mkdir()
    cfg = load_config(None, [*BASE, *keys, f"checkpoint.dir={out / 'checkpoints'}"])
    ports = (free_port("127.0.0.1"), free_port("127.0.0.1"))
    spawn_ranks(_lose_ranks, (ports, to_dict(cfg), layout, keep_shards, str(out)), world)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_survivors_copy_their_own_shards_and_read_only_the_lost_ones(tmp_path, layout):
    kept, read = _run(tmp_path, layout, True), _run(tmp_path, layout, False)
    for with_shards, without in zip(kept, read, strict=False):
        restored, baseline = with_shards["restored"], without["restored"]
        assert restored["step"] == baseline["step"] == LOST_AT
        assert restored["tier"] == baseline["tier"] == "local"
        assert baseline["held_bytes"] == 0 and restored["held_bytes"] > 0
        # every byte loaded comes from one source or the other, and less is read
        total = baseline["read_bytes"]
        assert restored["held_bytes"] + restored["read_bytes"] == total
        assert restored["read_bytes"] < total
        assert with_shards["steps"] == without["steps"] == 8
        assert with_shards["samples_digest"] == without["samples_digest"]
        assert with_shards["params_sha256"] == without["params_sha256"]
