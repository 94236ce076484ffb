"""Everything about a run that can be checked on the driver, checked before Ray starts.

``Trainer.fit`` calls :func:`preflight` first: a run that fails it has written nothing
and started nothing.  Order: local paths (run directory, checkpoint and profile
directories), the S3 tier (a real write probe), an explicit ``checkpoint.resume``, then
the data.  The schedule is not refused but said out loud (:func:`schedule_warnings`).
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

from raytrain_ext.checkpoint.resolve import newest_usable
from raytrain_ext.checkpoint.tiers.base import TierError
from raytrain_ext.config.validate import schedule_warnings
from raytrain_ext.data.config import DataFormat
from raytrain_ext.data.stream_input import is_stream
from raytrain_ext.errors import InputError
from raytrain_ext.inputs.data_check import check_token_data
from raytrain_ext.inputs.text_data_check import (
    check_document_mask,
    check_eval_split,
    check_record_data,
    uses_records,
)
from raytrain_ext.storage.paths import writable_dir_problem

log = logging.getLogger(__name__)


def preflight(cfg) -> None:
    """Log schedule warnings; raise :class:`InputError` for the first problem found."""
    for warning in schedule_warnings(cfg):
        log.warning("%s", warning)
    _check_paths(cfg)
    _check_ray_address(cfg)
    _check_s3_tier(cfg)
    _check_resume(cfg)
    check_eval_split(cfg)
    check_document_mask(cfg)
    if is_stream(cfg.data.path):  # the reader checks the stream's records as it reads them
        return
    if cfg.data.format == DataFormat.prompts:
        from raytrain_ext.rollout.prompt_records import check_prompt_data

        check_prompt_data(cfg)
    elif uses_records(cfg):
        check_record_data(cfg)
    else:
        check_token_data(cfg)


def _check_paths(cfg) -> None:
    wanted = [("run.output_dir", Path(cfg.run.output_dir) / cfg.run.name)]
    c = cfg.checkpoint
    if c.enabled and c.local and not str(c.dir).startswith("s3://"):
        wanted.append(("checkpoint.dir", Path(c.dir)))
    if list(cfg.profile.steps):
        wanted.append(("profile.dir", Path(cfg.profile.dir)))
    for key, path in wanted:
        problem = writable_dir_problem(path, key)
        if problem:
            raise InputError(problem)


def _check_ray_address(cfg) -> None:
    """A cluster address must answer: ``ray.init`` would otherwise wait minutes for it.
    Not checked when this process is already attached to Ray (``fit`` uses that session)."""
    import ray

    if ray.is_initialized():
        return
    key, address = "scaling.ray_address", cfg.scaling.ray_address
    if not address:
        key, address = "RAY_ADDRESS", os.environ.get("RAY_ADDRESS")
    if not address or ray_address_reachable(address):
        return
    raise InputError(
        f"{key}: nothing answers at {address} (no Ray head there, or a firewall). "
        "Give the head's address (host:6379 on the cluster, ray://host:10001 from "
        f"outside it), or unset {key} to start a private local Ray."
    )


def ray_address_reachable(address: str, timeout_s: float = 3.0) -> bool:
    """True for ``auto``/``local`` and for a ``[scheme://]host:port`` that accepts a
    connection (a bare host without a port is left to Ray)."""
    if address in ("auto", "local"):
        return True
    host, _, port = address.split("://")[-1].rstrip("/").rpartition(":")
    if not port.isdigit():
        return True
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _check_s3_tier(cfg) -> None:
    if not (cfg.checkpoint.enabled and cfg.checkpoint.s3.uri):
        return
    from raytrain_ext.checkpoint.tiers import s3_tier

    try:
        s3_tier(cfg.checkpoint, cfg.checkpoint.s3.uri).probe()
    except TierError as e:
        raise InputError(str(e)) from None


def _check_resume(cfg) -> None:
    """An explicit ``checkpoint.resume`` must name a usable checkpoint."""
    resume = cfg.checkpoint.resume
    if resume in ("auto", "never"):
        return
    from raytrain_ext.checkpoint.restore import split_location
    from raytrain_ext.checkpoint.tiers import tier_for_location

    location, step = split_location(resume)
    if not location.startswith("s3://") and not Path(resume).is_dir():
        raise InputError(
            f"checkpoint.resume: {resume} does not exist. Point it at one "
            "step-<N> directory of a checkpoint, or use auto or never."
        )
    try:
        found = newest_usable(tier_for_location(cfg.checkpoint, location), step)
    except TierError as e:
        raise InputError(str(e)) from None
    if found.step is None:
        raise InputError(
            f"checkpoint.resume: {found.skipped[0]}. Point checkpoint.resume at "
            "another step, or use auto to take the newest usable one."
        )
