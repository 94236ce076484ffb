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
from typing import Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from raytrain_ext.worker.rendezvous import WorkerEnv, bound_listener


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
