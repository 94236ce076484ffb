"""Restoring DCP files at the speed of the medium: a storage reader over mapped bytes.

Why: DCP's ``FileSystemReader`` loads each item through ``torch.load`` (a read into a
fresh tensor), then copies it into its target, one item after another, after the caller
has hashed every file in a separate pass.  Here each file this rank's load plan touches
is a view of bytes already in reach (a private map of a file on disk or in the cache,
or the object store's buffer of the memory tier); a pool of threads verifies its
checksum chunks, which also brings a cold file in from the disk, several chunks at a
time, while each item whose chunks have passed is copied straight from the view into
its target.  The medium is read once and each byte is copied once.

Invariants: no item is copied from the medium before every checksum chunk it overlaps
has verified (an item this rank holds itself, :mod:`.held_chunks`, is copied from its
memory and its file is not fetched for it); the first failed chunk (or unreadable item)
stops the load and is kept in ``problem``, so the caller falls back to an older
checkpoint, whose load overwrites every target.
"""

from __future__ import annotations

import io
import mmap
import pickle
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from raytrain_ext.checkpoint.held_chunks import HeldChunks
from raytrain_ext.checkpoint.manifest import FileEntry, Manifest, checksum_bytes
from raytrain_ext.checkpoint.saved_tensor import tensor_view

METADATA = ".metadata"


class PlannedOnce(DefaultLoadPlanner):
    """DCP's default load planner, planning each restore once.

    Why: a restore plans before it fetches (it fetches only the files its plan reads,
    :func:`plan_files`), and ``dcp.load`` would plan the same targets again: flattening
    the state dict and matching every chunk, 10-20 ms of Python per 292 MB restore here.
    Given this planner, ``dcp.load`` gets the plan already made.

    Invariant: one planner per load of one targets dict.  ``dcp.load`` hands the planner
    a new top-level dict holding the same values; only ``load_bytes`` writes into it, so
    that dict replaces the planned one, and the flattened leaves and their paths (the
    same objects at the same places) stay.
    """

    def __init__(self) -> None:
        super().__init__()
        self._plan: Optional[LoadPlan] = None

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        if self._plan is None:
            super().set_up_planner(state_dict, metadata, is_coordinator)
        else:
            self.original_state_dict = state_dict

    def create_local_plan(self) -> LoadPlan:
        if self._plan is None:
            self._plan = super().create_local_plan()
        return self._plan


def plan_files(
    planner: PlannedOnce,
    targets: Dict,
    metadata,
    is_coordinator: bool,
    held: Optional[HeldChunks] = None,
) -> List[str]:
    """The data files this rank's DCP load plan reads, leaving out items this rank holds
    itself (``held``); ``planner`` keeps the plan for the load."""
    planner.set_up_planner(targets, metadata, is_coordinator)
    return sorted(
        {
            metadata.storage_data[item.storage_index].relative_path
            for item in planner.create_local_plan().items
            if held_source(held, metadata, item) is None
        }
    )


def held_source(held: Optional[HeldChunks], metadata, item: ReadItem) -> Optional[torch.Tensor]:
    """This rank's own tensor saved as ``item``'s chunk, when ``held`` has it."""
    if held is None or item.type == LoadItemType.BYTE_IO:
        return None
    index = item.storage_index
    chunk = metadata.state_dict_metadata[index.fqn].chunks[index.index]
    if tuple(chunk.offsets) != tuple(index.offset):
        return None
    return held.find(index.fqn, chunk.offsets, chunk.sizes)


def map_files(directory: Path, names: Iterable[str]) -> Dict[str, memoryview]:
    """Each file as a copy-on-write map (page cache, no read copy; writable, so torch
    can wrap it, but never written)."""
    views = {}
    for name in names:
        with open(directory / name, "rb") as f:
            size = f.seek(0, io.SEEK_END)
            if size == 0:
                views[name] = memoryview(bytearray())
                continue
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        mapped.madvise(mmap.MADV_SEQUENTIAL)  # larger readahead as the verifying threads go
        views[name] = memoryview(mapped)
    return views


