"""The rendezvous facts of a group, decided on the driver: each worker's ranks and
environment (the torchrun variables), and a free port for rank 0's store.

Apart from ``worker.dist_env`` (which sets torch.distributed up inside a worker)
because the driver computes these and needs no torch for it.
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional, Tuple


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
