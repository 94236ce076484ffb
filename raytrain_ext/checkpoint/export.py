"""Export the full model of a committed checkpoint to Hugging Face safetensors.

Only the ``model.*`` tensors are read (DCP loads exactly the keys asked for),
without a process group, after verification against the manifest; from S3
only the verified byte ranges holding the model are fetched.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from raytrain_ext.checkpoint.manifest import MANIFEST, Manifest, parse_step_dir
from raytrain_ext.checkpoint.reader import (
    VerifiedReader,
    map_files,
)
from raytrain_ext.checkpoint.resolve import Resolution, newest_usable
from raytrain_ext.checkpoint.tiers.base import FetchMode, Tier, TierError
from raytrain_ext.checkpoint.tiers.disk import DiskTier
from raytrain_ext.checkpoint.tiers.s3 import S3Tier
from raytrain_ext.storage.paths import writable_file_problem
from raytrain_ext.storage.s3_errors import EXPORT_KEYS, endpoint_problem


class ExportError(ValueError):
    """Export cannot proceed; the message names the argument (RUN_OR_PATH, --to,
    --s3-endpoint-url) and the fix."""


def resolve(location: str, s3_endpoint_url: Optional[str] = None) -> Tuple[Tier, Resolution]:
    """A run dir, a checkpoints dir, a step dir, or an s3:// prefix/step -> (tier, the step to
    export and the newer steps skipped), by the same routine a training restore uses."""
    location = location.rstrip("/")
    parent, _, leaf = location.rpartition("/")
    step = parse_step_dir(leaf)
    if location.startswith("s3://"):
        problem = endpoint_problem(s3_endpoint_url, "--s3-endpoint-url")
        if problem:
            raise ExportError(problem)
        tier: Tier = S3Tier(
            parent if step is not None else location, endpoint_url=s3_endpoint_url, keys=EXPORT_KEYS
        )
    else:
        path = Path(location)
        if not path.exists():
            raise ExportError(
                f"RUN_OR_PATH: {location} does not exist. Give a run directory, "
                "its checkpoints directory, one step-<N> directory, or an s3:// URI."
            )
        if step is None and (path / "checkpoints").is_dir():
            path = path / "checkpoints"  # a run directory
        tier = DiskTier(Path(parent) if step is not None else path)
    try:
        found = newest_usable(tier, step)
    except TierError as e:
        raise ExportError(str(e)) from None
    if found.step is None:
        if found.skipped:
            raise ExportError(
                f"RUN_OR_PATH: no usable checkpoint in {location}: "
                f"{'; '.join(found.skipped)}. Export an older step by its "
                "step-<N> path."
            )
        raise ExportError(
            f"RUN_OR_PATH: {location} holds no committed checkpoint (no "
            f"step-<N>/{MANIFEST}). Point it at a run or checkpoint directory."
        )
    return tier, found


def load_model_state(
    tier: Tier, step: int, manifest: Manifest, cache_dir: Path
) -> Tuple[Dict[str, torch.Tensor], Dict]:
    """The ``model.*`` tensors, verified; from S3 only their byte ranges are fetched."""
    if tier.fetch_mode is FetchMode.ranged:
        fetch = tier.ranged_fetch(step, manifest, cache_dir)
        problem = fetch.fetch_metadata()
        state = _empty_model_state(fetch.metadata) if problem is None else {}
        problem = problem or fetch.prepare(state, is_coordinator=True)
        reader = fetch.reader()
        fetched = {"fetched_bytes": fetch.fetched_bytes, "ranged": fetch.ranged}
    else:
        directory = tier.materialize(step, sorted(manifest.files), cache_dir)
        reader = VerifiedReader(
            map_files(directory, sorted(manifest.files)), manifest, str(directory)
        )
        problem = reader.problem_before_load()
        state = _empty_model_state(reader.read_metadata()) if problem is None else {}
        fetched = {"fetched_bytes": sum(e.size for e in manifest.files.values()), "ranged": False}
    _refuse_damaged(problem)
    with warnings.catch_warnings():  # one process, on purpose: DCP's notice says only that
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    if isinstance(reader, VerifiedReader):  # it verifies the data files as it loads them
        _refuse_damaged(reader.problem)
    fetched["total_bytes"] = sum(e.size for e in manifest.files.values())
    return {key[len("model.") :]: tensor for key, tensor in state.items()}, fetched


def _refuse_damaged(problem: Optional[str]) -> None:
    if problem:
        raise ExportError(
            f"RUN_OR_PATH: refusing to export a damaged checkpoint: {problem}. "
            "Export an older step by its step-<N> path."
        )


def _empty_model_state(metadata) -> Dict[str, torch.Tensor]:
    return {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }


def read_newest_model(
    location: str, s3_endpoint_url: Optional[str] = None
) -> Tuple[Resolution, Dict[str, torch.Tensor], Dict]:
    """The newest usable checkpoint at ``location``, its verified model tensors and what
    was fetched for them (both export formats start here)."""
    tier, found = resolve(location, s3_endpoint_url)
    assert found.step is not None and found.manifest is not None
    try:
        with tempfile.TemporaryDirectory(prefix="raytrain-ext-export-") as cache:
            tensors, fetched = load_model_state(tier, found.step, found.manifest, Path(cache))
    except TierError as e:
        raise ExportError(str(e)) from None
    return found, tensors, fetched


def export_info(
    found: Resolution, tensors: Dict[str, torch.Tensor], out: Path, fetched: Dict
) -> Dict:
    """What an export wrote, for the command's summary line."""
    return {
        "step": found.step,
        "tensors": len(tensors),
        "out": str(out),
        "parameters": sum(t.numel() for t in tensors.values()),
        "skipped": found.skipped,
        **fetched,
    }


def export_safetensors(location: str, out: Path, s3_endpoint_url: Optional[str] = None) -> Dict:
    """Write the model of the newest usable checkpoint at ``location`` to ``out``."""
    from safetensors.torch import save_file

    problem = writable_file_problem(out, "--to")
    if problem:
        raise ExportError(problem)
    found, tensors, fetched = read_newest_model(location, s3_endpoint_url)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            str(out),
            metadata={"step": str(found.step), "format": "pt"},
        )
    except OSError as e:
        raise ExportError(
            f"--to: cannot write {out}: {e.strerror or e}. Point --to at a writable path."
        ) from None
    return export_info(found, tensors, out, fetched)