def size_problem(views: Dict[str, memoryview], manifest: Manifest, where: str) -> Optional[str]:
    """A listed file that is missing or of the wrong size, described; or None."""
    for name, view in sorted(views.items()):
        entry = manifest.files.get(name)
        if entry is None:
            return f"{where}/{name} is not listed in the manifest"
        if view.nbytes != entry.size:
            return (
                f"{where}/{name} has {view.nbytes} bytes, the manifest says {entry.size} "
                "(truncated?)"
            )
    return None


def whole_file_problem(view: memoryview, entry: FileEntry, where: str) -> Optional[str]:
    actual = checksum_bytes(view)
    if actual != entry.xxh3_128:
        return f"{where} checksum {actual} != manifest {entry.xxh3_128} (corrupted)"
    return None


class VerifiedReader(dcp.FileSystemReader):
    """DCP storage reader over verified views of the checkpoint's files.

    ``views`` holds ``.metadata`` and, once ``add_views`` has run, every data file this
    rank's plan reads.  ``problem_before_load`` is the check a caller makes before
    ``dcp.load``.  ``path`` only names the checkpoint in messages and records.  ``held``:
    this rank's own chunks of the step being loaded (:mod:`.held_chunks`), copied from
    memory rather than read; ``held_bytes`` and ``read_bytes`` count both sources.
    """

    def __init__(
        self,
        views: Dict[str, memoryview],
        manifest: Manifest,
        path: str,
        threads: int = 4,
        held: Optional[HeldChunks] = None,
    ):
        super().__init__(path)
        self.where = path  # ``path`` is normalised as a local path ("memory:/run/...")
        self.views, self.manifest, self.threads = dict(views), manifest, max(1, threads)
        self.held = held
        self.problem: Optional[str] = None
        self.held_bytes = self.read_bytes = 0
        self._metadata = None

    def add_views(self, views: Dict[str, memoryview]) -> None:
        self.views.update(views)

    def problem_before_load(self) -> Optional[str]:
        """Every view's size against the manifest, then DCP's ``.metadata`` checksum (the
        data files are verified as they load)."""
        return size_problem(self.views, self.manifest, self.where) or whole_file_problem(
            self.views[METADATA], self.manifest.files[METADATA], f"{self.where}/{METADATA}"
        )

    def read_metadata(self, *args, **kwargs):
        """DCP's metadata, verified and unpickled once (the caller plans with it before
        ``dcp.load`` asks again)."""
        if self._metadata is None:
            view = self.views[METADATA]
            problem = whole_file_problem(
                view, self.manifest.files[METADATA], f"{self.where}/{METADATA}"
            )
            if problem:
                raise ValueError(problem)
            self._metadata = pickle.loads(view)
            self._metadata.storage_meta = self._metadata.storage_meta or dcp.metadata.StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        metadata = self.read_metadata()
        owned = {id(item): held_source(self.held, metadata, item) for item in plan.items}
        items = sorted((item for item in plan.items if owned[id(item)] is None), key=self._position)
        with ThreadPoolExecutor(self.threads, thread_name_prefix="ckpt-read") as pool:
            checks = self._submit_checks(pool, {self._file(item) for item in items})
            from_memory = [
                pool.submit(self._copy_held, item, planner, owned[id(item)])
                for item in plan.items
                if owned[id(item)] is not None
            ]
            loads = [
                pool.submit(self._load_tensor, item, planner, checks)
                for item in items
                if item.type != LoadItemType.BYTE_IO
            ]
            for item in items:  # small, and the planner stores them: on this thread
                if item.type == LoadItemType.BYTE_IO and self._verified(item, checks):
                    planner.load_bytes(item, io.BytesIO(self._slice(item).tobytes()))
            self.read_bytes += sum(load.result() for load in loads)
            self.held_bytes += sum(load.result() for load in from_memory)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done

    # ---- verification -----------------------------------------------------------------
    def _submit_checks(self, pool: ThreadPoolExecutor, names: Set[str]) -> Dict[str, List[Future]]:
        """One verification task per checksum chunk (or per file without chunk sums).

        Submitted before any load, so a load that waits for its chunks never holds a
        thread that a verification still needs.
        """
        checks: Dict[str, List[Future]] = {}
        for name in sorted(names):
            entry, view = self.manifest.files[name], self.views[name]
            where = f"{self.where}/{name}"
            if not entry.chunk_xxh3:
                checks[name] = [pool.submit(whole_file_problem, view, entry, where)]
                continue
            size, end = entry.chunk_size, view.nbytes
            checks[name] = [
                pool.submit(
                    _chunk_problem,
                    view[i * size : (i + 1) * size],
                    digest,
                    f"{where} bytes {i * size}-{min((i + 1) * size, end)}",
                )
                for i, digest in enumerate(entry.chunk_xxh3)
            ]
        return checks

    def _verified(self, item: ReadItem, checks: Dict[str, List[Future]]) -> bool:
        """Wait for the chunks ``item`` overlaps; False (and ``problem`` set) if any failed."""
        if self.problem is not None:
            return False
        name = self._file(item)
        info = self.storage_data[item.storage_index]
        futures = checks[name]
        size = self.manifest.files[name].chunk_size
        if size and len(futures) > 1:
            first = info.offset // size
            futures = futures[first : (info.offset + max(info.length, 1) - 1) // size + 1]
        for future in futures:
            problem = future.result()
            if problem is not None:
                self.problem = self.problem or problem
                return False
        return True

    # ---- loading ----------------------------------------------------------------------
    def _load_tensor(
        self, item: ReadItem, planner: LoadPlanner, checks: Dict[str, List[Future]]
    ) -> int:
        """Copy ``item`` from its verified view into its target; the bytes copied."""
        if not self._verified(item, checks):
            return 0
        info = self.storage_data[item.storage_index]
        try:
            blob = self._slice(item)
            if info.transform_descriptors:  # an extension's encoding: DCP's own path
                stream = self.transforms.transform_load_stream(
                    item, info.transform_descriptors, io.BytesIO(blob.tobytes())
                )
                source = torch.load(
                    io.BytesIO(stream.read()), map_location="cpu", weights_only=True
                )
            else:
                source = _saved_tensor(blob)
            return _copy_item(item, planner, source)
        except Exception as e:  # unreadable though its checksum passed: a format problem
            self.problem = self.problem or (
                f"{self.where}/{info.relative_path}: cannot load {item.storage_index.fqn} ({e})"
            )
            return 0

    def _copy_held(self, item: ReadItem, planner: LoadPlanner, source: torch.Tensor) -> int:
        try:
            return _copy_item(item, planner, source)
        except Exception as e:
            self.problem = self.problem or (
                f"{self.where}: cannot load {item.storage_index.fqn} from this rank's memory ({e})"
            )
            return 0

    def _file(self, item: ReadItem) -> str:
        return self.storage_data[item.storage_index].relative_path

    def _position(self, item: ReadItem):
        info = self.storage_data[item.storage_index]
        return info.relative_path, info.offset

    def _slice(self, item: ReadItem) -> memoryview:
        info = self.storage_data[item.storage_index]
        return self.views[info.relative_path][info.offset : info.offset + info.length]


def _copy_item(item: ReadItem, planner: LoadPlanner, saved: torch.Tensor) -> int:
    """Copy ``item``'s part of the ``saved`` chunk into its target; the bytes copied."""
    source = narrow_tensor_by_index(saved, item.storage_offsets, item.lengths)
    target = planner.resolve_tensor(item).detach()
    if target.size() != source.size():
        raise ValueError(
            f"{item.storage_index.fqn}: saved {list(source.size())}, target {list(target.size())}"
        )
    target.copy_(source)
    planner.commit_tensor(item, target)
    return source.numel() * source.element_size()


def _saved_tensor(blob: memoryview) -> torch.Tensor:
    """A view of the saved tensor; anything the view does not cover goes through
    ``torch.load`` (a copy, still correct)."""
    try:
        return tensor_view(blob)
    except (ValueError, pickle.UnpicklingError, zipfile.BadZipFile, KeyError):
        return torch.load(io.BytesIO(blob.tobytes()), map_location="cpu", weights_only=True)


def _chunk_problem(view: memoryview, digest: str, where: str) -> Optional[str]:
    actual = checksum_bytes(view)
    return None if actual == digest else f"{where} fail their checksum (corrupted)"
