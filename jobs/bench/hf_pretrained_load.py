"""How much of a pretrained Hugging Face model each FSDP rank reads, and how long it takes.

A model directory as ``save_pretrained`` writes it (config.json + safetensors) is loaded on
``world`` gloo processes (torch.multiprocessing, no Ray) exactly as a run does it: the
strategy of ``parallel.strategy=fsdp`` wraps the model its spec builds, then the spec's
``load_pretrained`` fills it (``HF_SPEC``: DCP's ``HuggingFaceStorageReader``).

What is counted, per rank: the bytes of the tensor slices the storage reader hands to this
rank (a subclass of DCP's reader that adds up each read request's slice size), against the
total size of the safetensors files.  Not disk I/O: safetensors reads through ``mmap``, so
``/proc/self/io`` ``rchar`` (also printed) sees only the headers; the slices are what the
rank touches.  The goal is about 1/world per rank.  The loaded parameters are compared with
the files' tensors, so a fast load that loaded the wrong bytes cannot pass.

Usage: python jobs/bench/hf_pretrained_load.py DIR [--world 2]   (DIR from save_pretrained)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed.checkpoint as dcp  # noqa: E402

from raytrain_ext.worker.dist_env import (  # noqa: E402
    WorkerEnv,
    destroy_distributed,
    init_distributed,
)
from raytrain_ext.worker.rendezvous import free_port  # noqa: E402


class CountingReader(dcp.HuggingFaceStorageReader):
    """DCP's safetensors reader, adding up the bytes of every slice it returns."""

    bytes_returned = 0
    requests = 0

    def _process_read_request(self, f, req, planner) -> None:
        dtype = self.storage_data[req.storage_index].dtype
        CountingReader.bytes_returned += math.prod(req.lengths) * dtype.itemsize
        CountingReader.requests += 1
        super()._process_read_request(f, req, planner)


def rchar() -> int:
    """Bytes this process has read through read-like system calls (Linux)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def _files_match(params: Dict[str, torch.Tensor], directory: Path) -> bool:
    from safetensors.torch import load_file

    saved = {}
    for file in sorted(directory.glob("*.safetensors")):
        saved.update(load_file(file))
    return all(torch.equal(value, saved[name]) for name, value in params.items() if name in saved)


def _load_rank(rank: int, world: int, port: int, directory: str, out: str) -> None:
    from raytrain_ext.config import load_config
    from raytrain_ext.models import model_spec
    from raytrain_ext.parallel.dims import ParallelDims
    from raytrain_ext.parallel.registry import build_strategy
    from raytrain_ext.parallel.strategy import DistContext

    env = WorkerEnv(rank, rank, world, world, 0, "127.0.0.1", port)
    torch.set_num_threads(1)
    device = init_distributed(env, "gloo", timeout_s=300)
    try:
        cfg = load_config(
            None,
            [
                "model.source=hf",
                f"model.hf.path={directory}",
                "model.seq_len=64",
                "parallel.strategy=fsdp",
                f"scaling.num_workers={world}",
            ],
        )
        spec = model_spec(cfg.model)
        strategy = build_strategy(cfg.parallel, spec)
        dims = ParallelDims.build(cfg.parallel, cfg.model, world)
        ctx = DistContext(rank, world, rank, device, None, dims)
        model = strategy.wrap(spec.build(cfg.model, cfg.run.seed + 1), ctx)  # not the files'
        dcp.HuggingFaceStorageReader = CountingReader  # hf_spec looks it up at the call
        torch.distributed.barrier()
        before, start = rchar(), time.perf_counter()
        spec.load_pretrained(model, cfg.model)
        seconds, read_calls_bytes = time.perf_counter() - start, rchar() - before
        params = strategy.full_parameters(model)
        result = {
            "rank": rank,
            "slice_bytes": CountingReader.bytes_returned,
            "read_requests": CountingReader.requests,
            "rchar_bytes": read_calls_bytes,
            "load_s": seconds,
            "matches_files": _files_match(params, Path(directory)) if rank == 0 else None,
        }
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        destroy_distributed()


def measure_load(directory: Path, world: int = 2) -> Dict:
    """Per-rank read figures of loading ``directory`` under FSDP on ``world`` gloo ranks."""
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory(prefix="hf-load-") as out:
        port = free_port("127.0.0.1")
        mp.start_processes(
            _load_rank, args=(world, port, str(directory), out), nprocs=world, start_method="spawn"
        )
        ranks: List[Dict] = [
            json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)
        ]
    total = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    return {"world": world, "total_bytes": total, "ranks": ranks}


def print_load(load: Dict) -> None:
    total = load["total_bytes"]
    print(
        f"pretrained load under FSDP, {load['world']} gloo ranks: safetensors {total / 2**20:.1f} "
        f"MiB; bytes = slices DCP's reader returned to the rank (rchar: read syscalls, "
        f"safetensors mmaps)"
    )
    for r in load["ranks"]:
        print(
            f"  rank {r['rank']}: {r['slice_bytes'] / 2**20:8.2f} MiB = "
            f"{r['slice_bytes'] / total:.3f} of the files (goal ~{1 / load['world']:.2f}), "
            f"{r['read_requests']} reads, rchar {r['rchar_bytes'] / 2**20:.2f} MiB, "
            f"{r['load_s']:.2f} s"
            + (
                ""
                if r["matches_files"] is None
                else f", weights equal the files: {r['matches_files']}"
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    print_load(measure_load(args.directory, args.world))


if __name__ == "__main__":
    main()
