"""Registered state written as DCP shards into each reported checkpoint, and loaded back.

Why: the copies ``registered`` keeps live only in processes.  A run restarted from
storage, or a group for which no live process holds some part (pure FSDP without
``copy_to_peer`` after a lost rank, a lost node), starts from the newest checkpoint.  With
the registered objects' state in that checkpoint, ``register`` loads them from it, at any
world size and layout (DCP reshards), so the loop needs no save or load code of its own
for what it registered.

At a report that carries a checkpoint on any rank, every rank writes its part of the
registered state with ``dcp.save`` into ``REGISTERED_DIR`` of its staged files (each
rank's ``__<rank>_0.distcp`` and ``checksums-<rank>.json``, the xxh3 of each file it wrote,
computed as the bytes went out; rank 0's ``.metadata``).  Every rank's staged files are
then held in the run's memory tier (this node and another) and uploaded with the report's,
and the report commits once all of them landed.  ``load`` verifies every file against the
ranks' checksums before DCP reads it.

Invariants: the write and the load are collectives on the session's gloo group, made by
every rank at the same report (agreed in the report's all-gather) or in the same
``register``; the write reads the live objects after every rank agreed on the report and
before the loop changes them again.  A checkpoint without ``REGISTERED_DIR`` (Ray
Train's, or one reported before ``register``) loads nothing.  A write that fails on any
rank fails on every rank (DCP gathers the ranks' outcomes), and the report then keeps no
checkpoint: one without the registered state would resume the loop from state it lacks.
"""

from __future__ import annotations

import json
import os
import posixpath
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, Optional, Set

import pyarrow.fs as pafs
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import _init_optim_state

from raytrain_ext.checkpoint.agreement import gather_from_all
from raytrain_ext.checkpoint.manifest import CHUNK, FileEntry, Manifest, checksum_file, verify_dir
from raytrain_ext.checkpoint.state import tensor_bytes
from raytrain_ext.checkpoint.writer import ChecksummingWriter
from raytrain_ext.user_loop.checkpoint import Checkpoint
from raytrain_ext.user_loop.registered_state import state_of, unwrapped
from raytrain_ext.user_loop.staging import Staged

REGISTERED_DIR = "raytrain_ext_registered"
METADATA = ".metadata"  # DCP's metadata file, written by rank 0 last
CHECKSUMS = "checksums-"  # each rank's list of the files it wrote: checksums-<rank>.json


class RegisteredFiles:
    """The registered state's DCP files in a group's checkpoints (``group``: the session's
    gloo group; every method is a collective on it)."""

    def __init__(self, group: Any = None):
        self.group = group

    def add_to(self, staged: Optional[Staged], objects: Dict[str, Any], run_name: str) -> Staged:
        """``staged`` with this rank's part of the registered state added under
        ``REGISTERED_DIR`` (a new staging directory for a rank that reported no files of
        its own).  Raises DCP's ``CheckpointException`` on every rank when any failed."""
        new = staged is None
        if staged is None:
            staged = Staged(tempfile.mkdtemp(prefix=f"raytrain-ext-{run_name}-report-"), (), {})
        target = os.path.join(staged.directory, REGISTERED_DIR)
        # checksummed as written (no zip CRC-32), not fsynced: the upload persists them
        writer = ChecksummingWriter(target, CHUNK, sync_files=False)
        try:
            dcp.save(state_of(objects), storage_writer=writer, process_group=self.group)
            rank = dist.get_rank(self.group) if dist.is_initialized() else 0
            write_checksums(Path(target), rank, writer.entries)
        except BaseException:
            shutil.rmtree(staged.directory if new else target, ignore_errors=True)
            raise
        written = [
            os.path.relpath(os.path.join(here, name), staged.directory)
            for here, _, files in os.walk(target)
            for name in files
        ]
        return Staged(staged.directory, staged.names + tuple(sorted(written)), staged.stamps)

    def load(self, objects: Dict[str, Any], checkpoint: Checkpoint) -> Optional[Dict[str, Any]]:
        """Load the registered state ``checkpoint`` holds into ``objects`` (freshly built,
        any layout); None, loading nothing, when it holds none.  Returns what was read."""
        started = time.perf_counter()
        part = Checkpoint(posixpath.join(checkpoint.path, REGISTERED_DIR), checkpoint.filesystem)
        found = part.filesystem.get_file_info(posixpath.join(part.path, METADATA))
        if found.type != pafs.FileType.File:
            return None
        with part.as_directory() as directory:
            damage = damage_in(Path(directory))
            problem, target = None, {}
            if damage is not None:
                problem = (
                    f"register(): the registered state in {checkpoint.path} is damaged: "
                    f"{damage}; resume from an earlier checkpoint (resume_from_checkpoint)"
                )
            reader = dcp.FileSystemReader(directory)
            if problem is None:
                metadata = reader.read_metadata()
                target = load_target(objects, metadata)
                problem = names_problem(
                    {path[0] for path in metadata.planner_data.values()}, target
                )
            problem = self._agreed(problem)  # no rank goes into the load another refused
            if problem is not None:
                raise ValueError(problem)
            dcp.load(target, storage_reader=reader, process_group=self.group)
        install_loaded(objects, target)
        return {"bytes": tensor_bytes(target), "load_s": time.perf_counter() - started}

    def _agreed(self, problem: Optional[str]) -> Optional[str]:
        """The first rank's problem with the files, on every rank (one all-gather)."""
        if not dist.is_initialized():
            return problem
        return next((p for p in gather_from_all(problem, self.group) if p is not None), None)


