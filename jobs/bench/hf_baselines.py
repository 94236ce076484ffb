"""The baselines of jobs/bench/hf_models.py: the same Hugging Face model trained without
raytrain-ext, by a plain torchrun DDP script and by Ray Train's ``TorchTrainer``.

Both run one loop, ``train_steps``, with what raytrain-ext's run would use, so that only the
framework differs: the model built by ``HF_SPEC.build`` from the same config and seed, the
same token data and global sample order (``GlobalSampler``: the same samples each step), the
same micro-batching with gradient sync on the last micro-batch only, AdamW with the same
schedule and clipping. Reusing that code is not framework overhead: it is the model, the
data and the optimizer.

Usage (both write rank 0's step times as JSON to ``--out``):
  torchrun --nproc_per_node=2 jobs/bench/hf_baselines.py --out t.json key=value ...
  python jobs/bench/hf_baselines.py --ray-train 2 --out r.json key=value ...
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from raytrain_ext.config import load_config  # noqa: E402
from raytrain_ext.data import GlobalSampler, open_token_dataset, rank_slice  # noqa: E402
from raytrain_ext.models.hf_spec import HF_SPEC  # noqa: E402
from raytrain_ext.train.optim import build_optimizer, build_scheduler  # noqa: E402


def train_steps(cfg, model: torch.nn.Module, rank: int, world: int) -> Dict:
    """``run.max_steps`` steps of ``model`` (already wrapped in DDP); rank 0's step times."""
    import torch.distributed as dist

    data = open_token_dataset(cfg.data.path, cfg.model.seq_len)
    sampler = GlobalSampler(data.num_samples, cfg.data.global_batch_size, cfg.data.seed)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim)
    micro, tokens = cfg.data.micro_batch_size, cfg.data.global_batch_size * cfg.model.seq_len
    times: List[tuple] = []
    for _ in range(cfg.run.max_steps):
        start = time.perf_counter()
        local = rank_slice(sampler.next_global_batch(), rank, world)
        chunks = [local[i : i + micro] for i in range(0, len(local), micro)]
        total = torch.zeros((), dtype=torch.float64)
        for j, indices in enumerate(chunks):
            batch = data.batch(indices)
            sync = j == len(chunks) - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                logits = HF_SPEC.logits(model, batch.inputs)
                loss = F.cross_entropy(
                    logits.float().flatten(0, 1), batch.targets.flatten(), reduction="sum"
                )
                (loss * world / tokens).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(total)  # the global loss, as any training script logs it
        times.append((time.perf_counter() - start, time.time()))
    return {
        "step_times": [t for t, _ in times],
        "first_step_at": times[0][1],
        "final_loss": total.item() / tokens,
    }


def torchrun_main(args) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    cfg = load_config(None, args.overrides)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(HF_SPEC.build(cfg.model, cfg.run.seed))
    result = train_steps(cfg, model, rank, world)
    if rank == 0:
        Path(args.out).write_text(json.dumps(result))
    del model  # DDP's Reducer must not be the last owner of the group (worker/dist_env.py)
    dist.destroy_process_group()


def ray_train_loop(config: Dict) -> None:
    """Ray Train's ``train_loop_per_worker``: its own DDP wrapping (``prepare_model``)."""
    import ray.train as train
    import ray.train.torch

    cfg = load_config(None, config["overrides"])
    context = train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    model = ray.train.torch.prepare_model(HF_SPEC.build(cfg.model, cfg.run.seed))
    result = train_steps(cfg, model, rank, world)
    if rank == 0:
        Path(config["out"]).write_text(json.dumps(result))


def ray_train_main(args) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        TorchTrainer(
            ray_train_loop,
            train_loop_config={"overrides": args.overrides, "out": args.out},
            scaling_config=ScalingConfig(num_workers=args.ray_train),
            run_config=RunConfig(storage_path=str(Path(args.out).parent / "ray_train")),
        ).fit()
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ray-train", type=int, default=0, metavar="WORKERS")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if args.ray_train:
        ray_train_main(args)
    else:
        torchrun_main(args)


if __name__ == "__main__":
    main()
