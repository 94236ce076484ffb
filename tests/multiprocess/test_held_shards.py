"""FSDP survivors restore only what they lost (``checkpoint.held_chunks``), over gloo.

Three FSDP ranks train 4 of 8 steps, saving every step; rank 1 is lost, and ranks 0
and 2 form a group of 2 in the same processes (resharded from thirds to halves) and
restore step 4.  With their own shards kept, each survivor copies the chunks it saved
from memory and reads the rest from the checkpoint; without them it reads everything.
Both runs must end bit-identical, having restored the same state.
"""

from pathlib import Path

import torch

from raytrain_ext.config import config_from_dict, load_config, to_dict
from raytrain_ext.worker.dist_env import destroy_distributed, free_port
from tests.helpers.dist import init_local_rank, spawn_ranks

FSDP = [
    "run.max_steps=8",
    "data.global_batch_size=12",
    "data.micro_batch_size=2",
    "scaling.num_workers=3",
    "parallel.strategy=fsdp",
    "checkpoint.every_steps=1",
    "checkpoint.every_seconds=null",
    "checkpoint.async_save=false",
]
LOST_AT = 4
NEW_RANK = {0: 0, 2: 1}  # rank 1 is lost; the survivors keep their order


def _lose_rank_one(rank: int, ports, cfg_dict: dict, keep_shards: bool, out_dir: str) -> None:
    from raytrain_ext.train.loop import TrainLoop

    cfg = config_from_dict(cfg_dict)
    device = init_local_rank(rank, 3, ports[0])
    loop = TrainLoop(cfg, rank, 3, rank, device, lambda record: None)
    for _ in range(LOST_AT):
        loop.train_step()
    loop.ckpt.close()
    held = loop.held_chunks() if keep_shards else None
    del loop
    destroy_distributed()
    if rank not in NEW_RANK:
        return
    new_rank = NEW_RANK[rank]
    device = init_local_rank(new_rank, 2, ports[1])
    try:
        loop = TrainLoop(cfg, new_rank, 2, new_rank, device, lambda record: None, held=held)
        result = loop.fit()
        del loop
    finally:
        destroy_distributed()
    torch.save(result, Path(out_dir) / f"rank{new_rank}.pt")


def _run(tmp_path: Path, keep_shards: bool):
    out = tmp_path / ("kept" if keep_shards else "read")
    out.mkdir()
    cfg = load_config(None, [*FSDP, f"checkpoint.dir={out / 'checkpoints'}"])
    ports = (free_port("127.0.0.1"), free_port("127.0.0.1"))
    spawn_ranks(_lose_rank_one, (ports, to_dict(cfg), keep_shards, str(out)), 3)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_fsdp_survivors_copy_their_own_shards_and_read_only_the_lost_ones(tmp_path):
    kept, read = _run(tmp_path, True), _run(tmp_path, False)
    for with_shards, without in zip(kept, read):
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
