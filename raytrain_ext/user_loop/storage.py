"""Where reported checkpoints persist: ``<storage_path>/<name>/checkpoint_<NNNNNN>/``.

Layout and commit rule (the invariant ``get_checkpoint`` and ``Result`` rely on):
each rank that passed a directory to report ``N`` uploads its files into
``checkpoint_N/`` (the user's files only) and then writes
``.uploads/checkpoint_N.rank-<r>`` holding its group's id (``.failed`` appended when the
upload failed); rank 0 writes ``.committed/checkpoint_N.json`` (the report's index, metrics,
uploading ranks and each dataset shard's position) only once every uploading rank's marker holds *this* group's id.  A
checkpoint without its commit record is never returned: an upload that failed or a rank
lost mid-upload leaves it uncommitted, and a marker an earlier group left at the same
index (a group that rewound past it, an earlier ``fit``) never counts.  A new group's rank
0 first removes what earlier groups left beyond the checkpoint it resumes from
(``discard_after``), so a larger earlier group's files do not join a later checkpoint.
Retention follows Ray Train's ``CheckpointConfig``: ``num_to_keep`` by
``checkpoint_score_attribute`` (newest first when none), the newest committed one kept
always (it is the one a restart resumes from).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import pyarrow.fs as pafs

from raytrain_ext.user_loop.checkpoint import Checkpoint

UPLOADED, FAILED = "uploaded", ".failed"
COMMITS = ".committed"
UPLOADS = ".uploads"
PREFIX = "checkpoint_"
READ_RETRY_DELAYS_S = (0.1, 0.2, 0.4)  # a transient broken read is tried again after these


@dataclass(frozen=True)
class Retention:
    """Ray Train's ``CheckpointConfig``, as plain values."""

    num_to_keep: Optional[int] = None
    score_attribute: Optional[str] = None
    score_order: str = "max"


@dataclass(frozen=True)
class Committed:
    """A persisted report: its index (the report's count, 1-based), metrics and files."""

    index: int
    metrics: Dict[str, Any]
    checkpoint: Checkpoint
    ranks: Sequence[int] = ()  # the ranks whose files it holds
    positions: Dict[str, Any] = field(default_factory=dict)  # each dataset shard's [epoch, row]


def storage_root(storage_path: str, name: str, filesystem: Optional[pafs.FileSystem]):
    """(filesystem, the run's directory on it) for ``storage_path`` (a local path or a URI
    such as ``s3://bucket/prefix``) and the run's ``name``."""
    if filesystem is not None:
        root = storage_path.split("://", 1)[-1]
    elif "://" in storage_path:
        filesystem, root = pafs.FileSystem.from_uri(storage_path)
    else:
        filesystem, root = pafs.LocalFileSystem(), os.path.abspath(storage_path)
    return filesystem, f"{root.rstrip('/')}/{name}"


