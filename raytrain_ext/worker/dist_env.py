"""torch.distributed setup inside a worker: environment, device, process group.

Invariants: every process group is created with a finite timeout (gloo's
default is 30 minutes and it cannot be aborted, so a vanished peer would hang
the survivors); the backend is NCCL exactly when the worker has a GPU unless
the config forces one; on loopback rendezvous gloo is pinned to ``lo``;
teardown aborts NCCL communicators (a dead peer would hang their shutdown) and
destroys gloo groups, so a new group can be formed in the same process.
"""

from __future__ import annotations

import datetime
import gc
import os
import random
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d


@dataclass(frozen=True)
class WorkerEnv:
    """The rendezvous facts the driver hands each worker (the torchrun variables)."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    cuda_visible_devices: Optional[str] = None  # union of this node's worker GPUs
    device_index: int = 0  # this worker's GPU inside cuda_visible_devices

    def as_environ(self) -> dict:
        env = {
            "RANK": self.rank,
            "LOCAL_RANK": self.local_rank,
            "WORLD_SIZE": self.world_size,
            "LOCAL_WORLD_SIZE": self.local_world_size,
            "GROUP_RANK": self.node_rank,
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": self.master_port,
        }
        if self.cuda_visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.cuda_visible_devices
        return {k: str(v) for k, v in env.items()}

    def to_dict(self) -> dict:
        return asdict(self)


def _ephemeral_port_range() -> Tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _candidate_ports() -> List[int]:
    low, _ = _ephemeral_port_range()
    candidates = list(range(20000, max(low, 20001)))
    random.shuffle(candidates)
    return candidates[:200]


def free_port(host: str = "") -> int:
    """A TCP port that is free on this node now (the rendezvous port of rank 0).

    Chosen *below* the kernel's ephemeral range: a same-node rank that retries
    ``connect()`` before rank 0 listens draws its source ports from that range,
    and if it draws the destination port itself, TCP simultaneous open connects
    the socket to itself and the rendezvous waits on its own echo forever.
    Ports 20000+ also stay clear of Ray's worker ports (10002-19999).
    """
    fd, port = bound_listener(host)
    os.close(fd)
    return port


def bound_listener(host: str, port: Optional[int] = None) -> Tuple[int, int]:
    """A socket listening on ``host`` only (not on every interface, which is where
    ``TCPStore`` binds by itself), handed over as (fd, port) to ``TCPStore``'s
    ``master_listen_fd``, which owns it from then on.  ``port`` None: a free one in
    20000..(ephemeral start - 1), see :func:`free_port`."""
    for candidate in [port] if port is not None else _candidate_ports() + [0]:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, candidate))
            sock.listen(1024)
        except OSError:
            sock.close()
            if port is not None:
                raise
            continue
        bound_port = sock.getsockname()[1]
        return sock.detach(), bound_port
    raise OSError(f"no free port to listen on at {host}")


def choose_backend(requested: str, has_gpu: bool) -> str:
    if requested == "auto":
        return "nccl" if has_gpu else "gloo"
    return requested


def host_store(host: str, timeout_s: float, port: Optional[int] = None) -> dist.TCPStore:
    """Rank 0's rendezvous store, listening on ``host`` before any peer is told its port.

    ``host`` is the address the group uses (127.0.0.1 for a private local run, the
    node's cluster address otherwise), and the store listens there only.  A peer that
    connects before the master's store listens retries after a 0.5 s backoff
    (measured: 0.07 s to form a 2-rank gloo group when the store is up, 0.5 s when the
    peer is 50 ms early), which a re-form pays in full.  ``port`` None: a free one.
    """
    fd, port = bound_listener(host, port)
    return dist.TCPStore(
        host,
        port,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=fd,
    )


def init_distributed(
    env: WorkerEnv, backend: str, timeout_s: float, store: Optional[dist.Store] = None
) -> torch.device:
    """Export the torchrun variables, pick the device, join the process group.

    ``store``: rank 0's own ``host_store``; other ranks connect to
    ``master_addr:master_port`` (and without one, rank 0 hosts it there itself,
    listening on ``master_addr`` only).
    """
    os.environ.update(env.as_environ())
    if env.master_addr.startswith("127.") or env.master_addr == "localhost":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", env.device_index)
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None and env.rank == 0:
        store = host_store(env.master_addr, timeout_s, env.master_port)
    elif store is None:
        store = dist.TCPStore(
            env.master_addr,
            env.master_port,
            is_master=False,
            timeout=timeout,
            wait_for_workers=False,
        )
    dist.init_process_group(
        backend=backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout
    )
    return device


# Teardown steps (see teardown_steps): ABORT is ``_abort_process_group()`` on the
# default group, DESTROY is ``destroy_process_group()``.
ABORT = "abort"
DESTROY = "destroy"


def teardown_steps(backend_configs: Iterable[str]) -> Tuple[str, ...]:
    """Which steps tear down groups whose backend configurations are ``backend_configs``.

    ``backend_configs`` are the strings torch records per group (``"cpu:gloo"``,
    ``"cuda:nccl"``, ``"cpu:gloo,cuda:nccl"``).  Any NCCL communicator -> ``(ABORT,)``:
    a communicator whose peer vanished must be aborted (``ncclCommAbort``), because
    ``destroy_process_group`` shuts it down (``ncclCommFinalize``), which can hang on
    the dead peer, and a later init can then deadlock.  Aborting the default group
    aborts every group inside one ``ncclGroupStart/End`` and deregisters them all
    (torch 2.13 ``distributed_c10d._abort_process_group``), so it replaces DESTROY
    rather than preceding it: afterwards nothing is left to destroy.  No NCCL ->
    ``(DESTROY,)``: torch documents abort for NCCL only, and gloo gains nothing from
    it (measured, torch 2.13: ``_abort_process_group`` on gloo returns in 0.2 ms, but
    a rank blocked in ``all_reduce`` is released neither by its peer's abort or
    destroy nor by its own abort from another thread: it waits out the group's
    timeout, 20 s of 20 s, which is why gloo groups need a finite one).  Both paths
    leave the process able to form a new group.  No groups -> ``()``.

    Invariant: the result is empty or exactly one step; it is pure (no GPU needed).
    """
    configs = [c.lower() for c in backend_configs]
    if not configs:
        return ()
    if any("nccl" in c for c in configs):
        return (ABORT,)
    return (DESTROY,)


def live_backend_configs() -> List[str]:
    """The backend configuration string of every process group this process holds."""
    if not dist.is_initialized():
        return []
    return [str(c) for c in distributed_c10d._world.pg_backend_config.values()]


def abort_collectives() -> bool:
    """Abort this process's NCCL communicators, from any thread: a training thread blocked
    in a collective that a lost peer will never join raises instead of waiting for the
    group's timeout.  Gloo cannot be aborted (see :func:`teardown_steps`): its
    collectives raise when the peer's connection closes, or at the group's timeout.
    Returns whether anything was aborted; afterwards the process holds no group."""
    if teardown_steps(live_backend_configs()) != (ABORT,):
        return False
    distributed_c10d._abort_process_group()
    return True


def destroy_distributed() -> None:
    """Tear down every process group, aborting NCCL ones, so that a group of any size
    can be formed again in this process (re-form without a cold restart).

    The steps come from :func:`teardown_steps`.  Why groups are freed last: a gloo
    worker thread may still hold the last reference to a finished collective's
    tensors when the caller moves on; freeing them takes the GIL, under the group's
    work lock.  ``ProcessGroupGloo``'s destructor takes that lock, so it must run
    with the GIL released: it does when the last reference is a Python handle, not
    when it is a C++ owner such as DDP's ``Reducer`` (seen: a rank deadlocked in
    ``~Reducer`` -> ``~ProcessGroupGloo``, 1 run in 60 on a loaded 2-core machine).
    So unreachable objects (a DDP model in a cycle) are collected while the groups
    live, this function keeps a handle to every group through the teardown and drops
    them last.  Callers drop the models they hold before calling it.

    Invariant: afterwards ``dist.is_initialized()`` is False, whichever backend.
    """
    steps = teardown_steps(live_backend_configs())
    if not steps:
        return
    gc.collect()
    handles = list(distributed_c10d._world.pg_map)
    for step in steps:
        if step == ABORT:
            distributed_c10d._abort_process_group()  # every group, the default one too
        else:
            dist.destroy_process_group()
    del handles  # the groups' destructors run here, with the GIL released
    forget_dtensor_meshes()


def forget_dtensor_meshes() -> None:
    """Empty DTensor's sharding caches.

    Why: they are keyed by device meshes, which compare equal by shape and names, and
    their entries hold the mesh they were computed on.  The next group's mesh of the same
    shape (an FSDP/HSDP group re-formed in place at the same size) hit them and got the
    old mesh back, with process groups destroyed: "Could not resolve the process group
    registered under the name 8" in the first gradient-norm all-reduce (seen here).
    """
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute._gen_transform_infos.cache_clear()


def assign_ranks(
    node_ids: List[str],
    gpu_ids: List[List[str]],
    master_addrs: List[str],
    port: int,
    order: Optional[List[int]] = None,
) -> List[WorkerEnv]:
    """Rank workers node by node so local ranks are contiguous (as torchrun does).

    ``node_ids[i]``/``gpu_ids[i]`` describe actor ``i``; the result's entry ``i`` is
    actor ``i``'s environment.  Rank 0 is the first actor on the first node seen;
    ``master_addrs[i]`` is the address actor ``i`` would publish as master.
    """
    node_order: List[str] = []
    for nid in node_ids:
        if nid not in node_order:
            node_order.append(nid)
    ranked = sorted(range(len(node_ids)), key=lambda i: (node_order.index(node_ids[i]), i))
    master = master_addrs[ranked[0]]
    per_node_gpus = {
        nid: sorted(
            {g for i, n in enumerate(node_ids) if n == nid for g in gpu_ids[i]}, key=_gpu_sort_key
        )
        for nid in node_order
    }
    envs: List[Optional[WorkerEnv]] = [None] * len(node_ids)
    for rank, i in enumerate(ranked):
        nid = node_ids[i]
        peers = [j for j in ranked if node_ids[j] == nid]
        visible = per_node_gpus[nid]
        envs[i] = WorkerEnv(
            rank=rank,
            local_rank=peers.index(i),
            world_size=len(node_ids),
            local_world_size=len(peers),
            node_rank=node_order.index(nid),
            master_addr=master,
            master_port=port,
            cuda_visible_devices=",".join(visible) if visible else None,
            device_index=visible.index(gpu_ids[i][0]) if gpu_ids[i] else 0,
        )
    return envs  # type: ignore[return-value]


def _gpu_sort_key(gpu_id: str):
    return (0, int(gpu_id)) if gpu_id.isdigit() else (1, gpu_id)
