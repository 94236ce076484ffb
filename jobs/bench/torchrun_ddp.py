"""The reference for the overhead benchmark: a plain torchrun + DDP loop, no Ray, no framework.

Same model, data, global batch and micro-batching as raytrain-ext (it reuses only
the model and token file code, which are not framework overhead). Run with
`torchrun --nproc_per_node=N jobs/bench/torchrun_ddp.py --out times.json key=value ...`.
"""

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from raytrain_ext.config import load_config  # noqa: E402
from raytrain_ext.data import open_token_dataset  # noqa: E402
from raytrain_ext.models import build_model  # noqa: E402
from raytrain_ext.worker.process_age import process_age_s  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    now = time.time()  # the same moments as raytrain-ext's (metrics.start_phases), rank 0's
    marks = {"process_started_at": now - process_age_s(), "imports_done_at": now}
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    marks["formed_at"] = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.run.seed)
    model = DistributedDataParallel(build_model(cfg.model, cfg.run.seed))
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.optim.lr,
        betas=tuple(cfg.optim.betas),
        weight_decay=cfg.optim.weight_decay,
    )
    data = open_token_dataset(cfg.data.path, cfg.model.seq_len)
    rng = np.random.default_rng(cfg.data.seed)
    global_batch, micro = cfg.data.global_batch_size, cfg.data.micro_batch_size
    local_batch = global_batch // world
    tokens = global_batch * cfg.model.seq_len
    marks["built_at"] = time.time()
    times, phases = [], []
    for _ in range(cfg.run.max_steps):
        start = time.perf_counter()
        spent = {"data": 0.0, "forward_backward": 0.0, "optimizer": 0.0, "exchange": 0.0}
        batch = rng.choice(data.num_samples, size=global_batch, replace=False)
        local = batch[rank * local_batch : (rank + 1) * local_batch]
        chunks = [local[i : i + micro] for i in range(0, len(local), micro)]
        total = torch.zeros(())
        for j, idx in enumerate(chunks):
            lap = time.perf_counter()
            batch = data.batch(idx)
            x, y = batch.inputs, batch.targets
            spent["data"] += time.perf_counter() - lap
            lap = time.perf_counter()
            ctx = model.no_sync() if j < len(chunks) - 1 else torch.enable_grad()
            with ctx:
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
                (loss * world / tokens).backward()
            total += loss.detach()
            spent["forward_backward"] += time.perf_counter() - lap
        lap = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        spent["optimizer"] = time.perf_counter() - lap
        lap = time.perf_counter()
        dist.all_reduce(total)  # the global loss, as any training script logs it
        spent["exchange"] = time.perf_counter() - lap
        times.append((time.perf_counter() - start, time.time()))
        phases.append(spent)
    if rank == 0:
        Path(args.out).write_text(
            json.dumps(
                {
                    "step_times": [t for t, _ in times],
                    "first_step_at": times[0][1],
                    "final_loss": total.item() / tokens,
                    "phases_s": phases,
                    "start_marks": marks,
                }
            )
        )
    # both ranks leave together: a rank that tore its group down while its peer still wrote
    # the results aborted once in a while ("terminate called without an active exception")
    dist.barrier()
    del model, opt  # DDP's Reducer must not be the last owner of the group (worker/dist_env.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