class RunStorage:
    """One run's checkpoints on a pyarrow filesystem (picklable: every rank gets one)."""

    def __init__(self, filesystem: pafs.FileSystem, root: str, retention: Retention):
        self.fs, self.root, self.retention = filesystem, root, retention

    def directory(self, index: int) -> str:
        return f"{self.root}/{PREFIX}{index:06d}"

    def _uploaded(self, index: int, rank: int) -> str:
        return f"{self.root}/{UPLOADS}/{PREFIX}{index:06d}.rank-{rank}"

    def _commit_record(self, index: int) -> str:
        return f"{self.root}/{COMMITS}/{PREFIX}{index:06d}.json"

    def upload(
        self,
        local_dir: str,
        index: int,
        rank: int,
        group: str,
        verify: Callable[[], None] = lambda: None,
    ) -> None:
        """This rank's files of report ``index``, then ``verify()`` (which raises when what
        was uploaded is not what was reported), then its marker; on failure a failed
        marker, so rank 0's commit gives up at once, and the error raised."""
        marker = self._uploaded(index, rank)
        try:
            target = self.directory(index)
            self.fs.create_dir(target, recursive=True)
            pafs.copy_files(
                local_dir,
                target,
                source_filesystem=pafs.LocalFileSystem(),
                destination_filesystem=self.fs,
            )
            verify()
        except BaseException:
            self._write(marker + FAILED, group.encode())
            raise
        self._write(marker, group.encode())

    def commit(
        self,
        index: int,
        ranks: Sequence[int],
        metrics: Dict[str, Any],
        positions: Dict[str, Any],
        group: str,
        still_wanted: Callable[[], bool],
        timeout_s: float,
    ) -> bool:
        """Write ``index``'s commit record once every rank in ``ranks`` uploaded in
        ``group`` (polled); False, and nothing written, as soon as one's upload failed,
        once ``still_wanted()`` is False (a new group started) or after ``timeout_s``.
        Each poll reads only the markers not landed yet (a rank writes one marker per
        upload, so one that landed stays landed)."""
        deadline = time.monotonic() + timeout_s
        pending = list(ranks)
        while True:
            states = {rank: self._upload_state(index, rank, group) for rank in pending}
            if FAILED in states.values():
                return False
            pending = [rank for rank, state in states.items() if state != UPLOADED]
            if not pending:
                break
            if not still_wanted() or time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        if not still_wanted():  # a new group began meanwhile: it may remove these files
            return False
        record = {"index": index, "metrics": metrics, "ranks": list(ranks), "positions": positions}
        self._write(self._commit_record(index), json.dumps(record).encode())
        return True

    def discard_after(self, index: int) -> None:
        """Remove the checkpoints, markers and commit records of reports after ``index``
        (records first: a checkpoint is never listed without its files)."""
        for base in (f"{self.root}/{COMMITS}", self.root, f"{self.root}/{UPLOADS}"):
            selector = pafs.FileSelector(base, allow_not_found=True)
            for info in self.fs.get_file_info(selector):
                name = info.base_name
                if not name.startswith(PREFIX) or _index_of(name) <= index:
                    continue
                if info.type == pafs.FileType.Directory:
                    self.fs.delete_dir(info.path)
                else:
                    self.fs.delete_file(info.path)

    def _upload_state(self, index: int, rank: int, group: str) -> Optional[str]:
        marker, wanted = self._uploaded(index, rank), group.encode()
        if self._read(marker) == wanted:  # the usual case: one read
            return UPLOADED
        return FAILED if self._read(marker + FAILED) == wanted else None

    def committed(self) -> List[Committed]:
        """Every committed checkpoint, oldest first."""
        selector = pafs.FileSelector(f"{self.root}/{COMMITS}", allow_not_found=True)
        found = []
        for info in self.fs.get_file_info(selector):
            record = self._read_json(info.path) if info.path.endswith(".json") else None
            if record is not None:
                index = record["index"]
                checkpoint = Checkpoint(self.directory(index), self.fs)
                positions = record.get("positions", {})  # none: a record of an earlier version
                found.append(
                    Committed(index, record["metrics"], checkpoint, record["ranks"], positions)
                )
        return sorted(found, key=lambda c: c.index)

    def latest(self) -> Optional[Committed]:
        found = self.committed()
        return found[-1] if found else None

    def ranked(self) -> List[Committed]:
        """Committed checkpoints best first (by the score attribute; newest first without
        one, or for those whose metrics lack it)."""
        found = list(reversed(self.committed()))
        key = self.retention.score_attribute
        if key is None:
            return found
        scored = [c for c in found if isinstance(c.metrics.get(key), (int, float))]
        unscored = [c for c in found if c not in scored]
        scored.sort(key=lambda c: c.metrics[key], reverse=self.retention.score_order == "max")
        return scored + unscored

    def best(self) -> List[Committed]:
        """The ``num_to_keep`` best, worst first, as Ray Train's ``Result.best_checkpoints``
        lists them (the newest, kept to resume from, is not among them unless it scores)."""
        keep = self.retention.num_to_keep
        ranked = self.ranked()
        return list(reversed(ranked if keep is None else ranked[:keep]))

    def prune(self) -> List[int]:
        """Delete what retention drops (the newest committed stays); the indices deleted."""
        keep = self.retention.num_to_keep
        if keep is None:
            return []
        ranked = self.ranked()
        newest = max((c.index for c in ranked), default=None)
        dropped = [c for c in ranked[keep:] if c.index != newest]
        for c in dropped:
            self.fs.delete_file(self._commit_record(c.index))  # uncommitted first
            self.fs.delete_dir(c.checkpoint.path)
            for rank in c.ranks:
                self.fs.delete_file(self._uploaded(c.index, rank))
        return [c.index for c in dropped]

    def _write(self, path: str, data: bytes) -> None:
        self.fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        with self.fs.open_output_stream(path) as out:
            out.write(data)

    def _read(self, path: str) -> Optional[bytes]:
        """The file's bytes, or None when it does not exist.  A read that breaks after
        the request succeeded (S3's "failed to flush response stream") is outside the
        filesystem's own request retries, so it is tried again a few times."""
        for delay_s in (*READ_RETRY_DELAYS_S, None):
            try:
                with self.fs.open_input_stream(path) as f:
                    return f.read()
            except FileNotFoundError:
                return None
            except OSError:
                if delay_s is None:
                    raise
                time.sleep(delay_s)
        return None  # not reached: the last attempt returns or raises

    def _read_json(self, path: str) -> Optional[Dict[str, Any]]:
        data = self._read(path)
        return None if data is None else json.loads(data)


def _index_of(name: str) -> int:
    """The report index in ``checkpoint_000012`` or ``checkpoint_000012.rank-3[.failed]``."""
    return int(name[len(PREFIX) :].split(".", 1)[0])
