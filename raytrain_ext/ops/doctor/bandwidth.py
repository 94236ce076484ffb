"""A throwaway gang of worker actors that forms a process group and times collectives.

The gang is training's own: a :class:`WorkerGroup` (placement group, ranks assigned
node by node, rendezvous on rank 0's node, finite timeout) of training workers that
can also run a sweep, so NCCL makes the same transport choices it would make for a
training job on these nodes.  On GPU the actors
start with ``NCCL_DEBUG=INFO`` and ``NCCL_DEBUG_FILE`` pointing at a per-process
file on their node; each actor returns its own file's text, so the driver
sees every rank's log without shared storage.  Bundles are spread over nodes
(SPREAD) so a multi-node cluster is measured across its network.

Invariant: whatever happens, :func:`run_benchmark` shuts its group down (actors
killed, placement group removed) before returning.
"""

from __future__ import annotations

import glob
import os
import shutil
import uuid
from typing import Any, Dict, Optional, Sequence

import ray

from raytrain_ext.worker.actor import TrainWorker
from raytrain_ext.worker.form_options import FormOptions
from raytrain_ext.worker.group import PlacementTimeout, WorkerGroup

NCCL_CAPTURE_SUBSYS = "INIT,NET,GRAPH,ENV"


class BenchWorker(TrainWorker):
    """A training worker that also times collectives over the group it joined."""

    def __init__(self) -> None:
        super().__init__()
        nccl_log = os.environ.get("NCCL_DEBUG_FILE")
        if nccl_log:  # NCCL opens it when the first communicator is created
            os.makedirs(os.path.dirname(nccl_log), exist_ok=True)

    def sweep(self, ops: Sequence[str], sizes: Sequence[int], iters: int, warmup: int) -> Dict:
        """Time every op at every size; this rank's rows and its own NCCL log."""
        from raytrain_ext.ops.doctor.collectives import run_sweep

        if self.env is None:
            raise RuntimeError("BenchWorker: setup() must run before sweep()")
        rows = run_sweep(ops, sizes, iters, warmup, self.device)
        return {"rank": self.env.rank, "rows": rows, "nccl_log": _own_nccl_log()}

    def remove_dir(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)


def _own_nccl_log() -> str:
    """This process's NCCL log text (``%h.%p`` in ``NCCL_DEBUG_FILE``), then the file removed."""
    nccl_log = os.environ.get("NCCL_DEBUG_FILE")
    if not nccl_log:
        return ""
    text = ""
    for path in glob.glob(os.path.join(os.path.dirname(nccl_log), f"nccl.*.{os.getpid()}.log")):
        with open(path, errors="replace") as f:
            text += f.read()
        os.unlink(path)
    return text


def remote_bench_class(max_concurrency: int = 4):
    return ray.remote(max_concurrency=max_concurrency)(BenchWorker)


def _nccl_env(log_dir: str, use_gpu: bool) -> Optional[Dict[str, Any]]:
    if not use_gpu:
        return None
    return {
        "env_vars": {
            "NCCL_DEBUG": "INFO",
            "NCCL_DEBUG_SUBSYS": NCCL_CAPTURE_SUBSYS,
            "NCCL_DEBUG_FILE": f"{log_dir}/nccl.%h.%p.log",
        }
    }


def run_benchmark(
    num_workers: int,
    use_gpu: bool,
    ops: Sequence[str],
    sizes: Sequence[int],
    iters: int,
    warmup: int,
    timeout_s: float,
) -> Dict:
    """Time ``ops`` x ``sizes`` on ``num_workers`` ranks; returns rows, logs and placement."""
    bundle = {"CPU": 1.0, "GPU": 1.0} if use_gpu else {"CPU": 1.0}
    log_dir = f"/tmp/raytrain-ext-doctor-{uuid.uuid4().hex[:8]}"
    group = WorkerGroup(bundle, "SPREAD", worker_class=remote_bench_class)
    try:
        try:
            group.start(
                num_workers,
                FormOptions("nccl" if use_gpu else "gloo", timeout_s, min(timeout_s, 120)),
                runtime_env=_nccl_env(log_dir, use_gpu),
            )
        except PlacementTimeout as e:
            raise TimeoutError(
                f"could not place {num_workers} bench workers with {bundle} each; "
                f"cluster resources: {ray.cluster_resources()}. Pass a smaller --workers"
            ) from e
        results = ray.get(
            group.call_async("sweep", list(ops), list(sizes), iters, warmup), timeout=timeout_s * 2
        )
        ray.get(group.call_async("remove_dir", log_dir), timeout=30)
        by_rank = sorted(results, key=lambda r: r["rank"])
        return {
            "backend": group.backend,
            "world_size": num_workers,
            "nodes": sorted({info.node_ip for info in group.infos}),
            "node_count": len({info.node_id for info in group.infos}),
            "rank_nodes": {rank: info.node_ip for rank, info in enumerate(group.infos)},
            "rows": by_rank[0]["rows"],
            "nccl_logs": [r["nccl_log"] for r in by_rank],
        }
    finally:
        group.shutdown()
