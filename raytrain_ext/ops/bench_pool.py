"""A throwaway gang of Ray actors that forms a process group and times collectives.

The gang is formed the way training forms its own (placement group, ranks
assigned node by node with :func:`assign_ranks`, rendezvous on rank 0's node,
finite timeout, :func:`init_distributed`), so NCCL makes the same transport
choices it would make for a training job on these nodes.  On GPU the actors
start with ``NCCL_DEBUG=INFO`` and ``NCCL_DEBUG_FILE`` pointing at a per-process
file on their node; each actor returns its own file's text, so the driver
sees every rank's log without shared storage.  Bundles are spread over nodes
(SPREAD) so a multi-node cluster is measured across its network.

Invariant: whatever happens, :func:`run_benchmark` kills its actors and
removes its placement group before returning.
"""

from __future__ import annotations

import glob
import os
import shutil
import uuid
from typing import Dict, List, Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

NCCL_CAPTURE_SUBSYS = "INIT,NET,GRAPH,ENV"


class BenchWorker:
    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)

    def node_info(self) -> Dict:
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "hostname": os.uname().nodename,
        }

    def free_port(self) -> int:
        from raytrain_ext.worker.dist_env import free_port

        return free_port()

    def run(
        self,
        env: Dict,
        backend: str,
        timeout_s: float,
        ops: Sequence[str],
        sizes: Sequence[int],
        iters: int,
        warmup: int,
    ) -> Dict:
        from raytrain_ext.ops.collectives import run_sweep
        from raytrain_ext.worker.dist_env import WorkerEnv, destroy_distributed, init_distributed

        device = init_distributed(WorkerEnv(**env), backend, timeout_s)
        try:
            rows = run_sweep(ops, sizes, iters, warmup, device)
        finally:
            destroy_distributed()
        return {"rank": env["rank"], "rows": rows, "nccl_log": self._own_nccl_log()}

    def _own_nccl_log(self) -> str:
        text = ""
        for path in glob.glob(os.path.join(self.log_dir, f"nccl.*.{os.getpid()}.log")):
            with open(path, errors="replace") as f:
                text += f.read()
            os.unlink(path)
        return text

    def cleanup(self) -> None:
        shutil.rmtree(self.log_dir, ignore_errors=True)


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
    from raytrain_ext.worker.dist_env import WorkerEnv, assign_ranks

    bundle = {"CPU": 1.0, "GPU": 1.0} if use_gpu else {"CPU": 1.0}
    log_dir = f"/tmp/raytrain-ext-doctor-{uuid.uuid4().hex[:8]}"
    env_vars = (
        {
            "NCCL_DEBUG": "INFO",
            "NCCL_DEBUG_SUBSYS": NCCL_CAPTURE_SUBSYS,
            "NCCL_DEBUG_FILE": f"{log_dir}/nccl.%h.%p.log",
        }
        if use_gpu
        else {}
    )
    pg = placement_group([dict(bundle)] * num_workers, strategy="SPREAD")
    actors: List = []
    try:
        ready, _ = ray.wait([pg.ready()], timeout=min(timeout_s, 120))
        if not ready:
            raise TimeoutError(
                f"could not place {num_workers} bench workers with {bundle} each; "
                f"cluster resources: {ray.cluster_resources()}. Pass a smaller --workers"
            )
        cls = ray.remote(BenchWorker)
        actors = [
            cls.options(
                num_cpus=1,
                num_gpus=1 if use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i),
                runtime_env={"env_vars": env_vars} if env_vars else None,
            ).remote(log_dir)
            for i in range(num_workers)
        ]
        infos = ray.get([a.node_info.remote() for a in actors], timeout=timeout_s)
        envs = assign_ranks(
            [i["node_id"] for i in infos],
            [i["gpu_ids"] for i in infos],
            [i["node_ip"] for i in infos],
            port=0,
        )
        port = ray.get(
            actors[min(range(num_workers), key=lambda i: envs[i].rank)].free_port.remote()
        )
        envs = [WorkerEnv(**{**e.to_dict(), "master_port": port}) for e in envs]
        backend = "nccl" if use_gpu else "gloo"
        results = ray.get(
            [
                a.run.remote(e.to_dict(), backend, timeout_s, list(ops), list(sizes), iters, warmup)
                for a, e in zip(actors, envs)
            ],
            timeout=timeout_s * 2,
        )
        ray.get([a.cleanup.remote() for a in actors], timeout=30)
        by_rank = sorted(results, key=lambda r: r["rank"])
        return {
            "backend": backend,
            "world_size": num_workers,
            "nodes": sorted({i["node_ip"] for i in infos}),
            "node_count": len({i["node_id"] for i in infos}),
            "rank_nodes": {e.rank: infos[i]["node_ip"] for i, e in enumerate(envs)},
            "rows": by_rank[0]["rows"],
            "nccl_logs": [r["nccl_log"] for r in by_rank],
        }
    finally:
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead; nothing left to release
                pass
        remove_placement_group(pg)
