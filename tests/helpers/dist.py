"""Run the real training loop in W local processes over gloo (no Ray): the multi-process rung."""

from __future__ import annotations

import faulthandler
import os
import socket
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.multiprocessing as mp

from raytrain_ext.config import config_from_dict, load_config, to_dict
from raytrain_ext.faults import FaultInjector
from raytrain_ext.messages import StepReport
from raytrain_ext.trainer import absolute_paths
from raytrain_ext.worker.dist_env import WorkerEnv, destroy_distributed, init_distributed
from raytrain_ext.worker.rendezvous import free_port


def init_local_rank(rank: int, world: int, port: int) -> torch.device:
    """Join a gloo group of ``world`` processes on this machine as ``rank``."""
    env = WorkerEnv(
        rank=rank,
        local_rank=rank,
        world_size=world,
        local_world_size=world,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=port,
    )
    torch.set_num_threads(1)
    return init_distributed(env, "gloo", timeout_s=60)


def _run_rank(rank: int, world: int, port: int, cfg_dict: dict, out_dir: str) -> None:
    device = init_local_rank(rank, world, port)
    try:
        _fit_and_save(rank, world, cfg_dict, out_dir, device)
    finally:
        destroy_distributed()  # after the loop (and its DDP Reducer) is gone: see its docstring


def _fit_and_save(rank: int, world: int, cfg_dict: dict, out_dir: str, device) -> None:
    from raytrain_ext.train.loop import TrainLoop

    reports: List[StepReport] = []
    cfg = config_from_dict(cfg_dict)
    faults = FaultInjector(cfg.chaos, rank)  # armed: the first attempt
    loop = TrainLoop(cfg, rank, world, rank, device, reports.append, faults=faults)
    result = asdict(loop.fit())
    params = {k: v.clone() for k, v in loop.strategy.full_parameters(loop.model).items()}
    records = [r.to_record() for r in reports]  # as the sinks get them
    torch.save(
        {"result": result, "params": params, "records": records}, Path(out_dir) / f"rank{rank}.pt"
    )


def train_processes(
    world: int, overrides: List[str], out_dir: Path, config: Optional[Path] = None
) -> List[Dict]:
    """Train with `world` gloo processes; return each rank's {result, params, records}.

    ``config``: a YAML file (the packaged default when None); its relative paths are taken
    from the repository root, as the CLI takes them from the directory it runs in.

    The config is validated for ``scaling.num_workers`` from ``overrides`` (default
    ``world``); running more ranks than that mimics an elastic resize, where the
    global batch may split unevenly.
    """
    if not any(o.startswith("scaling.num_workers=") for o in overrides):
        overrides = [f"scaling.num_workers={world}", *overrides]
    if not any(o.startswith("checkpoint.dir=") for o in overrides):
        overrides = [f"checkpoint.dir={out_dir / 'checkpoints'}", *overrides]
    cfg = load_config(config, overrides)
    if config is not None:
        cfg = absolute_paths(cfg, base=Path(__file__).parents[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    spawn_ranks(_run_rank, (world, free_port("127.0.0.1"), to_dict(cfg), str(out_dir)), world)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _rank_with_deadline(
    rank: int, fn: Callable, deadline_s: float, env: Dict[str, str], cwd: str, *args
) -> None:
    # a forked rank inherits the fork server's environment and directory, which date from the
    # session's first spawn: take the test's current ones, as a fresh interpreter would
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    faulthandler.dump_traceback_later(deadline_s, exit=True)  # every thread's stack, then exit 1
    fn(rank, *args)


# Ranks start from a fork server that has imported these once (per test session): a fresh
# interpreter per rank would import torch, transformers and the loop again (seconds each on
# 2 cores, ~60 times in this tier).  The server only imports (no threads, no process group),
# so each rank still starts from a clean, single-threaded state.  ``rank_imports`` adds
# what ranks import lazily, each module apart, so that one failing cannot end the server.
FORKSERVER_PRELOAD = [
    "torch",
    "tests.helpers.rank_imports",
    "raytrain_ext.train.loop",
    "tests.helpers.dist",
]


def distinct_free_ports(count: int) -> List[int]:
    """``count`` different free ports: each socket stays bound until all are chosen (two
    ``free_port`` calls one after the other may get the same port back from the kernel)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def spawn_ranks(fn: Callable, args: tuple, nprocs: int, deadline_s: float = 240.0) -> None:
    """``mp.start_processes`` that cannot hang a test: a rank still running after
    ``deadline_s`` prints every thread's stack and exits, which fails the join; if
    even that does not end them, the ranks are killed and the test fails."""
    mp.set_forkserver_preload(FORKSERVER_PRELOAD)
    context = mp.start_processes(
        _rank_with_deadline,
        args=(fn, deadline_s, dict(os.environ), os.getcwd(), *args),
        nprocs=nprocs,
        join=False,
        start_method="forkserver",
    )
    give_up = time.monotonic() + deadline_s + 30
    while not context.join(timeout=1.0):
        if time.monotonic() > give_up:
            for process in context.processes:
                process.kill()
            raise TimeoutError(
                f"{nprocs} ranks of {fn.__name__} still running after "
                f"{deadline_s + 30:.0f} s; killed"
            )
