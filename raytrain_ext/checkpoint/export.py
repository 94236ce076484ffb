"""Export the full model of a committed checkpoint to Hugging Face safetensors.

Only the ``model.*`` tensors are read (DCP loads exactly the keys asked for),
without a process group, after verification against the manifest; from S3
only the verified byte ranges holding the model are fetched.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from raytrain_ext.checkpoint.disk import DiskTier
from raytrain_ext.checkpoint.manifest import MANIFEST, parse_step_dir, verify_dir
from raytrain_ext.checkpoint.ranged import PlannedS3Fetch
from raytrain_ext.checkpoint.s3 import S3Tier
from raytrain_ext.checkpoint.tier import Tier


def resolve(location: str, s3_endpoint_url: Optional[str] = None) -> Tuple[Tier, int]:
    """A run dir, a checkpoints dir, a step dir, or an s3:// prefix/step -> (tier, step)."""
    location = location.rstrip("/")
    parent, _, leaf = location.rpartition("/")
    step = parse_step_dir(leaf)
    if location.startswith("s3://"):
        tier: Tier = S3Tier(parent if step is not None else location, endpoint_url=s3_endpoint_url)
    else:
        path = Path(location)
        if step is None and (path / "checkpoints").is_dir():
            path = path / "checkpoints"  # a run directory
        tier = DiskTier(Path(parent) if step is not None else path)
    if step is None:
        committed = tier.committed_steps()
        if not committed:
            raise FileNotFoundError(f"{location}: no committed checkpoint (no step-<N>/{MANIFEST})")
        step = committed[-1]
    return tier, step


def load_model_state(tier: Tier, step: int, cache_dir: Path) -> Tuple[Dict[str, torch.Tensor], Dict]:
    """The ``model.*`` tensors, verified; from S3 only their byte ranges are fetched."""
    manifest = tier.read_manifest(step)
    if manifest is None:
        raise FileNotFoundError(f"step {step} has no valid {MANIFEST}: it was never committed")
    if isinstance(tier, S3Tier):
        fetch = PlannedS3Fetch(tier, step, manifest, cache_dir)
        problem = fetch.fetch_metadata()
        state = _empty_model_state(fetch.metadata) if problem is None else {}
        problem = problem or fetch.prepare(state, is_coordinator=True)
        reader = fetch.reader()
        fetched = {"fetched_bytes": fetch.fetched_bytes, "ranged": fetch.ranged}
    else:
        directory = tier.materialize(step, sorted(manifest.files), cache_dir)
        problem = verify_dir(directory, manifest)
        reader = dcp.FileSystemReader(directory)
        state = _empty_model_state(reader.read_metadata()) if problem is None else {}
        fetched = {"fetched_bytes": sum(e.size for e in manifest.files.values()), "ranged": False}
    if problem:
        raise ValueError(f"refusing to export a damaged checkpoint: {problem}")
    dcp.load(state, storage_reader=reader, no_dist=True)
    fetched["total_bytes"] = sum(e.size for e in manifest.files.values())
    return {key[len("model."):]: tensor for key, tensor in state.items()}, fetched


def _empty_model_state(metadata) -> Dict[str, torch.Tensor]:
    return {key: torch.empty(meta.size, dtype=meta.properties.dtype)
            for key, meta in metadata.state_dict_metadata.items()
            if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}


def export_safetensors(location: str, out: Path, s3_endpoint_url: Optional[str] = None) -> Dict:
    from safetensors.torch import save_file

    tier, step = resolve(location, s3_endpoint_url)
    with tempfile.TemporaryDirectory(prefix="raytrain-ext-export-") as cache:
        tensors, fetched = load_model_state(tier, step, Path(cache))
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out),
              metadata={"step": str(step), "format": "pt"})
    return {"step": step, "tensors": len(tensors), "out": str(out),
            "parameters": sum(t.numel() for t in tensors.values()), **fetched}
