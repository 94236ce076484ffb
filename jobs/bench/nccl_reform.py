"""Time NCCL group teardown (abort) and re-creation inside one process, on a GPU.

What the elastic re-form path pays per group change on NCCL: ``destroy_distributed``
aborts the communicators (``_abort_process_group``, see its ``teardown_steps``), then
``init_distributed`` forms a new group on a new port.  Per repetition: init, one step
(a bf16 matmul and an all_reduce of its result, synchronized; the first step also pays
NCCL's lazy communicator creation), teardown.  A last repetition tears down with plain
``destroy_process_group`` (no abort) for comparison.

Two ranks: NCCL refuses two ranks on one device ("Duplicate GPU detected"), so the
2-process variant (both form a group, rank 1 vanishes without teardown, rank 0
aborts and re-forms alone) runs only with 2+ GPUs; with one it prints a skip line.

Output: JSON lines on stdout.  No GPU: exits 2 with a message, unless ``--cpu-dry-run``
(gloo on CPU: checks this script's control flow, its timings mean nothing).

Usage: python jobs/bench/nccl_reform.py [--reps 5] [--size 4096] [--cpu-dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from raytrain_ext.worker.dist_env import (  # noqa: E402
    ABORT,
    WorkerEnv,
    destroy_distributed,
    init_distributed,
    live_backend_configs,
    teardown_steps,
)
from raytrain_ext.worker.rendezvous import free_port  # noqa: E402


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def no_gpu() -> None:
    print(
        "nccl_reform.py: FAILED: no CUDA GPU with NCCL here "
        f"(cuda available={torch.cuda.is_available()}, nccl={dist.is_nccl_available()}, "
        f"torch {torch.__version__}); run it on a GPU machine, or pass --cpu-dry-run",
        file=sys.stderr,
    )
    sys.exit(2)


def join(rank: int, world: int, port: int, backend: str) -> torch.device:
    """Join a ``world``-rank group on loopback; rank ``r`` uses GPU ``r`` under NCCL."""
    env = WorkerEnv(rank, rank, world, world, 0, "127.0.0.1", port, device_index=rank)
    return init_distributed(env, backend, timeout_s=60)


def step(device: torch.device, size: int) -> float:
    """One bf16 matmul and an all_reduce of the product; returns the product's [0, 0]."""
    a = torch.full((size, size), 1.0 / size, dtype=torch.bfloat16, device=device)
    c = a @ a
    dist.all_reduce(c)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return float(c[0, 0])


def timed(fn):  # (fn(), seconds)
    start = time.perf_counter()
    out = fn()
    return out, round(time.perf_counter() - start, 4)


def run_one(reps: int, size: int, backend: str) -> None:
    """World size 1, ``reps`` times init -> step -> teardown, then once without abort."""
    for rep in range(reps + 1):
        port = free_port("127.0.0.1")
        device, init_s = timed(lambda port=port: join(0, 1, port, backend))
        value, step_s = timed(lambda device=device: step(device, size))
        second, step2_s = timed(lambda device=device: step(device, size))
        assert abs(value - 1.0 / size) < 1e-2 and value == second, (value, second)
        steps = teardown_steps(live_backend_configs())
        assert backend != "nccl" or steps == (ABORT,), steps
        plain = rep == reps  # the last repetition: destroy_process_group, no abort
        _, down_s = timed(dist.destroy_process_group if plain else destroy_distributed)
        assert not dist.is_initialized()
        emit(
            variant="world1",
            rep=rep,
            teardown="destroy_process_group" if plain else "+".join(steps),
            init_s=init_s,
            first_step_s=step_s,
            second_step_s=step2_s,
            teardown_s=down_s,
        )


def two_ranks(rank: int, size: int, backend: str, ports: tuple) -> None:
    """Both ranks form a group and step; rank 1 vanishes; rank 0 aborts and re-forms."""
    device, init_s = timed(lambda: join(rank, 2, ports[0], backend))
    value = step(device, size)
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        store.set("leaving", "1")
        os._exit(0)  # no teardown: a vanished peer
    store.wait(["leaving"])
    time.sleep(1.0)  # let the peer's process end
    _, down_s = timed(destroy_distributed)
    device, reinit_s = timed(lambda: join(0, 1, ports[1], backend))
    value1, step_s = timed(lambda: step(device, size))
    destroy_distributed()
    emit(variant="world2_peer_vanished", init_s=init_s, teardown_s=down_s,
         reinit_world1_s=reinit_s, step_after_s=step_s, values=[value, value1])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--cpu-dry-run", action="store_true")
    args = parser.parse_args()
    backend = "gloo" if args.cpu_dry_run else "nccl"
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        no_gpu()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    gpus = torch.cuda.device_count() if backend == "nccl" else 0
    nccl = str(torch.cuda.nccl.version()) if gpus else None
    emit(variant="setup", backend=backend, torch=torch.__version__, gpus=gpus, nccl=nccl)
    run_one(args.reps, args.size, backend)
    if backend == "nccl" and gpus < 2:
        emit(variant="world2_peer_vanished", skipped="NCCL allows one rank per GPU; 1 GPU here")
        return
    ports = (free_port("127.0.0.1"), free_port("127.0.0.1"))
    mp.spawn(two_ranks, args=(args.size, backend, ports), nprocs=2)


if __name__ == "__main__":
    main()