def write_checksums(directory: Path, rank: int, entries: Dict[str, FileEntry]) -> None:
    """This rank's ``checksums-<rank>.json``: each DCP file it wrote (rank 0's
    ``.metadata`` too), its size and xxh3 checksum."""
    files = dict(entries)
    if (directory / METADATA).exists():
        files[METADATA] = checksum_file(directory / METADATA, CHUNK)
    listed = {name: asdict(entry) for name, entry in sorted(files.items())}
    (directory / f"{CHECKSUMS}{rank}.json").write_text(json.dumps(listed))


def damage_in(directory: Path) -> Optional[str]:
    """What is wrong with the DCP files in ``directory`` against every rank's checksums of
    them (a file missing, truncated or corrupted), or None."""
    files: Dict[str, FileEntry] = {}
    for listed in sorted(directory.glob(f"{CHECKSUMS}*.json")):
        for name, entry in json.loads(listed.read_text()).items():
            files[name] = FileEntry(**entry)
    if METADATA not in files:
        return f"{directory / CHECKSUMS}0.json, rank 0's list of its files, is missing"
    return verify_dir(directory, Manifest(step=0, world_size=0, tier="", files=files))


def load_target(objects: Dict[str, Any], metadata: Metadata) -> Dict[str, Any]:
    """What DCP loads into: each object's state, its tensors the live ones; a dict of plain
    values as the checkpoint holds it (every key saved, as a live copy restores it, not
    only those the fresh dict has).  An optimizer that has not stepped yet gets its state
    first (torch's own zero-gradient step at learning rate 0), so its moments have
    somewhere to go."""
    target: Dict[str, Any] = {}
    for name, obj in objects.items():
        if isinstance(obj, dict):
            target[name] = saved_dict(name, metadata)
            continue
        if isinstance(obj, torch.optim.Optimizer):
            _init_optim_state(obj)
        target[name] = unwrapped(obj).state_dict()
    return target


def saved_dict(name: str, metadata: Metadata) -> Dict[str, Any]:
    """The dict registered as ``name`` with the checkpoint's keys (nested dicts and lists
    as saved), each value a placeholder DCP loads into: a host tensor of the saved size
    and dtype, or None for any other value."""
    root: Dict[str, Any] = {}
    for fqn, path in metadata.planner_data.items():
        if path[0] != name:
            continue
        item = metadata.state_dict_metadata[fqn]
        placeholder = None
        if isinstance(item, TensorStorageMetadata):
            placeholder = torch.empty(item.size, dtype=item.properties.dtype)
        set_element(root, path, placeholder)
    return root.get(name, {})


def install_loaded(objects: Dict[str, Any], target: Dict[str, Any]) -> None:
    """Hand what DCP loaded to the objects: a dict's values in place, else through its
    ``load_state_dict`` (which also sets what DCP does not load in place: an optimizer's
    hyperparameters, a module whose ``state_dict`` returned copies)."""
    for name, obj in objects.items():
        if isinstance(obj, dict):
            obj.clear()
            obj.update(target[name])
        else:
            unwrapped(obj).load_state_dict(target[name])


def names_problem(saved: Set[str], target: Dict[str, Any]) -> Optional[str]:
    """Unless the checkpoint holds the state of the objects registered now, by the same
    names (an object whose state is empty, a stateless optimizer's moments, saves
    nothing), what is wrong."""
    registered = {name for name, state in target.items() if state}
    if registered <= saved <= set(target):
        return None
    return (
        f"register(): the checkpoint's registered state holds {sorted(saved)}, this group "
        f"registered {sorted(target)}; register the same objects, by the same names, in "
        "every run that resumes from it"
    )
