"""What the controller tells operators about a running group: stragglers and hang stacks.

Kept apart from the state machine: these functions read the group and the
records and write logs and files; they decide nothing about the run except
flagging a straggler for eviction, which the controller then executes.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional

import ray

log = logging.getLogger(__name__)


def newly_flagged_stragglers(
    record: Dict[str, Any], infos: List[Dict[str, Any]], already_named: set, window: int
) -> List[Dict[str, Any]]:
    """One entry per rank flagged in ``record`` for the first time, named with node and GPU."""
    times = record.get("rank_compute_s", [])
    entries = []
    for rank in record.get("stragglers", []):
        if rank in already_named or rank >= len(infos) or rank >= len(times):
            continue
        already_named.add(rank)
        info = infos[rank]
        others = sorted(t for r, t in enumerate(times) if r != rank)
        entry = {
            "step": record["step"],
            "rank": rank,
            "node_ip": info["node_ip"],
            "node_id": info["node_id"],
            "gpu_ids": info["gpu_ids"],
            "compute_s": times[rank],
            "peers_median_s": others[len(others) // 2],
        }
        log.warning(
            "controller: straggler rank %d (node %s, GPU %s): compute %.1f ms per step "
            "vs %.1f ms median of the other ranks for %d steps",
            rank,
            info["node_ip"],
            ",".join(info["gpu_ids"]) or "none",
            entry["compute_s"] * 1e3,
            entry["peers_median_s"] * 1e3,
            window,
        )
        entries.append(entry)
    return entries


def dump_worker_stacks(
    actors: List[Any], infos: List[Dict[str, Any]], out: Path, attempt: int, timeout_s: float = 10.0
) -> Optional[Path]:
    """Every live worker's Python stacks into ``out/attempt<k>-rank<r>.txt``.

    A dead or unresponsive worker gets a file saying why, so the set of files
    always covers every rank of the group.
    """
    out.mkdir(parents=True, exist_ok=True)
    refs = [actor.dump_stacks.remote() for actor in actors]
    for rank, ref in enumerate(refs):
        try:
            text = ray.get(ref, timeout=timeout_s)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
            text = f"no stacks: {type(e).__name__}: {e}"
        info = infos[rank]
        header = f"rank {rank} node {info['node_ip']} pid {info['pid']} attempt {attempt}\n"
        (out / f"attempt{attempt}-rank{rank}.txt").write_text(header + text)
    log.error("controller: stacks of every worker written to %s", out)
    return out
