"""Every worker's Python stacks, written for an operator when the group hangs.

Reads the group's actors and writes files; decides nothing about the run.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, List, Optional

import ray

from raytrain_ext.messages import RankInfo

log = logging.getLogger(__name__)


def dump_worker_stacks(
    actors: List[Any], infos: List[RankInfo], out: Path, attempt: int, timeout_s: float = 10.0
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
        header = f"rank {rank} node {info.node_ip} pid {info.pid} attempt {attempt}\n"
        (out / f"attempt{attempt}-rank{rank}.txt").write_text(header + text)
    log.error("controller: stacks of every worker written to %s", out)
    return out
