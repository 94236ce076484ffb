"""Process-group teardown: which steps for which backend, and that both paths leave
the process ready to form a new group (one process, gloo; the GPU path is
jobs/bench/nccl_reform.py)."""

import datetime

import pytest
import torch
import torch.distributed as dist

from raytrain_ext.worker import dist_env
from raytrain_ext.worker.dist_env import (
    ABORT,
    DESTROY,
    abort_collectives,
    destroy_distributed,
    host_store,
    live_backend_configs,
    teardown_steps,
)


@pytest.mark.parametrize(
    "configs, steps",
    [
        (["cuda:nccl"], (ABORT,)),
        (["cpu:gloo,cuda:nccl"], (ABORT,)),  # backend=None on a GPU machine
        (["cpu:gloo,cuda:gloo", "CUDA:NCCL"], (ABORT,)),  # one NCCL group is enough
        (["cuda:nccl", "cpu:gloo,cuda:gloo"], (ABORT,)),  # an async-checkpoint gloo group
        (["cpu:gloo,cuda:gloo"], (DESTROY,)),
        (["cpu:gloo,cuda:gloo", "cpu:gloo,cuda:gloo"], (DESTROY,)),
        ([], ()),
    ],
)
def test_teardown_steps(configs, steps):
    assert teardown_steps(configs) == steps


def _form_world_of_one() -> None:
    store = host_store("127.0.0.1", timeout_s=10)
    dist.init_process_group(
        "gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=10)
    )


def _all_reduce_works() -> None:
    t = torch.full((4,), 3.0)
    dist.all_reduce(t)
    assert t.tolist() == [3.0] * 4


@pytest.mark.parametrize("force_abort", [False, True])
def test_teardown_then_reform(monkeypatch, force_abort):
    """Both paths deregister every group (the default and a subgroup) so that
    ``init_process_group`` works again; the ABORT path is driven on a real gloo
    group by claiming NCCL (gloo's ``abort()`` is a no-op, ``_abort_process_group``'s
    bookkeeping is the same as for NCCL)."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    if force_abort:
        claim = lambda: ["cuda:nccl"] if dist.is_initialized() else []  # noqa: E731
        monkeypatch.setattr(dist_env, "live_backend_configs", claim)
    aborts = []
    real_abort = dist.distributed_c10d._abort_process_group
    monkeypatch.setattr(
        dist.distributed_c10d,
        "_abort_process_group",
        lambda group=None: (aborts.append(group), real_abort(group)),
    )
    try:
        _form_world_of_one()
        dist.new_group([0])
        _all_reduce_works()
        destroy_distributed()
        assert not dist.is_initialized()
        assert not dist.distributed_c10d._world.pg_map
        assert aborts == ([None] if force_abort else [])
        destroy_distributed()  # idempotent
        _form_world_of_one()
        _all_reduce_works()
    finally:
        monkeypatch.undo()
        destroy_distributed()
    assert live_backend_configs() == []


def test_abort_collectives_aborts_nccl_only(monkeypatch):
    """A survivor's training thread is released by aborting NCCL communicators; a gloo
    group is left alone (it cannot be aborted: its collectives raise on their own)."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    try:
        _form_world_of_one()
        assert abort_collectives() is False and dist.is_initialized()
        _all_reduce_works()
        monkeypatch.setattr(dist_env, "live_backend_configs", lambda: ["cuda:nccl"])
        assert abort_collectives() is True and not dist.is_initialized()
        monkeypatch.undo()
        assert abort_collectives() is False  # nothing left to abort
    finally:
        monkeypatch.undo()
        destroy_distributed()
